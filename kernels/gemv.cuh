// The row-slot decode GEMV body (see gemv.cu for the cut and the loads), in a header so that a fused
// kernel can run a GEMV's rows with the same arithmetic as gemv_bf16_m1 (gdn.cu: the GDN gates).
#pragma once
#include "common.cuh"

#define GEMV_ROWS 4
#define GEMV_THREADS 256

template <int M, typename OUT>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ W, const bf16* __restrict__ X,
                                          OUT* __restrict__ Y, int n, int k, int rps, int tpr_log2, int block) {
    __shared__ float red[GEMV_THREADS / 32][GEMV_ROWS][M];
    const int tpr = 1 << tpr_log2;
    const int slot = threadIdx.x >> tpr_log2, p = threadIdx.x & (tpr - 1);
    const int slots = GEMV_THREADS >> tpr_log2;
    const long long row0 = ((long long)block * slots + slot) * rps;
    const int nrows = (int)max(0LL, min((long long)rps, (long long)n - row0));
    const int kv = k >> 3;
    const int kend = nrows > 0 ? kv : 0;
    const uint4* w4 = (const uint4*)W + (nrows > 0 ? row0 : 0) * kv;
    const uint4* x4 = (const uint4*)X;
    float acc[GEMV_ROWS][M];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

#pragma unroll 2
    for (int c = p; c < kend; c += tpr) {
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
                if (r >= rps) continue;  // uniform: no work for rows a slot never owns (small n)
                float wf[8];
                unpack8(wv[r], wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][m] = fmaf(wf[e], xf[e], acc[r][m]);
            }
        }
    }
    gemv_slot_sum<GEMV_ROWS, M, OUT>(acc, red, Y, n, row0, nrows, rps, tpr_log2, p);
}
