// Decode GEMV, bf16 weights and activations with f32 accumulation: Y[m, :] = W · X[m, :] for M ≤ 8 rows
// of X at once, W [n, k] row-major. Memory-bound: each warp owns GEMV_ROWS consecutive rows of W and
// streams them with 16-byte loads (evict-first, the weights are read once), several loads in flight per
// lane; X (a few KB) is read through the read-only cache. Requires k % 8 == 0 and 16-byte aligned W, X.
#include "common.cuh"

#define GEMV_ROWS 4

template <typename OUT>
__device__ __forceinline__ void put(OUT* y, size_t i, float v);
template <>
__device__ __forceinline__ void put<bf16>(bf16* y, size_t i, float v) { y[i] = f2bf(v); }
template <>
__device__ __forceinline__ void put<float>(float* y, size_t i, float v) { y[i] = v; }

template <int M, typename OUT>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ W, const bf16* __restrict__ X,
                                          OUT* __restrict__ Y, int n, int k) {
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long row0 = warp * GEMV_ROWS;
    if (row0 >= n) return;
    const int nrows = (int)min((long long)GEMV_ROWS, (long long)n - row0);
    const int kv = k >> 3;
    const uint4* w4 = (const uint4*)W + row0 * kv;
    const uint4* x4 = (const uint4*)X;
    float acc[GEMV_ROWS][M];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

#pragma unroll 2
    for (int c = lane; c < kv; c += 32) {
        uint4 wv[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
            wv[r] = r < nrows ? __ldcs(w4 + (size_t)r * kv + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xf[8];
            unpack8(__ldg(x4 + (size_t)m * kv + c), xf);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                float wf[8];
                unpack8(wv[r], wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][m] = fmaf(wf[e], xf[e], acc[r][m]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
            if (r < nrows)
#pragma unroll
                for (int m = 0; m < M; ++m) put<OUT>(Y, (size_t)m * n + row0 + r, acc[r][m]);
    }
}

// Y: [M, n] bf16. Launch with 256 threads; grid = ceil(n / (8 · GEMV_ROWS)).
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m1(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<1, bf16>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m2(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<2, bf16>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m3(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<3, bf16>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m4(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<4, bf16>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m5(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<5, bf16>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m6(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<6, bf16>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m7(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<7, bf16>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_m8(const bf16* W, const bf16* X, bf16* Y, int n, int k) { gemv_impl<8, bf16>(W, X, Y, n, k); }
// Y: [M, n] f32 (logits, router scores).
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m1(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<1, float>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m2(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<2, float>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m3(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<3, float>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m4(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<4, float>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m5(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<5, float>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m6(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<6, float>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m7(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<7, float>(W, X, Y, n, k); }
extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32_m8(const bf16* W, const bf16* X, float* Y, int n, int k) { gemv_impl<8, float>(W, X, Y, n, k); }
