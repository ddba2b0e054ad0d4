// Block-scaled FP8 weights (the `quant_method: fp8` releases) consumed as their bytes: a weight [n, k] is
// n rows of k float8_e4m3fn bytes (row-major, k % 16 == 0, rows 16-byte aligned) and f32 scales
// [n, ceil(k / group)], the checkpoint's 128 x 128 block scales repeated per row (the weight is
// fp8(q) · scale[row, j / group]; group % 16 == 0, so a 16-byte chunk of a row lies inside one group).
//
//   gemv_f8[_f32]_m{M}   decode, y[m, :] = W · x[m, :] for M = 1..8 rows of x, one byte a weight read
//                        once for all M rows, the block scale applied in f32 to each chunk's dot product
//                        (the row-slot cut of gemv_plan over 16-byte chunks; segment tables as the other
//                        GEMVs, so one launch serves up to GEMV_SEGS weights that read the same x).
//   gemv_f8_tc[_f32]     the same for M = 2..8 on the tensor cores (k % 64 == 0, group % 64 == 0).
//   dequant_f8           rows of W as bf16 (bf16(fp8 · scale), one rounding) for the prefill GEMM's tiles.
//   moe_gemv_f8_*        the grouped GEMV of routed experts (moe.cu's tiles, address tables and cut),
//                        FP8 experts.
//
// Decoding: fp8.cuh (exact, sm_86 and later).
#include "fp8.cuh"

// ---- Decode GEMV ----
// Row-slot cut (as quant.cu's 16-byte chunk GEMV): slots of 2^tpr_log2 threads own rps ≤ R rows; a
// thread streams chunks p, p + tpr, ... of its slot's rows, U = 8 / R chunks a row per round, so 8 loads
// of 16 bytes are in flight per thread before the first FMA. Each chunk is decoded once and dotted with
// the M rows of x (their 16 values through the read-only cache), times the chunk's group scale.
template <int M, int R, typename OUT>
__device__ __forceinline__ void gemv_f8_impl(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                             const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                             int group, int rps, int tpr_log2, int block) {
    constexpr int U = 8 / R;
    __shared__ float red[8][R][M];
    const int tpr = 1 << tpr_log2;
    const int slot = threadIdx.x >> tpr_log2, p = threadIdx.x & (tpr - 1);
    const long long row0 = ((long long)block * (256 >> tpr_log2) + slot) * rps;
    const int nrows = (int)max(0LL, min((long long)rps, (long long)n - row0));
    const int chunks = k >> 4;
    const int cend = nrows > 0 ? chunks : 0;
    const int scols = (k + group - 1) / group;
    const uint4* wrow[R];
    const float* srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long row = max(0LL, min(row0 + r, (long long)n - 1));
        wrow[r] = (const uint4*)(W + row * (long long)k);
        srow[r] = S + row * scols;
    }
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    const uint4* xv = (const uint4*)X;
    const int xstride = k >> 3;  // uint4 per row of x
#pragma unroll 1
    for (int c0 = p; c0 < cend; c0 += U * tpr) {
        uint4 w[R][U];
        float s[R][U];
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int c = c0 + i * tpr;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const bool live = r < nrows && c < chunks;
                w[r][i] = live ? __ldcs(wrow[r] + c) : make_uint4(0, 0, 0, 0);
                s[r][i] = live ? __ldg(srow[r] + (c << 4) / group) : 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int c = c0 + i * tpr;
            if (c >= chunks) break;
            float d[R][M];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int m = 0; m < M; ++m) d[r][m] = 0.0f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float q[R][8];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    f8x4(h == 0 ? w[r][i].x : w[r][i].z, q[r]);
                    f8x4(h == 0 ? w[r][i].y : w[r][i].w, q[r] + 4);
                }
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    float xf[8];
                    unpack8(__ldg(xv + (size_t)m * xstride + 2 * c + h), xf);
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int e = 0; e < 8; ++e) d[r][m] = fmaf(q[r][e], xf[e], d[r][m]);
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int m = 0; m < M; ++m) acc[r][m] = fmaf(d[r][m], s[r][i] * F8_UNSCALE, acc[r][m]);
        }
    }
    gemv_slot_sum<R, M, OUT>(acc, red, Y, n, row0, nrows, rps, tpr_log2, p);
}

