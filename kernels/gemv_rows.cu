// The one-row INT8 packed GEMV cut as the layer launches' row phases (layer.cuh): a warp
// a row, B rows' loads in flight a warp before the first dot, x staged once a block in shared memory
// (ml_xs_chunk's order). Each segment of the table (common.cuh) owns its blocks; its warps take its
// rows grid-stride, B at a time (warp w of nw: rows w, w + nw, ..., w + (B − 1) nw, then w + B nw, ...),
// so a block's 8 warps read 8 neighbouring rows at once. Lane l sums units l, l + 32, ... of the row
// (ml_dot's order: each unit's 32 products in order, times its scale), the lanes' sums go through
// warp_sum, and lane 0 writes the row rounded to bf16. The sums run in another order than the unit
// GEMV's (quant.cu), so the two match to rounding, not bit for bit. Requirements (checked on the
// host): k % 32 == 0, k ≤ 1024 · GU, per-row scales or groups of whole 32-value units, 16-byte aligned
// W and x.
#include "layer.cuh"

// The blocks segment s of table t owns: up to the next used segment's first block, else the grid's end.
__device__ __forceinline__ int gr_seg_blocks(const GemvSegs& t, const GemvSeg& s) {
    int end = (int)gridDim.x;
#pragma unroll
    for (int j = 0; j < GEMV_SEGS; ++j)
        if (t.seg[j].block0 > s.block0 && t.seg[j].block0 < end) end = t.seg[j].block0;
    return end - s.block0;
}

// Rows a warp has in flight: about 48 words of codes a lane (GU units of PackedUnit<BITS>::WORDS each).
template <int BITS, int GU>
__host__ __device__ constexpr int gr_batch() {
    return 48 / (GU * PackedUnit<BITS, true>::WORDS) > 1 ? 48 / (GU * PackedUnit<BITS, true>::WORDS) : 1;
}

// The rows a block's warps take first: gr_batch runs of ML_WARPS rows of its segment.
template <int BITS, int GU>
struct GrFirst {
    const GemvSegs& t;
    int k;
};

// pdl_prologue, first asking L2 for the rows this block's warps take first.
template <int BITS, int GU>
__device__ __forceinline__ void pdl_prologue_prefetch(const GrFirst<BITS, GU>& f) {
    constexpr int B = gr_batch<BITS, GU>();
    const GemvSeg s = gemv_seg(f.t);
    const int nw = gr_seg_blocks(f.t, s) * ML_WARPS, r0 = gemv_seg_block(s) * ML_WARPS;
    const long long row_bytes = (long long)(f.k >> 5) * BITS * 4;
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const int r = r0 + b * nw;
        if (r < s.n) l2_prefetch((const char*)s.w + r * row_bytes, min(ML_WARPS, s.n - r) * row_bytes);
    }
    pdl_prologue();
}

template <int BITS, int GU>
__device__ __forceinline__ void gemv_rows_m1(const GemvSegs& t, const bf16* __restrict__ X, int k, int group) {
    constexpr int B = gr_batch<BITS, GU>();
    __shared__ __align__(16) bf16 xs[1024 * GU];
    const GemvSeg s = gemv_seg(t);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = gemv_seg_block(s) * ML_WARPS + warp, nw = gr_seg_blocks(t, s) * ML_WARPS;
    ml_stage_x(xs, X, k);
    __syncthreads();
    const u32* W = (const u32*)s.w;
    bf16* Y = (bf16*)s.y;
    const size_t wpr = (size_t)(k >> 5) * BITS;
    const int scols = (k + group - 1) / group;
#pragma unroll 1
    for (int i0 = gw; i0 < s.n; i0 += B * nw) {
        MlRow<BITS, GU> rows[B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int i = i0 + b * nw;
            if (i < s.n) ml_load<BITS, 32, GU>(rows[b], W + i * wpr, s.s + (size_t)i * scols, k, group, lane);
        }
        float d[B];
        ml_dots<BITS, 32, GU, true, B>(rows, xs, k, lane, d);
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int i = i0 + b * nw;
            if (i < s.n) {
                const float v = warp_sum(d[b]);
                if (lane == 0) Y[i] = f2bf(v);
            }
        }
    }
}

// Entry points gemv_q8_rows_u{GU} (INT8 only: INT6 ran slower than its unit GEMV on an H100, INT4
// is not measured): GU units of 32 values a lane (k ≤ 1024 · GU), gr_batch rows a warp in flight.
// 256 threads, two blocks a multiprocessor; the host cuts each segment's blocks (ops/quant.rs,
// rows_blocks).
#define GEMV_ROWS_ARGS const GemvSegs t, const bf16* X, int k, int group
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gemv_q8_rows_u2(GEMV_ROWS_ARGS) { pdl_prologue_prefetch(GrFirst<8, 2>{t, k}); gemv_rows_m1<8, 2>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gemv_q8_rows_u3(GEMV_ROWS_ARGS) { pdl_prologue_prefetch(GrFirst<8, 3>{t, k}); gemv_rows_m1<8, 3>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gemv_q8_rows_u4(GEMV_ROWS_ARGS) { pdl_prologue_prefetch(GrFirst<8, 4>{t, k}); gemv_rows_m1<8, 4>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gemv_q8_rows_u6(GEMV_ROWS_ARGS) { pdl_prologue_prefetch(GrFirst<8, 6>{t, k}); gemv_rows_m1<8, 6>(t, X, k, group); }
