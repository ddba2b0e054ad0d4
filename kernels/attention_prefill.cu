// Causal prefill attention of one chunk of one sequence over the paged K/V cache on tensor cores, in
// the manner of flash-attention 2's forward pass: bf16 mma.sync m16n8k16 with f32 accumulation and an
// online softmax, so the scores never leave registers.
//
// Rows of the problem are (query position, query head) pairs of one KV head's group of G = hq / hkv
// query heads, numbered m = r·G + j (query r of the chunk, head kh·G + j): a block owns AP_BM = 64
// consecutive such rows of one KV head (four warps of 16 rows), so each K/V row it loads serves all
// G heads. It walks its span of context positions in tiles of BN keys gathered through the block
// table with cp.async (the V tile loads while the scores of the K tile are computed, the next K tile
// while P·V is), masks keys past each row's position (and keys whose block id is out of the pool),
// and skips tiles past the last row's position. P is rounded to bf16 for the second product; its row
// sums are taken over the rounded values, so the weights stay normalised.
//
// With one span (splits = 1) the block writes out = softmax(q·kᵀ·scale)·v · sigmoid(gate) rounded
// once to bf16. With several spans (a short chunk over a long context, where the tiles alone would
// leave the GPU idle) it writes attention.cu's split workspace instead (unnormalised Σ e·v and
// (max, Σ e) in natural-log units) for attn_paged_reduce to merge and gate.
//
// Cache layout as attention.cu: k_pool, v_pool [num_blocks, bs, hkv·D]; position p lies in block
// table[p / bs], row p % bs.
#include "common.cuh"

#define AP_BM 64
#define AP_THREADS 128
#define AP_LOG2E 1.4426950408889634f
#define AP_LN2 0.6931471805599453f

