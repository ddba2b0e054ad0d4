// Routed experts as a grouped GEMM on tensor cores, for steps with many (token, expert) pairs (prefill):
//   moe_gemm_plan  groups the pairs by expert (perm, as moe_sort writes it) and cuts each expert's run
//                  into tiles of at most MG_TILE = 64 pairs (one block, parallel scan over the experts);
//   moe_gemm_*     a block multiplies one tile's gathered input rows by MG_BM = 128 rows of the tile's
//                  expert weight with mma.sync m16n8k16 (bf16 in, f32 accumulation). The weight rows are
//                  the MMA's M side and the pairs its N side (8 pairs an MMA), so a tile of c pairs costs
//                  ceil(c / 8) MMAs per 16x16 weight block: the few-pairs tiles of a prefill stay cheap.
// Weights and inputs stream through shared memory in k-chunks of MG_KC = 64 with cp.async (a 3- or
// 4-stage pipeline); packed experts (INT4 / INT8 pack-quantized, INT6 gapless, quant.cu's layout) are
// decoded from the shared words straight into MMA fragments as exact small integers q (bf16 holds
// |q| <= 128 exactly), and each group's partial product is scaled in f32 on the accumulators, so the
// only roundings are the MMA's f32 sums and the output's. FP8 experts (block-scaled e4m3 bytes, fp8.cu's
// layout) decode exactly to bf16 the same way (value / F8_UNSCALE, folded into the block scale): a bf16
// tile path that runs on every chip (moe_gemm_f8.cu multiplies them on the FP8 tensor cores from sm_89,
// with quantised activations). Pairs are p = token·top_k + choice.
#include "fp8.cuh"
#include "moe_gemm.cuh"

// Shared bytes of one input row of a k-chunk: 64 bf16 + 16 bytes of padding (ldmatrix without conflicts).
#define MG_XROW 144

// One block (blockDim.x a multiple of 32, at most 1024). ids: [n_pairs] expert ids (< e; others are
// dropped); perm: [n_pairs] pair numbers grouped by expert, experts in increasing order (as moe_sort);
// tiles: [max_tiles, 3] (expert, start in perm, count <= MG_TILE), the unused tail with count 0.
// Dynamic shared memory: 2·e u32.
extern "C" __global__ void moe_gemm_plan(const u32* __restrict__ ids, int n_pairs, int e, u32* __restrict__ perm,
                                         u32* __restrict__ tiles, int max_tiles) {
    pdl_prologue();
    extern __shared__ u32 sh[];
    __shared__ u32 warp_pairs[32], warp_tiles[32];
    u32* cnt = sh;
    u32* cur = sh + e;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    for (int i = tid; i < e; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int p = tid; p < n_pairs; p += blockDim.x)
        if (ids[p] < (u32)e) atomicAdd(&cnt[ids[p]], 1u);
    __syncthreads();
    // Thread tid owns experts [lo, hi): its pair and tile totals, then an exclusive scan over threads.
    const int per = (e + blockDim.x - 1) / blockDim.x;
    const int lo = min(e, tid * per), hi = min(e, lo + per);
    u32 np = 0, nt = 0;
    for (int x = lo; x < hi; ++x) {
        np += cnt[x];
        nt += (cnt[x] + MG_TILE - 1) / MG_TILE;
    }
    u32 ip = np, it = nt;  // inclusive scans within the warp
    warp_inclusive_scan2(ip, it);
    if (lane == 31) {
        warp_pairs[warp] = ip;
        warp_tiles[warp] = it;
    }
    __syncthreads();
    if (warp == 0) {
        u32 a = lane < nwarps ? warp_pairs[lane] : 0, b = lane < nwarps ? warp_tiles[lane] : 0;
        warp_inclusive_scan2(a, b);
        if (lane < nwarps) {
            warp_pairs[lane] = a;  // inclusive over warps
            warp_tiles[lane] = b;
        }
    }
    __syncthreads();
    u32 off = ip - np + (warp > 0 ? warp_pairs[warp - 1] : 0);
    u32 t = it - nt + (warp > 0 ? warp_tiles[warp - 1] : 0);
    const u32 total_tiles = warp_tiles[nwarps - 1];
    for (int x = lo; x < hi; ++x) {
        cur[x] = off;
        for (u32 s = 0; s < cnt[x]; s += MG_TILE, ++t) {
            if (t < (u32)max_tiles) {
                tiles[3 * t] = x;
                tiles[3 * t + 1] = off + s;
                tiles[3 * t + 2] = min((u32)MG_TILE, cnt[x] - s);
            }
        }
        off += cnt[x];
    }
    for (u32 i = total_tiles + tid; i < (u32)max_tiles; i += blockDim.x) tiles[3 * i + 2] = 0;
    __syncthreads();
    for (int p = tid; p < n_pairs; p += blockDim.x) {
        const u32 x = ids[p];
        if (x < (u32)e) perm[atomicAdd(&cur[x], 1u)] = (u32)p;
    }
}

