// Decode GEMV, bf16 weights and activations with f32 accumulation: Y[m, :] = W · X[m, :] for M ≤ 8 rows
// of X at once, W [n, k] row-major. Memory-bound: the work is cut so that every GEMV fills the GPU
// whatever n is. A block of 256 threads is split into row slots of `tpr` threads (2^tpr_log2, 1..256);
// a slot owns `rps` (1..GEMV_ROWS) consecutive rows of W and its threads stride through the rows' 16-byte
// chunks together (coalesced, evict-first loads: the weights are read once), so each thread keeps
// 2 · rps loads in flight; X (a few KB) is read through the read-only cache. A slot's partial sums are
// reduced with shuffles inside a warp and, when a slot spans several warps (tpr > 32), through shared
// memory. The host picks rps and tpr per shape: 4 rows per 32-thread slot on large n (the lm_head), wider
// slots and fewer rows when n is small, so that even n = 1 spreads k over a block and n = 512 fills the
// GPU. Requires k % 8 == 0 and 16-byte aligned W, X.
#include "gemv.cuh"

// Batched decode (m = 2..8) on the tensor cores: the FMA loop of gemv_impl (gemv.cuh) issues an FMA and a widening per
// weight and row of X, so at m = 8 it is bound by issue; here mma.sync m16n8k16 (bf16 in, f32
// accumulation) multiplies each weight with every row of X at once. A block of 256 threads (8 warps)
// owns 16 rows of W (the A tile; X^T, zero past row m, is B); warp w takes the 32-value k-blocks
// w, w + 8, ..., and lane (g = lane / 4, t = lane % 4) streams 16 bytes of rows g and g + 8 per k-block,
// values 32b + 8t .. 32b + 8t + 7, with x[g] at the same positions. The reduction runs over k, so the
// positions inside an mma's 16 are free as long as the A and B pairs agree: step s of a k-block pairs
// the lane's values 4s .. 4s + 3 of W and X. The 8 warps' fragments are summed in shared memory.
// Requires k % 32 == 0, 16-byte aligned W and X.
__device__ __forceinline__ void tc_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename OUT>
__device__ __forceinline__ void gemv_tc_impl(const bf16* __restrict__ W, const bf16* __restrict__ X,
                                             OUT* __restrict__ Y, int n, int k, int m, int block) {
    constexpr int U = 4;  // k-blocks in flight a warp
    __shared__ float red[8][32][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long tile0 = (long long)block * 16;
    // Rows past n read row n - 1 (never stored).
    const long long ra = min(tile0 + g, (long long)n - 1), rb = min(tile0 + g + 8, (long long)n - 1);
    const uint4* wa = (const uint4*)(W + ra * k) + t;
    const uint4* wb = (const uint4*)(W + rb * k) + t;
    const bool xon = g < m;
    const uint4* xr = (const uint4*)(X + (size_t)(xon ? g : 0) * k) + t;
    const int nblk = k >> 5;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int b0 = warp; b0 < nblk; b0 += 8 * U) {
        uint4 pa[U], pb[U], px[U];
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int b = b0 + 8 * i;
            const bool on = b < nblk;
            pa[i] = on ? __ldcs(wa + 4 * b) : make_uint4(0, 0, 0, 0);
            pb[i] = on ? __ldcs(wb + 4 * b) : make_uint4(0, 0, 0, 0);
            px[i] = on && xon ? __ldg(xr + 4 * b) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const u32 a0[4] = {pa[i].x, pb[i].x, pa[i].y, pb[i].y};
            const u32 a1[4] = {pa[i].z, pb[i].z, pa[i].w, pb[i].w};
            tc_mma(c, a0, px[i].x, px[i].y);
            tc_mma(c, a1, px[i].z, px[i].w);
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

// Entry points. Each runs the segment table t (common.cuh): a block finds its segment and runs the body
// on that weight, output and n with its index inside the segment; a single GEMV is a one-segment table.
// The first statement asks L2 for the block's weight rows before the PDL wait.

// The row-slot (gemv_impl) and tensor-core (gemv_tc_impl) GEMVs on this block's segment of t.
template <int M, typename OUT>
__device__ __forceinline__ void gemv_segs(const GemvSegs& t, const bf16* X, int k) {
    const GemvSeg s = gemv_seg(t);
    gemv_impl<M, OUT>((const bf16*)s.w, X, (OUT*)s.y, s.n, k, s.rps, s.tpr_log2, gemv_seg_block(s));
}
template <typename OUT>
__device__ __forceinline__ void gemv_tc_segs(const GemvSegs& t, const bf16* X, int k, int m) {
    const GemvSeg s = gemv_seg(t);
    gemv_tc_impl<OUT>((const bf16*)s.w, X, (OUT*)s.y, s.n, k, m, gemv_seg_block(s));
}

// Tensor cores: Y: [m, n] per segment; 256 threads, ceil(n / 16) blocks a segment, 2 ≤ m ≤ 8, k % 32 == 0.
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_tc(const GemvSegs t, const bf16* X, int k, int m) { pdl_prologue_prefetch(gemv_tile_span(gemv_seg(t), 2LL * k)); gemv_tc_segs<bf16>(t, X, k, m); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_tc_f32(const GemvSegs t, const bf16* X, int k, int m) { pdl_prologue_prefetch(gemv_tile_span(gemv_seg(t), 2LL * k)); gemv_tc_segs<float>(t, X, k, m); }

// Row slots: Y: [M, n] per segment, bf16. 256 threads; per segment rps ∈ 1..GEMV_ROWS rows a slot, slots
// of 2^tpr_log2 ≤ 256 threads, ceil(n / (rps · 256 / 2^tpr_log2)) blocks.
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m1(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<1, bf16>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m2(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<2, bf16>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m3(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<3, bf16>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m4(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<4, bf16>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m5(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<5, bf16>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m6(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<6, bf16>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m7(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<7, bf16>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m8(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<8, bf16>(t, X, k); }
// Y f32 (logits, router scores); same launch as above.
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m1(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<1, float>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m2(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<2, float>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m3(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<3, float>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m4(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<4, float>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m5(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<5, float>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m6(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<6, float>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m7(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<7, float>(t, X, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m8(const GemvSegs t, const bf16* X, int k) { pdl_prologue_prefetch(gemv_slot_span(gemv_seg(t), 2LL * k)); gemv_segs<8, float>(t, X, k); }