__device__ __forceinline__ u32 ap_smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global → shared; zeros (src not read) when !ok.
__device__ __forceinline__ void ap_cp16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void ap_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void ap_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ap_ldsm4(u32 addr, u32 r[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ap_ldsm4_t(u32 addr, u32 r[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
// c += A (16×16, row-major fragment a) · B (16×8, column-major fragment b0 b1).
__device__ __forceinline__ void ap_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 rounded to a bf16 pair (x in the low half); their rounded values added to *sum.
__device__ __forceinline__ u32 ap_pack(float x, float y, float* sum) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    *sum += __low2float(h) + __high2float(h);
    return *reinterpret_cast<const u32*>(&h);
}

// Byte offset of 16-byte chunk c of row `row` in a shared tile of rows of D bf16. The chunk index is
// XOR-swizzled so that the eight rows one ldmatrix phase reads at one logical chunk fall in eight
// distinct bank groups: rows of D ≥ 64 take c ^ (row mod 8); rows of 32 (64 bytes, two to a
// 128-byte line) take c ^ ((row / 2) mod 4).
template <int D>
__device__ __forceinline__ u32 ap_off(int row, int c) {
    constexpr int C = D / 8;
    const int sw = C >= 8 ? (row & 7) : ((row >> 1) & 3);
    return (u32)(row * (D * 2) + 16 * (c ^ sw));
}

// Queues the copy of keys p0 .. p0 + BN − 1 of KV head kh (pool rows of row_elems elements, the head at
// koff) into the shared tile at dst. Keys at or past hi, past the table, or whose block id is not below
// num_blocks read as zeros; with kok non-null, kok[i] records whether key p0 + i is real.
template <int D, int BN>
__device__ __forceinline__ void ap_load_kv(u32 dst, const bf16* __restrict__ pool, const u32* __restrict__ table,
                                           int p0, int hi, int max_blocks, int bs, u32 num_blocks,
                                           size_t row_elems, size_t koff, int* kok) {
    constexpr int C = D / 8, RPP = AP_THREADS / C;  // chunks per row, rows per pass
    static_assert(AP_THREADS % C == 0 && BN % RPP == 0, "tile shape");
    const int c = threadIdx.x % C, r0 = threadIdx.x / C;
#pragma unroll
    for (int ps = 0; ps < BN / RPP; ++ps) {
        const int row = ps * RPP + r0, p = p0 + row;
        u32 blk = num_blocks;
        if (p < hi && p / bs < max_blocks) blk = table[p / bs];
        const bool ok = blk < num_blocks;
        const bf16* src = ok ? pool + ((size_t)blk * bs + (size_t)(p % bs)) * row_elems + koff + 8 * c : pool;
        ap_cp16(dst + ap_off<D>(row, c), src, ok);
        if (kok != nullptr && c == 0) kok[row] = ok;
    }
}

// One block: AP_THREADS threads, dynamic shared memory (AP_BM + 2·BN)·D·2 bytes. Grid (⌈t·G / AP_BM⌉,
// hkv, splits); x is walked from the last row tile (the longest under the causal mask) to the first.
// See attn_prefill_mma_d* for the arguments.
template <int D, int BN>
__device__ __forceinline__ void attn_prefill_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_pool,
                                                  const bf16* __restrict__ v_pool, const u32* __restrict__ table,
                                                  int max_blocks, int pos0, int t, const bf16* __restrict__ gate,
                                                  bf16* __restrict__ out, float* __restrict__ part_o,
                                                  float* __restrict__ part_ml, int hq, int hkv, int bs,
                                                  u32 num_blocks, int splits, int span, float scale_log2,
                                                  unsigned char* smem, int* kok) {
    constexpr int C = D / 8;
    const int G = hq / hkv;
    const int mt = gridDim.x - 1 - blockIdx.x, kh = blockIdx.y, sp = blockIdx.z;
    const int m0 = mt * AP_BM, mrows = min(AP_BM, t * G - m0);
    // Keys the tile's last row sees: 0 .. len_hi − 1; this block's span of them: lo .. hi − 1.
    const int len_hi = pos0 + (m0 + mrows - 1) / G + 1;
    const int lo = sp * span, hi = min(len_hi, lo + span);
    const int tid = threadIdx.x;
    if (lo >= hi) {  // a span past every row of the tile (several spans only): nothing seen
        if (tid < mrows) {
            const int m = m0 + tid;
            const size_t slot = ((size_t)(m / G) * hq + kh * G + m % G) * splits + sp;
            part_ml[2 * slot] = NEG_INF;
            part_ml[2 * slot + 1] = 0.0f;
        }
        return;
    }

    const u32 qs = ap_smem_addr(smem), ks = qs + AP_BM * D * 2, vs = ks + BN * D * 2;
    const size_t row_elems = (size_t)hkv * D, koff = (size_t)kh * D;

    // Q of the tile's rows (rows past mrows zero), with the first K tile.
#pragma unroll 4
    for (int i = tid; i < AP_BM * C; i += AP_THREADS) {
        const int row = i / C, c = i % C, m = m0 + row;
        const bool ok = row < mrows;
        const bf16* src = ok ? q + ((size_t)(m / G) * hq + kh * G + m % G) * D + 8 * c : q;
        ap_cp16(qs + ap_off<D>(row, c), src, ok);
    }
    ap_load_kv<D, BN>(ks, k_pool, table, lo, hi, max_blocks, bs, num_blocks, row_elems, koff, kok);
    ap_commit();

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const bool active = 16 * warp < mrows;  // warps whose 16 rows are all padding skip the math
    // The thread's two rows (g and g + 8 of its warp's 16) and the positions of their queries.
    const int ma = m0 + 16 * warp + g, mb = ma + 8;
    const int pa = pos0 + ma / G, pb = pos0 + mb / G;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float mx_a = NEG_INF, mx_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;  // running max (log2 units), Σ p

    const int ntiles = (hi - lo + BN - 1) / BN;
    for (int it = 0; it < ntiles; ++it) {
        const int p0 = lo + it * BN;
        ap_wait_all();
        __syncthreads();  // K tile `it` (and Q) landed; every warp is done with the previous V tile
        ap_load_kv<D, BN>(vs, v_pool, table, p0, hi, max_blocks, bs, num_blocks, row_elems, koff, nullptr);
        ap_commit();

        u32 pf[BN / 16][4];  // P as A fragments of the second product
        if (active) {
            // S = Q·Kᵀ for the warp's 16 rows and the tile's BN keys.
            float s[BN / 8][4];
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 a[4];
                ap_ldsm4(qs + ap_off<D>(16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * kk + (lane >> 4)), a);
#pragma unroll
                for (int jn = 0; jn < BN / 16; ++jn) {
                    u32 b[4];
                    ap_ldsm4(ks + ap_off<D>(16 * jn + (lane & 7) + 8 * (lane >> 4), 2 * kk + ((lane >> 3) & 1)), b);
                    ap_mma(s[2 * jn], a, b[0], b[1]);
                    ap_mma(s[2 * jn + 1], a, b[2], b[3]);
                }
            }
            // Scale to log2 units and mask; the rows' new maxima.
            float na = mx_a, nb = mx_b;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * n + 2 * tq + e;
                    const bool real = kok[col] != 0;
                    s[n][e] = real && p0 + col <= pa ? s[n][e] * scale_log2 : NEG_INF;
                    s[n][2 + e] = real && p0 + col <= pb ? s[n][2 + e] * scale_log2 : NEG_INF;
                    na = fmaxf(na, s[n][e]);
                    nb = fmaxf(nb, s[n][2 + e]);
                }
            }
            na = fmaxf(na, __shfl_xor_sync(0xffffffffu, na, 1));
            na = fmaxf(na, __shfl_xor_sync(0xffffffffu, na, 2));
            nb = fmaxf(nb, __shfl_xor_sync(0xffffffffu, nb, 1));
            nb = fmaxf(nb, __shfl_xor_sync(0xffffffffu, nb, 2));
            // A row that has seen nothing yet keeps max −inf; subtract 0 then (every p is 0).
            const float ua = na == NEG_INF ? 0.0f : na, ub = nb == NEG_INF ? 0.0f : nb;
            const float ca = exp2f(mx_a - ua), cb = exp2f(mx_b - ub);
            mx_a = na;
            mx_b = nb;
            l_a *= ca;
            l_b *= cb;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][0] *= ca;
                o[n][1] *= ca;
                o[n][2] *= cb;
                o[n][3] *= cb;
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                const float* s0 = s[2 * kk];
                const float* s1 = s[2 * kk + 1];
                pf[kk][0] = ap_pack(exp2f(s0[0] - ua), exp2f(s0[1] - ua), &l_a);
                pf[kk][1] = ap_pack(exp2f(s0[2] - ub), exp2f(s0[3] - ub), &l_b);
                pf[kk][2] = ap_pack(exp2f(s1[0] - ua), exp2f(s1[1] - ua), &l_a);
                pf[kk][3] = ap_pack(exp2f(s1[2] - ub), exp2f(s1[3] - ub), &l_b);
            }
        }

        ap_wait_all();
        __syncthreads();  // V tile `it` landed; every warp is done with K tile `it` and its kok
        if (it + 1 < ntiles) {
            ap_load_kv<D, BN>(ks, k_pool, table, p0 + BN, hi, max_blocks, bs, num_blocks, row_elems, koff, kok);
            ap_commit();
        }
        if (active) {
            // O += P·V.
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
                for (int dn = 0; dn < D / 16; ++dn) {
                    u32 b[4];
                    ap_ldsm4_t(vs + ap_off<D>(16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * dn + (lane >> 4)), b);
                    ap_mma(o[2 * dn], pf[kk], b[0], b[1]);
                    ap_mma(o[2 * dn + 1], pf[kk], b[2], b[3]);
                }
            }
        }
    }
    if (!active) return;

    // Row sums over the four lanes sharing a row, then the writes of rows below mrows.
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = 16 * warp + g + 8 * half;
        if (row >= mrows) continue;
        const int m = m0 + row;
        const size_t qrow = (size_t)(m / G) * hq + kh * G + m % G;  // (query, head) row of q / out
        const float l = half ? l_b : l_a, mx = half ? mx_b : mx_a;
        if (splits == 1) {
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                const size_t at = qrow * D + 8 * n + 2 * tq;
                const __nv_bfloat162 gt = *reinterpret_cast<const __nv_bfloat162*>(gate + at);
                const float x = o[n][2 * half] * inv * sigmoid_f(__low2float(gt));
                const float y = o[n][2 * half + 1] * inv * sigmoid_f(__high2float(gt));
                *reinterpret_cast<__nv_bfloat162*>(out + at) = __floats2bfloat162_rn(x, y);
            }
        } else {
            const size_t slot = qrow * splits + sp;
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<float2*>(part_o + slot * D + 8 * n + 2 * tq) =
                    make_float2(o[n][2 * half], o[n][2 * half + 1]);
            if (tq == 0) {
                part_ml[2 * slot] = mx == NEG_INF ? NEG_INF : mx * AP_LN2;
                part_ml[2 * slot + 1] = l;
            }
        }
    }
}