__device__ __forceinline__ void mg_ldsm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
// c += A (16x16, row-major fragment a) · B (16x8, column-major fragment b0 b1).
__device__ __forceinline__ void mg_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// a · b + c on two bf16 lanes (exact here: every result is a small integer).
__device__ __forceinline__ u32 mg_fma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#define MG_ONE2 0x3F803F80u  // bf16x2 (1, 1)

// ---- Weight formats: shared row layout of one k-chunk and the A-fragment decode ----
// PIECES 16-byte copies per row per chunk, SROW shared bytes per row (PIECES·16 plus padding where the
// fragment reads would conflict), STAGES of the pipeline (shared memory: STAGES·(128·SROW + 64·144 +
// 512·spc) bytes; the host mirrors these numbers). A fragment of rows r (= g) and r + 8 of the warp's 16,
// k16 step s: a[0] = row g, k 2t..2t+1; a[1] = row g+8, k 2t..2t+1; a[2] = row g, k 2t+8..; a[3] = row
// g+8, k 2t+8.. (g = lane / 4, t = lane % 4), each a bf16 pair, low half first.
template <int FMT> struct MgFmt;

// INT4: 8 codes a word (value j at bits 4(j%8) of word j/8); a chunk row is 8 words. Codes 2t, 2t+1 are
// byte t of a word: byte t of w to bits 0..7, byte t of w >> 4 to bits 16..23, keep the low nibbles,
// OR the bf16 exponent of 128: the pair 128 + code, minus 136 = q.
template <> struct MgFmt<4> {
    static constexpr int BITS = 4, PIECES = 2, SROW = 32, STAGES = 4;
    static constexpr float UNSCALE = 1.0f;
    __device__ __forceinline__ static u32 pair(u32 w, int t) {
        const u32 x = __byte_perm(w, w >> 4, (u32)t | ((u32)(t + 4) << 8));
        return mg_fma2((x & 0x000F000Fu) | 0x43004300u, MG_ONE2, 0xC308C308u);  // - 136
    }
    __device__ __forceinline__ static void frag(const unsigned char* r0, const unsigned char* r1, int s, int t,
                                                u32 a[4]) {
        const uint2 u = *(const uint2*)(r0 + 8 * s), v = *(const uint2*)(r1 + 8 * s);
        a[0] = pair(u.x, t);
        a[1] = pair(v.x, t);
        a[2] = pair(u.y, t);
        a[3] = pair(v.y, t);
    }
};

