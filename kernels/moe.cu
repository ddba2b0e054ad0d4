// Routed experts on the device, without the host learning which experts were chosen:
//   moe_sort   groups the (token, choice) pairs by expert and cuts each expert's run into tiles of at
//              most MOE_TILE pairs (one block, counting sort);
//   moe_gemv_* a grouped GEMV over the tiles: a block multiplies up to MOE_TILE input rows by rows of its
//              tile's expert weight, whose address comes from a device table of expert pointers, so only
//              the chosen experts' weights are read (each once per tile);
//   moe_gemv_q* the same grouped GEMV over packed integer experts (words and scales address tables);
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

// ---- The grouped GEMV over packed integer experts (INT4 / INT8 pack-quantized, INT6 gapless) ----
// The same tiles and pair permutation as moe_gemv_*, with each expert's weight given as packed words
// (w_ptrs[x], [n, words_per_row] u32) and f32 scales (s_ptrs[x], [n, ceil(k / group)]), decoded in
// registers: only the chosen experts' words and scales are read. The packing is quant.cu's: value j of
// a row is the code q + 2^(b-1), LSB first; INT4 8 codes a word, INT8 4, INT6 a 6-bit stream over rows
// padded to 32 values. A unit is 32 values of a row (4, 8 or 6 words).

// Unsigned code -> signed value as f32 (exact: (code | 2^23 pattern) is the float 2^23 + code).
template <int BITS>
__device__ __forceinline__ float moe_qval(u32 code) {
    return __uint_as_float(code | 0x4B000000u) - (8388608.0f + (float)(1 << (BITS - 1)));
}

template <int BITS> struct MoeUnit;
template <> struct MoeUnit<4> {
    static constexpr int WORDS = 4;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[4]) {
        const uint4 v = __ldg((const uint4*)row + u);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[4], int j) { return (w[j >> 3] >> ((j & 7) * 4)) & 15u; }
};
template <> struct MoeUnit<8> {
    static constexpr int WORDS = 8;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[8]) {
        const uint4 a = __ldg((const uint4*)row + 2 * u), b = __ldg((const uint4*)row + 2 * u + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[8], int j) { return (w[j >> 2] >> ((j & 3) * 8)) & 255u; }
};
template <> struct MoeUnit<6> {
    static constexpr int WORDS = 6;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[6]) {
        const uint2* p = (const uint2*)(row + 6 * u);
        const uint2 a = __ldg(p), b = __ldg(p + 1), c = __ldg(p + 2);
        w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y; w[4] = c.x; w[5] = c.y;
    }
    __device__ __forceinline__ static u32 code(const u32 w[6], int j) {
        const int bit = 6 * j, wi = bit >> 5, sh = bit & 31;
        const u32 v = sh <= 26 ? (w[wi] >> sh) : __funnelshift_r(w[wi], w[wi + 1], sh);
        return v & 63u;
    }
};