// The entry points' parameters and body: head dim D, key tiles of BN.
#define AP_ARGS                                                                                             \
    const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,   \
    const u32* __restrict__ table, int max_blocks, int pos0, int t, const bf16* __restrict__ gate,      \
    bf16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, int hq, int hkv, int bs, \
    u32 num_blocks, int splits, int span, float scale_log2
#define AP_BODY(D, BN)                                                                                      \
    extern __shared__ __align__(16) unsigned char ap_smem[];                                               \
    __shared__ int kok[BN];                                                                                 \
    if (blockDim.x != AP_THREADS) return;                                                                   \
    attn_prefill_impl<D, BN>(q, k_pool, v_pool, table, max_blocks, pos0, t, gate, out, part_o, part_ml, hq,  \
                             hkv, bs, num_blocks, splits, span, scale_log2, ap_smem, kok)

// Causal prefill of t queries at positions pos0 .. pos0 + t − 1 of one sequence, head size D (the
// suffix). q, gate, out: [t, hq·D] bf16 (q normed and roped); query r sees positions 0 .. pos0 + r of
// the cache through table (max_blocks ids; an id ≥ num_blocks masks its positions). Span s of the
// grid's z covers positions s·span .. (s + 1)·span − 1. splits = 1: out = attention · sigmoid(gate)
// (part_o, part_ml unused). splits > 1: part_o [t, hq, splits, D] (unnormalised Σ e·v) and part_ml
// [.., 2] (max, Σ e) for attn_paged_reduce; gate and out unused. scale_log2 = D^-½·log2(e). Needs
// 16-byte aligned q and pools, 4-byte aligned gate and out; launch as attn_prefill_impl says. Key tiles:
// BN = 32 keys at D = 256 (fewer score registers next to the 128 of the output), 64 below.
extern "C" __global__ void __launch_bounds__(AP_THREADS) attn_prefill_mma_d256(AP_ARGS) {
    pdl_prologue();
    AP_BODY(256, 32);
}
extern "C" __global__ void __launch_bounds__(AP_THREADS) attn_prefill_mma_d128(AP_ARGS) {
    pdl_prologue();
    AP_BODY(128, 64);
}
extern "C" __global__ void __launch_bounds__(AP_THREADS) attn_prefill_mma_d64(AP_ARGS) {
    pdl_prologue();
    AP_BODY(64, 64);
}
extern "C" __global__ void __launch_bounds__(AP_THREADS) attn_prefill_mma_d32(AP_ARGS) {
    pdl_prologue();
    AP_BODY(32, 64);
}