// INT8: 4 codes a word; codes 2t, 2t+1 of a k8 block are bytes 2(t%2), 2(t%2)+1 of its word t/2. bf16
// holds 128 + c exactly only for c < 128, so the low 7 bits go to the mantissa of 128 and the top bit
// picks the subtrahend: (128 + c_lo) - (c_top ? 128 : 256) = c - 128 = q.
template <> struct MgFmt<8> {
    static constexpr int BITS = 8, PIECES = 4, SROW = 80, STAGES = 3;
    static constexpr float UNSCALE = 1.0f;
    __device__ __forceinline__ static u32 pair(u32 w, int t) {
        const u32 b = 2 * (t & 1);
        const u32 x = __byte_perm(w, 0x43u, b | 0x40u | ((b + 1) << 8) | 0x4000u);  // [c0, 0x43, c1, 0x43]
        return mg_fma2(x & 0x437F437Fu, MG_ONE2, (x & 0x00800080u) ^ 0xC380C380u);
    }
    __device__ __forceinline__ static void frag(const unsigned char* r0, const unsigned char* r1, int s, int t,
                                                u32 a[4]) {
        const u32* w0 = (const u32*)r0 + 4 * s + (t >> 1);
        const u32* w1 = (const u32*)r1 + 4 * s + (t >> 1);
        a[0] = pair(w0[0], t);
        a[1] = pair(w1[0], t);
        a[2] = pair(w0[2], t);
        a[3] = pair(w1[2], t);
    }
};

// INT6: a row is a bit stream of 6-bit codes in units of 32 values (6 words); a chunk row is 2 units,
// 12 words. The pair of codes j, j+1 (j even) is 12 bits at bit 6·(j % 32) of its unit (a funnel shift
// when it straddles words); 128 + code minus 160 = q.
template <> struct MgFmt<6> {
    static constexpr int BITS = 6, PIECES = 3, SROW = 48, STAGES = 4;
    static constexpr float UNSCALE = 1.0f;
    __device__ __forceinline__ static u32 pair(const u32* row, int j) {
        const int bit = 6 * (j & 31), wi = 6 * (j >> 5) + (bit >> 5);
        const u32 v = __funnelshift_r(row[wi], row[wi + 1], bit & 31);
        const u32 x = (v & 0x3Fu) | ((v << 10) & 0x003F0000u) | 0x43004300u;
        return mg_fma2(x, MG_ONE2, 0xC320C320u);  // - 160
    }
    __device__ __forceinline__ static void frag(const unsigned char* r0, const unsigned char* r1, int s, int t,
                                                u32 a[4]) {
        const int j = 16 * s + 2 * t;
        a[0] = pair((const u32*)r0, j);
        a[1] = pair((const u32*)r1, j);
        a[2] = pair((const u32*)r0, j + 8);
        a[3] = pair((const u32*)r1, j + 8);
    }
};

// bf16 experts: the chunk rows as they are (64 bf16 + 16 bytes of padding), fragments by ldmatrix.
template <> struct MgFmt<16> {
    static constexpr int BITS = 16, PIECES = 8, SROW = 144, STAGES = 3;
    static constexpr float UNSCALE = 1.0f;
};

// FP8 (tag MG_FP8): one e4m3 byte a value, in order, as INT8's codes; the pair of a k8 block's values 2t,
// 2t + 1 is half t % 2 of word t / 2, decoded exactly to bf16 (value / F8_UNSCALE; the scale takes the
// factor back).
#define MG_FP8 88
template <> struct MgFmt<MG_FP8> {
    static constexpr int BITS = 8, PIECES = 4, SROW = 80, STAGES = 3;
    static constexpr float UNSCALE = F8_UNSCALE;
    __device__ __forceinline__ static void frag(const unsigned char* r0, const unsigned char* r1, int s, int t,
                                                u32 a[4]) {
        const u32* w0 = (const u32*)r0 + 4 * s + (t >> 1);
        const u32* w1 = (const u32*)r1 + 4 * s + (t >> 1);
        a[0] = f8_pair_bf16x2(w0[0], t & 1);
        a[1] = f8_pair_bf16x2(w1[0], t & 1);
        a[2] = f8_pair_bf16x2(w0[2], t & 1);
        a[3] = f8_pair_bf16x2(w1[2], t & 1);
    }
};