// Grid (ceil(n / (8·MOE_ROWS)), max_tiles); 256 threads (8 warps of MOE_ROWS weight rows; rows past n
// re-read row n - 1 and are not stored). Lane l decodes units l, l+32, ...; per 8-value chunk the
// rows' codes are decoded once and dotted with every pair's x chunk, times the chunk's scale, f32
// accumulation. k % 32 == 0 (INT4/INT8) or k % 8 == 0 (INT6), group % 8 == 0, X 16-byte aligned.
template <int BITS, typename OUT>
__device__ __forceinline__ void moe_gemv_q_impl(const unsigned long long* __restrict__ w_ptrs,
                                                const unsigned long long* __restrict__ s_ptrs,
                                                const bf16* __restrict__ X, int x_div, const u32* __restrict__ perm,
                                                const u32* __restrict__ tiles, OUT* __restrict__ Y, int n, int k,
                                                int group) {
    typedef MoeUnit<BITS> U;
    const u32 cnt = tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;
    const u32 x = tiles[3 * blockIdx.y], start = tiles[3 * blockIdx.y + 1];
    const int lane = threadIdx.x & 31;
    const long long row0 = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_ROWS;
    if (row0 >= n) return;
    const int nrows = (int)min((long long)MOE_ROWS, (long long)n - row0);
    const int units = (k + 31) >> 5;
    const size_t wpr = (size_t)units * U::WORDS;
    const int scols = (k + group - 1) / group;
    const u32* W = (const u32*)w_ptrs[x];
    const float* S = (const float*)s_ptrs[x];
    const u32* wrow[MOE_ROWS];
    const float* srow[MOE_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_ROWS; ++r) {
        const long long row = min(row0 + r, (long long)n - 1);
        wrow[r] = W + row * wpr;
        srow[r] = S + row * scols;
    }
    u32 p[MOE_TILE];
    const bf16* xr[MOE_TILE];
#pragma unroll
    for (int m = 0; m < MOE_TILE; ++m) {
        p[m] = m < (int)cnt ? perm[start + m] : perm[start];
        xr[m] = X + (size_t)(p[m] / x_div) * k;
    }
    float acc[MOE_ROWS][MOE_TILE];
#pragma unroll
    for (int r = 0; r < MOE_ROWS; ++r)
#pragma unroll
        for (int m = 0; m < MOE_TILE; ++m) acc[r][m] = 0.0f;
#pragma unroll 1
    for (int u = lane; u < units; u += 32) {
        u32 w[MOE_ROWS][U::WORDS];
#pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) U::load(wrow[r], u, w[r]);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int j0 = u * 32 + c * 8;
            // Only INT6 has a partial last unit (k % 8 == 0); INT4/INT8 need k % 32 == 0.
            if (BITS == 6 && j0 >= k) continue;
            float q[MOE_ROWS][8];
            float sc[MOE_ROWS];
#pragma unroll
            for (int r = 0; r < MOE_ROWS; ++r) {
                sc[r] = __ldg(srow[r] + j0 / group);
#pragma unroll
                for (int e = 0; e < 8; ++e) q[r][e] = moe_qval<BITS>(U::code(w[r], c * 8 + e));
            }
#pragma unroll
            for (int m = 0; m < MOE_TILE; ++m) {
                if (m < (int)cnt) {
                    float xf[8];
                    unpack8(__ldg((const uint4*)(xr[m] + j0)), xf);
#pragma unroll
                    for (int r = 0; r < MOE_ROWS; ++r) {
                        float d = 0.0f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) d = fmaf(q[r][e], xf[e], d);
                        acc[r][m] = fmaf(d, sc[r], acc[r][m]);
                    }
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

// Entry points: moe_gemv_q{bits}_{bf16 | f32}, Y [n_pairs, n] as for moe_gemv_bf16 / moe_gemv_f32.
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q4_bf16(const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, bf16* Y, int n, int k, int group) { moe_gemv_q_impl<4, bf16>(w_ptrs, s_ptrs, X, x_div, perm, tiles, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q4_f32(const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, float* Y, int n, int k, int group) { moe_gemv_q_impl<4, float>(w_ptrs, s_ptrs, X, x_div, perm, tiles, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q8_bf16(const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, bf16* Y, int n, int k, int group) { moe_gemv_q_impl<8, bf16>(w_ptrs, s_ptrs, X, x_div, perm, tiles, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q8_f32(const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, float* Y, int n, int k, int group) { moe_gemv_q_impl<8, float>(w_ptrs, s_ptrs, X, x_div, perm, tiles, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q6_bf16(const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, bf16* Y, int n, int k, int group) { moe_gemv_q_impl<6, bf16>(w_ptrs, s_ptrs, X, x_div, perm, tiles, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q6_f32(const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, const u32* perm, const u32* tiles, float* Y, int n, int k, int group) { moe_gemv_q_impl<6, float>(w_ptrs, s_ptrs, X, x_div, perm, tiles, Y, n, k, group); }

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
