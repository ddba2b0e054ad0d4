// Routed experts on the device, without the host learning which experts were chosen:
//   moe_sort   groups the (token, choice) pairs by expert and cuts each expert's run into tiles of at
//              most MOE_TILE pairs (one block, counting sort);
//   moe_gemv_* a grouped GEMV over the tiles: a block multiplies up to MOE_TILE input rows by rows of its
//              tile's expert weight, whose address comes from a device table of expert pointers, so only
//              the chosen experts' weights are read (each once per tile);
//   moe_combine sums each token's expert outputs times its routing weights.
// Pairs are numbered p = token·top_k + choice, as the router writes ids and weights.
#include "common.cuh"

#define MOE_TILE 8
#define MOE_ROWS 4

// One block (any multiple of 32 threads). ids: [n_pairs] expert ids (< e; others are dropped); perm:
// [n_pairs] pair numbers grouped by expert; tiles: [max_tiles, 3] (expert, start in perm, count), the
// unused tail with count 0. Dynamic shared memory: 2·e u32.
extern "C" __global__ void moe_sort(const u32* __restrict__ ids, int n_pairs, int e, u32* __restrict__ perm,
                                    u32* __restrict__ tiles, int max_tiles) {
    extern __shared__ u32 sh[];
    u32* cnt = sh;
    u32* cur = sh + e;
    for (int i = threadIdx.x; i < e; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x)
        if (ids[p] < (u32)e) atomicAdd(&cnt[ids[p]], 1u);
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 off = 0;
        int nt = 0;
        for (int x = 0; x < e; ++x) {
            cur[x] = off;
            for (u32 s = 0; s < cnt[x] && nt < max_tiles; s += MOE_TILE) {
                tiles[3 * nt] = x;
                tiles[3 * nt + 1] = off + s;
                tiles[3 * nt + 2] = min((u32)MOE_TILE, cnt[x] - s);
                ++nt;
            }
            off += cnt[x];
        }
        for (; nt < max_tiles; ++nt) tiles[3 * nt + 2] = 0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const u32 x = ids[p];
        if (x < (u32)e) perm[atomicAdd(&cur[x], 1u)] = (u32)p;
    }
}

template <typename OUT>
__device__ __forceinline__ void moe_put(OUT* y, size_t i, float v);
template <>
__device__ __forceinline__ void moe_put<bf16>(bf16* y, size_t i, float v) { y[i] = f2bf(v); }
template <>
__device__ __forceinline__ void moe_put<float>(float* y, size_t i, float v) { y[i] = v; }

// Grid (ceil(n / (8·MOE_ROWS)), max_tiles); 256 threads (8 warps of MOE_ROWS weight rows). Tile t =
// (expert x, start, count): for each of its pairs p = perm[start + m], y[p, :] = W_x · X[p / x_div, :]
// with W_x = (const bf16*)w_ptrs[x], [n, k] row-major. k % 8 == 0 and every W_x and X 16-byte aligned.
template <typename OUT>
__device__ __forceinline__ void moe_gemv_impl(const unsigned long long* __restrict__ w_ptrs,
                                              const bf16* __restrict__ X, int x_div, const u32* __restrict__ perm,
                                              const u32* __restrict__ tiles, OUT* __restrict__ Y, int n, int k) {
    const u32 cnt = tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;
    const u32 x = tiles[3 * blockIdx.y], start = tiles[3 * blockIdx.y + 1];
    const int lane = threadIdx.x & 31;
    const long long row0 = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_ROWS;
    if (row0 >= n) return;
    const int nrows = (int)min((long long)MOE_ROWS, (long long)n - row0);
    const int kv = k >> 3;
    const uint4* w4 = (const uint4*)(const bf16*)w_ptrs[x] + row0 * kv;
    u32 p[MOE_TILE];
    const uint4* x4[MOE_TILE];
#pragma unroll
    for (int m = 0; m < MOE_TILE; ++m) {
        p[m] = m < (int)cnt ? perm[start + m] : perm[start];
        x4[m] = (const uint4*)X + (size_t)(p[m] / x_div) * kv;
    }
    float acc[MOE_ROWS][MOE_TILE];
#pragma unroll
    for (int r = 0; r < MOE_ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MOE_TILE; ++m) acc[r][m] = 0.0f;
    for (int c = lane; c < kv; c += 32) {
        uint4 wv[MOE_ROWS];
#pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) wv[r] = r < nrows ? __ldg(w4 + (size_t)r * kv + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int m = 0; m < MOE_TILE; ++m) {
            if (m < (int)cnt) {
                float xf[8];
                unpack8(__ldg(x4[m] + c), xf);
#pragma unroll
                for (int r = 0; r < MOE_ROWS; ++r) {
                    float wf[8];
                    unpack8(wv[r], wf);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[r][m] = fmaf(wf[q], xf[q], acc[r][m]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MOE_TILE; ++m) acc[r][m] = warp_sum(acc[r][m]);
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < MOE_TILE; ++m)
            if (m < (int)cnt)
#pragma unroll
                for (int r = 0; r < MOE_ROWS; ++r)
                    if (r < nrows) moe_put<OUT>(Y, (size_t)p[m] * n + row0 + r, acc[r][m]);
    }
}

// Y: [n_pairs, n] bf16 (the experts' fused gate|up rows).
extern "C" __global__ void __launch_bounds__(256) moe_gemv_bf16(const unsigned long long* w_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, bf16* Y, int n, int k) { moe_gemv_impl<bf16>(w_ptrs, X, x_div, perm, tiles, Y, n, k); }
// Y: [n_pairs, n] f32 (the experts' down projections, combined by moe_combine).
extern "C" __global__ void __launch_bounds__(256) moe_gemv_f32(const unsigned long long* w_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, float* Y, int n, int k) { moe_gemv_impl<float>(w_ptrs, X, x_div, perm, tiles, Y, n, k); }

// out[t, j] = Σ_c weights[t, c] · y[t·top_k + c, j], in choice order. Grid (tokens); y: [tokens·top_k,
// h] f32; weights: [tokens, top_k] f32; out: [tokens, h] bf16. Pairs whose expert id was dropped by
// moe_sort (id ≥ e) count as zero: ids is read to skip them.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                       const u32* __restrict__ ids, int e, bf16* __restrict__ out, int top_k,
                                       int h) {
    const int t = blockIdx.x;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < top_k; ++c) {
            const size_t p = (size_t)t * top_k + c;
            if (ids[p] < (u32)e) acc += weights[p] * y[p * h + j];
        }
        out[(size_t)t * h + j] = f2bf(acc);
    }
}