// Grid (ceil(n / 128), max_tiles); 256 threads (8 warps of 16 weight rows); dynamic shared memory
// STAGES·(128·SROW + 64·144 + (packed ? 512·spc : 0)) bytes. Tile t = (expert x, start, count): for each of
// its pairs p = perm[start + m], Y[p, :] = W_x · X[moe_x_row(p), :], W_x [n, k] at w_ptrs[x] (bf16 values,
// or packed words with f32 scales at s_ptrs[x], [n, ceil(k / group)]). Needs k % 64 == 0, group (the
// effective one: k for per-row scales) 16, 32 or a multiple of 64, spc = 64 / group for groups below 64
// and 1 otherwise, 16-byte aligned weights and X. A block whose tile is unused (count 0) exits at once.
template <int FMT, typename OUT>
__device__ __forceinline__ void moe_gemm_impl(const unsigned long long* __restrict__ w_ptrs,
                                              const unsigned long long* __restrict__ s_ptrs,
                                              const bf16* __restrict__ X, int x_div, u32 x_tail, const u32* __restrict__ perm,
                                              const u32* __restrict__ tiles, OUT* __restrict__ Y, int n, int k,
                                              int group, int spc) {
    typedef MgFmt<FMT> F;
    constexpr bool SCALED = FMT != 16;
    constexpr int STAGES = F::STAGES;
    __shared__ u32 s_pair[MG_TILE], s_xrow[MG_TILE];
    extern __shared__ uint4 mg_dyn[];
    u32 ex;
    const u32 cnt = mg_tile(tiles, perm, x_div, x_tail, s_pair, s_xrow, ex);
    if (cnt == 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * MG_BM;
    const int nch = (int)(cnt + 7) >> 3;  // active 8-pair column blocks
    const int nk = k / MG_KC;
    const int scols = (k + group - 1) / group;
    const unsigned char* W = (const unsigned char*)w_ptrs[ex];
    const float* S = SCALED ? (const float*)s_ptrs[ex] : nullptr;
    const size_t wrow_bytes = (size_t)k * F::BITS / 8;
    const int w_bytes = MG_BM * F::SROW, x_bytes = MG_TILE * MG_XROW;
    const int stage_bytes = w_bytes + x_bytes + (SCALED ? MG_BM * 4 * spc : 0);
    unsigned char* smem = (unsigned char*)mg_dyn;
    const u32 smem0 = mg_smem(smem);

    // Queue the copies of k-chunk c into stage st.
    auto load = [&](int c, int st) {
        const u32 base = smem0 + st * stage_bytes;
        for (int i = tid; i < MG_BM * F::PIECES; i += blockDim.x) {
            const int r = i / F::PIECES, pc = i % F::PIECES;
            const bool ok = row0 + r < n;
            const unsigned char* src = W + (ok ? (size_t)(row0 + r) * wrow_bytes + (size_t)c * (F::PIECES * 16) + pc * 16 : 0);
            mg_cp16(base + r * F::SROW + pc * 16, src, ok ? 16 : 0);
        }
        for (int i = tid; i < nch * 8 * 8; i += blockDim.x) {
            const int m = i >> 3, pc = i & 7;
            const bool ok = m < (int)cnt;
            const bf16* src = X + (size_t)s_xrow[ok ? m : 0] * k + c * MG_KC + pc * 8;
            mg_cp16(base + w_bytes + m * MG_XROW + pc * 16, src, ok ? 16 : 0);
        }
        if (SCALED) {
            const int g0 = c * MG_KC / group;
            for (int i = tid; i < MG_BM * spc; i += blockDim.x) {
                const int r = i / spc, j = i % spc;
                const bool ok = row0 + r < n && g0 + j < scols;
                const float* src = S + (ok ? (size_t)(row0 + r) * scols + g0 + j : 0);
                mg_cp4(base + w_bytes + x_bytes + 4 * i, src, ok ? 4 : 0);
            }
        }
    };

    float acc[8][4], tot[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = tot[j][i] = 0.0f;

#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < nk) load(st, st);
        mg_commit();
    }
    const int gsteps = group / 16;  // k16 steps a scale group spans
    int left = gsteps;
    const int wr = 16 * warp + g;  // the thread's first weight row in the block
#pragma unroll 1
    for (int c = 0; c < nk; ++c) {
        mg_wait<STAGES - 2>();
        __syncthreads();
        if (c + STAGES - 1 < nk) load(c + STAGES - 1, (c + STAGES - 1) % STAGES);
        mg_commit();
        const int st = c % STAGES;
        const unsigned char* ws = smem + st * stage_bytes;
        const u32 xs = smem0 + st * stage_bytes + w_bytes;
        const float* ss = (const float*)(ws + w_bytes + x_bytes);
#pragma unroll
        for (int s = 0; s < MG_KC / 16; ++s) {
            u32 a[4];
            if constexpr (FMT == 16) {
                const int r = 16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1), col = 16 * s + 8 * (lane >> 4);
                mg_ldsm4(smem0 + st * stage_bytes + r * F::SROW + col * 2, a[0], a[1], a[2], a[3]);
            } else {
                F::frag(ws + wr * F::SROW, ws + (wr + 8) * F::SROW, s, t, a);
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                if (2 * jj < nch) {
                    const int mi = lane >> 3;
                    const int m = 8 * (2 * jj + (mi >> 1)) + (lane & 7), col = 16 * s + 8 * (mi & 1);
                    u32 b0, b1, b2, b3;
                    mg_ldsm4(xs + m * MG_XROW + col * 2, b0, b1, b2, b3);
                    mg_mma(SCALED ? acc[2 * jj] : tot[2 * jj], a, b0, b1);
                    if (2 * jj + 1 < nch) mg_mma(SCALED ? acc[2 * jj + 1] : tot[2 * jj + 1], a, b2, b3);
                }
            }
            if (SCALED) {
                if (--left == 0 || (c == nk - 1 && s == MG_KC / 16 - 1)) {
                    left = gsteps;
                    const int slot = (s * spc) >> 2;
                    const float s0 = ss[wr * spc + slot] * F::UNSCALE, s1 = ss[(wr + 8) * spc + slot] * F::UNSCALE;
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        if (j < nch) {
                            tot[j][0] = fmaf(s0, acc[j][0], tot[j][0]);
                            tot[j][1] = fmaf(s0, acc[j][1], tot[j][1]);
                            tot[j][2] = fmaf(s1, acc[j][2], tot[j][2]);
                            tot[j][3] = fmaf(s1, acc[j][3], tot[j][3]);
#pragma unroll
                            for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
                        }
                    }
                }
            }
        }
    }
    mg_store<OUT>(Y, tot, s_pair, cnt, nch, row0 + wr, t, n);
}