template <int M, int R, typename OUT>
__device__ __forceinline__ void gemv_f8_segs(const GemvSegs& t, const bf16* X, int k, int group) {
    const GemvSeg s = gemv_seg(t);
    gemv_f8_impl<M, R, OUT>((const unsigned char*)s.w, s.s, X, (OUT*)s.y, s.n, k, group, s.rps, s.tpr_log2,
                            gemv_seg_block(s));
}

// Entry points: R = 2 rows a slot at most for M ≤ 4, 1 beyond (the registers of M accumulators a row;
// the launcher's gemv_plan max_rows, f8_rows in ops/fp8.rs).
// Grid: every segment's ceil(n / (rps · 256 / 2^tpr_log2)) blocks of 256 threads. The first statement asks
// L2 for the block's weight rows before the PDL wait.
#define GEMV_F8_ARGS const GemvSegs t, const bf16* X, int k, int group
extern "C" __global__ void __launch_bounds__(256, 3) gemv_f8_m1(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<1, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f8_m2(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<2, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f8_m3(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<3, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f8_m4(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<4, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_m5(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<5, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_m6(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<6, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_m7(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<7, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_m8(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<8, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_f8_f32_m1(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<1, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f8_f32_m2(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<2, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f8_f32_m3(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<3, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f8_f32_m4(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<4, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_f32_m5(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<5, 1, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_f32_m6(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<6, 1, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_f32_m7(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<7, 1, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_f8_f32_m8(GEMV_F8_ARGS) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), (long long)k)); gemv_f8_segs<8, 1, float>(t, X, k, group); }

// ---- Batched decode (M = 2..8) on the tensor cores ----
// quant.cu's INT8 tensor-core GEMV with FP8 pieces: a block of 256 threads (8 warps) owns 16 rows of W;
// warp w takes the k-blocks w, w + 8, ... of 64 values, and lane (g = lane / 4, t = lane % 4) streams one
// 16-byte piece (16 values) of rows g and g + 8 per k-block, values 64b + 16t ... The pieces decode
// exactly to bf16 pairs (e4m3 → f16 → f32 → bf16: every e4m3 value / F8_UNSCALE is a bf16), X^T (k x 8,
// rows of X past m zero) is the mma's B with lane t of column g reading x[g, 64b + 16t ..], so A's and
// B's k orders agree. Each k-block lies inside one group (group % 64 == 0): its partial product is scaled
// by the rows' group scales; the 8 warps' fragments are summed in shared memory. Requires k % 64 == 0,
// 16-byte aligned W and X.
__device__ __forceinline__ void f8_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Values 2h, 2h + 1 (h = 0..7) of a piece's words as a bf16 pair (low half first).
__device__ __forceinline__ u32 f8_bf16x2(const uint4& w, int h) {
    const u32 word = (h >> 1) == 0 ? w.x : (h >> 1) == 1 ? w.y : (h >> 1) == 2 ? w.z : w.w;
    return f8_pair_bf16x2(word, h & 1);
}

#define F8_TC_U 4  // k-blocks in flight a warp

template <typename OUT>
__device__ __forceinline__ void gemv_f8_tc_impl(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                                const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                                int group, int m, int block) {
    __shared__ float red[8][32][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long tile0 = (long long)block * 16;
    // Rows past n read row n - 1 (never stored).
    const long long ra = min(tile0 + g, (long long)n - 1), rb = min(tile0 + g + 8, (long long)n - 1);
    const int pieces = k >> 4, nblk = k >> 6;
    const uint4* wa = (const uint4*)(W + ra * k);
    const uint4* wb = (const uint4*)(W + rb * k);
    const bool xon = g < m;
    const uint4* xr = (const uint4*)(X + (size_t)(xon ? g : 0) * k);
    const int scols = (k + group - 1) / group;
    const float* sa = S + ra * scols;
    const float* sb = S + rb * scols;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int b0 = warp; b0 < nblk; b0 += 8 * F8_TC_U) {
        uint4 pa[F8_TC_U], pb[F8_TC_U], px[F8_TC_U][2];
#pragma unroll
        for (int i = 0; i < F8_TC_U; ++i) {
            const int p = 4 * (b0 + 8 * i) + t;
            const bool on = p < pieces;
            pa[i] = on ? __ldcs(wa + p) : make_uint4(0, 0, 0, 0);
            pb[i] = on ? __ldcs(wb + p) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int v = 0; v < 2; ++v) px[i][v] = on && xon ? __ldg(xr + 2 * p + v) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < F8_TC_U; ++i) {
            const int b = b0 + 8 * i;
            const u32 xw[8] = {px[i][0].x, px[i][0].y, px[i][0].z, px[i][0].w,
                               px[i][1].x, px[i][1].y, px[i][1].z, px[i][1].w};
            float cp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            // Step s pairs A values 4s .. 4s + 3 of the lane's piece with x words 2s, 2s + 1.
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const u32 a[4] = {f8_bf16x2(pa[i], 2 * s), f8_bf16x2(pb[i], 2 * s), f8_bf16x2(pa[i], 2 * s + 1),
                                  f8_bf16x2(pb[i], 2 * s + 1)};
                f8_mma(cp, a, xw[2 * s], xw[2 * s + 1]);
            }
            if (b < nblk) {
                const float s0 = __ldg(sa + (b << 6) / group) * F8_UNSCALE;
                const float s1 = __ldg(sb + (b << 6) / group) * F8_UNSCALE;
                c[0] = fmaf(cp[0], s0, c[0]);
                c[1] = fmaf(cp[1], s0, c[1]);
                c[2] = fmaf(cp[2], s1, c[2]);
                c[3] = fmaf(cp[3], s1, c[3]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][lane][i] = c[i];
    __syncthreads();
    if (threadIdx.x < 128) {
        // Output (row r of the tile, column j of X): c[(r / 8) · 2 + j % 2] of lane (r % 8) · 4 + j / 2.
        const int r = threadIdx.x >> 3, j = threadIdx.x & 7;
        const int ln = (r & 7) * 4 + (j >> 1), ci = (r >> 3) * 2 + (j & 1);
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) v += red[w][ln][ci];
        const long long row = tile0 + r;
        if (row < n && j < m) store_out<OUT>(Y, (size_t)j * n + row, v);
    }
}

// Entry points: grid = every segment's ceil(n / 16) blocks of 256 threads; m = 2..8 rows of X.
template <typename OUT>
__device__ __forceinline__ void gemv_f8_tc_segs(const GemvSegs& t, const bf16* X, int k, int group, int m) {
    const GemvSeg s = gemv_seg(t);
    gemv_f8_tc_impl<OUT>((const unsigned char*)s.w, s.s, X, (OUT*)s.y, s.n, k, group, m, gemv_seg_block(s));
}
extern "C" __global__ void __launch_bounds__(256) gemv_f8_tc(GEMV_F8_ARGS, int m) {
    pdl_prologue_prefetch(gemv_tile_span(gemv_seg(t), (long long)k));
    gemv_f8_tc_segs<bf16>(t, X, k, group, m);
}
extern "C" __global__ void __launch_bounds__(256) gemv_f8_tc_f32(GEMV_F8_ARGS, int m) {
    pdl_prologue_prefetch(gemv_tile_span(gemv_seg(t), (long long)k));
    gemv_f8_tc_segs<float>(t, X, k, group, m);
}

// ---- Dequantisation for the prefill GEMM ----
// Rows row0 .. row0 + rows of W as bf16 [rows, k]: one thread per 16-value chunk, bf16(fp8 · scale).
extern "C" __global__ void dequant_f8(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                      bf16* __restrict__ out, int row0, int rows, int k, int group) {
    pdl_prologue();
    const int chunks = k >> 4;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * chunks) return;
    const long long r = i / chunks;
    const int c = (int)(i - r * chunks);
    const long long row = row0 + r;
    const uint4 w = __ldcs((const uint4*)(W + row * k) + c);
    const float s = __ldg(S + row * ((k + group - 1) / group) + (c << 4) / group) * F8_UNSCALE;
    const u32 ws[4] = {w.x, w.y, w.z, w.w};
    u32 o[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float q[4];
        f8x4(ws[j], q);
        o[2 * j] = pack_bf16x2(q[0] * s, q[1] * s);
        o[2 * j + 1] = pack_bf16x2(q[2] * s, q[3] * s);
    }
    uint4* dst = (uint4*)(out + r * k) + 2 * c;
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// ---- Activations quantised per token group, for the FP8 tensor-core prefill GEMM ----
// The float8_e4m3fn code nearest |a| (ties to the even code, past 448 saturated): sm_89 and later convert
// in hardware (cvt.rn.satfinite), older chips search the increasing codes 0x00..0x7e (the CPU twin's
// rule, sanmai_weights::e4m3).
__device__ __forceinline__ unsigned char e4m3_code(float a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short two;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(0.0f), "f"(a));
    return (unsigned char)(two & 0xffu);
#else
    int lo = 0, hi = 0x7e;
    auto val = [](int c) {
        const int e = (c >> 3) & 15, m = c & 7;
        return e == 0 ? (float)m * 0.001953125f : ldexpf(1.0f + (float)m * 0.125f, e - 7);
    };
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (val(mid) <= a) lo = mid; else hi = mid - 1;
    }
    if (lo == 0x7e) return 0x7e;
    const float dl = a - val(lo), dh = val(lo + 1) - a;
    return (unsigned char)((dl < dh || (dl == dh && (lo & 1) == 0)) ? lo : lo + 1);
#endif
}

// X bf16 [m, k] (k a multiple of 128) -> Q e4m3 [m, k] and S f32 [k / 128, m] (rows contiguous): one warp a
// (row, 128-column group); s = max|x| / 448 over the group (1 for an all-zero group), q = e4m3(x / s).
// Grid (k / 128, m), 32 threads, 4 values a lane.
extern "C" __global__ void __launch_bounds__(32) quant_f8_tokens(const bf16* __restrict__ X,
                                                                  unsigned char* __restrict__ Q,
                                                                  float* __restrict__ S, int m, int k) {
    pdl_prologue();
    const int g = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    const long long at = (long long)row * k + g * 128 + lane * 4;
    const uint2 raw = *(const uint2*)(X + at);
    const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    const float v[4] = {__low2float(p0), __high2float(p0), __low2float(p1), __high2float(p1)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    u32 word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float t = v[j] / s;
        const unsigned char c = e4m3_code(fabsf(t));
        word |= (u32)(c | ((t < 0.0f && c != 0) ? 0x80u : 0u)) << (8 * j);
    }
    *(u32*)(Q + at) = word;
    if (lane == 0) S[(long long)g * m + row] = s;
}

// ---- Grouped GEMV of FP8 routed experts ----
// moe.cu's grouped GEMV with FP8 units: tile t = (expert x, start, count) of the grid's y; for each pair
// p = perm[start + m], y[p, :] = W_x · X[moe_x_row(p), :], W_x the bytes at w_ptrs[x] and its scales at
// s_ptrs[x]. A row is cut into 16-value units (one 16-byte load); a lane group of `lanes` lanes shares a
// row (lane `sub` taking units sub, sub + lanes, ...), each group owns RPG rows, and a lane issues the
// loads of D units of each of its rows (and their scales) before using any. A tile's pairs are taken in
// passes of at most MMAX; the pass's slots past its count repeat its first pair and are not stored. The
// grid does not depend on the routing: every tile slot runs, empty ones return at once.
// STAGED (the fused SwiGLU of the down projection): the pass's x rows are the tile's staged rows in
// shared memory, pair m of the pass at row m0 + m of XS, read with plain loads.
template <int RPG, int D, int M, bool STAGED, typename OUT>
__device__ __forceinline__ void moe_f8_pass(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                            const bf16* __restrict__ X, int x_div, u32 x_tail, const u32* __restrict__ pp,
                                            int mc, OUT* __restrict__ Y, int n, int k, int group, int lanes,
                                            int sub, int row0, int rstep, const uint4* XS, int m0) {
    const int units = k >> 4;
    const int scols = (k + group - 1) / group;
    const uint4* wrow[RPG];
    const float* srow[RPG];
#pragma unroll
    for (int r = 0; r < RPG; ++r) {
        const size_t row = (size_t)min(row0 + r * rstep, n - 1);
        wrow[r] = (const uint4*)(W + row * (size_t)k);
        srow[r] = S + row * scols;
    }
    u32 pr[M];
    const uint4* xr[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        pr[m] = pp[m < mc ? m : 0];
        xr[m] = STAGED ? XS + (size_t)(m0 + (m < mc ? m : 0)) * (k >> 3)
                       : (const uint4*)(X + (size_t)moe_x_row(pr[m], x_div, x_tail) * k);
    }
    float acc[RPG][M];
#pragma unroll
    for (int r = 0; r < RPG; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    const int step = lanes * D;
#pragma unroll 1
    for (int u0 = sub; u0 < units; u0 += step) {
        uint4 w[D][RPG];
        float su[D][RPG];
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int u = u0 + d * lanes;
#pragma unroll
            for (int r = 0; r < RPG; ++r) {
                const bool live = u < units;
                w[d][r] = live ? __ldg(wrow[r] + u) : make_uint4(0, 0, 0, 0);
                su[d][r] = live ? __ldg(srow[r] + (u << 4) / group) * F8_UNSCALE : 0.0f;
            }
        }
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int u = u0 + d * lanes;
            if (u >= units) break;
            float dd[RPG][M];
#pragma unroll
            for (int r = 0; r < RPG; ++r)
#pragma unroll
                for (int m = 0; m < M; ++m) dd[r][m] = 0.0f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float q[RPG][8];
#pragma unroll
                for (int r = 0; r < RPG; ++r) {
                    f8x4(h == 0 ? w[d][r].x : w[d][r].z, q[r]);
                    f8x4(h == 0 ? w[d][r].y : w[d][r].w, q[r] + 4);
                }
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    float xf[8];
                    unpack8(STAGED ? xr[m][2 * u + h] : __ldg(xr[m] + 2 * u + h), xf);
#pragma unroll
                    for (int r = 0; r < RPG; ++r)
#pragma unroll
                        for (int e = 0; e < 8; ++e) dd[r][m] = fmaf(q[r][e], xf[e], dd[r][m]);
                }
            }
#pragma unroll
            for (int r = 0; r < RPG; ++r)
#pragma unroll
                for (int m = 0; m < M; ++m) acc[r][m] = fmaf(dd[r][m], su[d][r], acc[r][m]);
        }
    }
#pragma unroll
    for (int r = 0; r < RPG; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m)
            for (int o = lanes >> 1; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);
    if (sub == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m)
            if (m < mc)
#pragma unroll
                for (int r = 0; r < RPG; ++r) {
                    const int row = row0 + r * rstep;
                    if (row < n) store_out<OUT>(Y, (size_t)pr[m] * n + row, acc[r][m]);
                }
    }
}

// SWIGLU (the down projection, f32 out): X holds the pairs' gate|up rows [., 2k]; the block first stages
// its tile's x rows, bf16(silu(gate) · up) as swiglu_bf16 computes them, in dynamic shared memory
// (MOE_TILE · k bf16), so no activation launch runs between the two projections.
template <int RPG, int D, int MMAX, bool SWIGLU, typename OUT>
__device__ __forceinline__ void moe_f8_tile(const unsigned long long* __restrict__ w_ptrs,
                                            const unsigned long long* __restrict__ s_ptrs,
                                            const bf16* __restrict__ X, int x_div, u32 x_tail, const u32* __restrict__ perm,
                                            const u32* __restrict__ tiles, OUT* __restrict__ Y, int n, int k,
                                            int group, int lanes) {
    const int cnt = (int)tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;
    const u32 x = tiles[3 * blockIdx.y], start = tiles[3 * blockIdx.y + 1];
    const int groups = blockDim.x / lanes;
    const int g = threadIdx.x / lanes, sub = threadIdx.x & (lanes - 1);
    const unsigned char* W = (const unsigned char*)w_ptrs[x];
    const float* S = (const float*)s_ptrs[x];
    const u32* pp = perm + start;
    extern __shared__ uint4 f8_sx[];
    const uint4* xs = nullptr;
    if constexpr (SWIGLU) {
        const int per = k >> 3;
        for (int idx = threadIdx.x; idx < cnt * per; idx += blockDim.x) {
            const int m = idx / per, u = idx - m * per;
            const uint4* gu = (const uint4*)(X + (size_t)moe_x_row(pp[m], x_div, x_tail) * 2 * k);
            f8_sx[m * per + u] = swiglu8(gu, per, u);
        }
        __syncthreads();
        xs = f8_sx;
    }
    for (int rb = blockIdx.x * groups * RPG; rb < n; rb += gridDim.x * groups * RPG) {
        const int row0 = rb + g;
        for (int base = 0; base < cnt; base += MMAX) {
            const int mc = min(MMAX, cnt - base);
            if (MMAX == 1 || mc == 1)
                moe_f8_pass<RPG, D, 1, SWIGLU, OUT>(W, S, X, x_div, x_tail, pp + base, mc, Y, n, k, group, lanes, sub, row0, groups,
                                            xs, base);
            else
                moe_f8_pass<RPG, D, MMAX, SWIGLU, OUT>(W, S, X, x_div, x_tail, pp + base, mc, Y, n, k, group, lanes, sub, row0,
                                               groups, xs, base);
        }
    }
}

// Entry points (moe.cu's argument list). The plain forms take a tile's pairs up to eight at a time
// (RPG 2, D 1); the *_m1 forms (decode: a tile holds one pair or few) one at a time (RPG 2, D 2); the
// *_swiglu forms stage the SwiGLU of gate|up rows (dynamic shared memory MOE_TILE · k · 2 bytes). The
// launcher (ops/fp8.rs, moe_f8_plan) mirrors (RPG, D) to size the grid and pick `lanes`.
#define MOE_F8_ARGS const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, unsigned x_tail, const u32* perm, const u32* tiles
#define MOE_F8_PASS w_ptrs, s_ptrs, X, x_div, x_tail, perm, tiles, Y, n, k, group, lanes
extern "C" __global__ void __launch_bounds__(256) moe_gemv_f8_bf16(MOE_F8_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_f8_tile<2, 1, 8, false, bf16>(MOE_F8_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_f8_f32(MOE_F8_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_f8_tile<2, 1, 8, false, float>(MOE_F8_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_f8_bf16_m1(MOE_F8_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_f8_tile<2, 2, 1, false, bf16>(MOE_F8_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_f8_f32_m1(MOE_F8_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_f8_tile<2, 2, 1, false, float>(MOE_F8_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_f8_f32_swiglu(MOE_F8_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_f8_tile<2, 1, 8, true, float>(MOE_F8_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_f8_f32_m1_swiglu(MOE_F8_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_f8_tile<2, 2, 1, true, float>(MOE_F8_PASS); }
