// Row normalisations in bf16 with f32 arithmetic: RMSNorm (zero-centred `offset = 1` or plain
// `offset = 0`) and the gated RMSNorm of the GDN output. One block per row; the row is read twice
// (sum of squares, then the scaled write), the second time from cache. One rounding to bf16 per output.
#include "common.cuh"

// y[r, :] = x[r, :] · rsqrt(mean(x[r, :]²) + eps) · (offset + w). x, y: [rows, d]; w: [d].
extern "C" __global__ void rms_norm_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                         bf16* __restrict__ y, int d, float eps, float offset) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const bf16* xr = x + row * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = bf2f(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    bf16* yr = y + row * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        yr[i] = f2bf((bf2f(xr[i]) * r) * (offset + bf2f(w[i])));
    }
}

// y = w · (x · rsqrt(mean(x²) + eps)) · silu(z), per row of d. x, z, y: [rows, d]; w: [d].
extern "C" __global__ void gated_rms_norm_bf16(const bf16* __restrict__ x, const bf16* __restrict__ z,
                                               const bf16* __restrict__ w, bf16* __restrict__ y, int d,
                                               float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const bf16* xr = x + row * d;
    const bf16* zr = z + row * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = bf2f(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    bf16* yr = y + row * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        yr[i] = f2bf((bf2f(w[i]) * (bf2f(xr[i]) * r)) * silu_f(bf2f(zr[i])));
    }
}