// Entry points moe_gemm_{q4 | q6 | q8 | f8 | bf16}_{bf16 | f32}: Y [n_pairs, n] bf16 (the experts' fused gate|up
// rows) or f32 (their down projections, combined by moe_combine). s_ptrs is not read for bf16 experts.
#define MOE_GEMM_ARGS const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, unsigned x_tail, const u32* perm, const u32* tiles
#define MOE_GEMM_PASS w_ptrs, s_ptrs, X, x_div, x_tail, perm, tiles, Y, n, k, group, spc
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_q4_bf16(MOE_GEMM_ARGS, bf16* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<4, bf16>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_q4_f32(MOE_GEMM_ARGS, float* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<4, float>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_q6_bf16(MOE_GEMM_ARGS, bf16* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<6, bf16>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_q6_f32(MOE_GEMM_ARGS, float* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<6, float>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_q8_bf16(MOE_GEMM_ARGS, bf16* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<8, bf16>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_q8_f32(MOE_GEMM_ARGS, float* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<8, float>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_f8_bf16(MOE_GEMM_ARGS, bf16* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<MG_FP8, bf16>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_f8_f32(MOE_GEMM_ARGS, float* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<MG_FP8, float>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_bf16_bf16(MOE_GEMM_ARGS, bf16* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<16, bf16>(MOE_GEMM_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_bf16_f32(MOE_GEMM_ARGS, float* Y, int n, int k, int group, int spc) { pdl_prologue(); moe_gemm_impl<16, float>(MOE_GEMM_PASS); }
#undef MOE_GEMM_ARGS
#undef MOE_GEMM_PASS

