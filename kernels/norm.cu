// Row normalisations in bf16 with f32 arithmetic: RMSNorm (zero-centred `offset = 1` or plain
// `offset = 0`) and the gated RMSNorm of the GDN output. One rounding to bf16 per output.
//
// The vector kernels (`rms_norm_bf16`, `gated_rms_norm_bf16`; d % 8 == 0, d ≤ 8 · NORM_CHUNKS · 256,
// 16-byte aligned rows) give each row a slot of tpr = 2^tpr_log2 threads (1..256) of the block; a thread
// loads its ≤ NORM_CHUNKS 16-byte chunks of x (and z, w) at once and keeps them in registers, so the row is
// read once with every load in flight; the sum of squares is reduced with shuffles inside a warp and
// through shared memory when the slot spans several warps. Rows per block = blockDim.x / tpr (blockDim.x a
// multiple of 32, at most 256). The `_any` kernels take any d: one block per row, the row read twice.
#include "common.cuh"

#define NORM_CHUNKS 4

// Sum over the tpr threads of a slot (tpr a power of two ≤ 256); every thread of the slot gets it.
// `red` holds 8 floats; the call has a barrier when tpr > 32 (uniform over the block).
__device__ __forceinline__ float slot_sum(float v, int tpr, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < tpr) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (tpr > 32) {
        const int warp = threadIdx.x >> 5, nw = tpr >> 5, first = warp & ~(nw - 1);
        if ((threadIdx.x & 31) == 0) red[warp] = v;
        __syncthreads();
        v = 0.0f;
        for (int i = 0; i < nw; ++i) v += red[first + i];
    }
    return v;
}

// One output of the row normalisations: x · r (r = rsqrt(mean(x²) + eps)) times (offset + w), or with
// GATED w · (x · r) · silu(z).
template <bool GATED>
__device__ __forceinline__ float norm_out(float x, float r, float w, float z, float offset) {
    if (GATED) return (w * (x * r)) * silu_f(z);
    return (x * r) * (offset + w);
}

// The vector kernels' body (the file's head): z is read only when GATED, offset only when not.
template <bool GATED>
__device__ __forceinline__ void rms_norm_rows(const bf16* __restrict__ x, const bf16* __restrict__ z,
                                              const bf16* __restrict__ w, bf16* __restrict__ y, int rows, int d,
                                              float eps, float offset, int tpr_log2) {
    __shared__ float red[8];
    const int tpr = 1 << tpr_log2, p = threadIdx.x & (tpr - 1);
    const long long row = (long long)blockIdx.x * (blockDim.x >> tpr_log2) + (threadIdx.x >> tpr_log2);
    const bool live = row < rows;
    const int dv = d >> 3;
    const uint4* xr = (const uint4*)(x + (live ? row : 0) * d);
    const uint4* zr = (const uint4*)(z + (live ? row : 0) * d);
    uint4 xv[NORM_CHUNKS], zv[NORM_CHUNKS], wv[NORM_CHUNKS];
#pragma unroll
    for (int j = 0; j < NORM_CHUNKS; ++j) {
        const int c = p + j * tpr;
        const bool ok = live && c < dv;
        xv[j] = ok ? __ldg(xr + c) : make_uint4(0, 0, 0, 0);
        if (GATED) zv[j] = ok ? __ldg(zr + c) : make_uint4(0, 0, 0, 0);
        wv[j] = ok ? __ldg((const uint4*)w + c) : make_uint4(0, 0, 0, 0);
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_CHUNKS; ++j) {
        float f[8];
        unpack8(xv[j], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    ss = slot_sum(ss, tpr, red);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    if (!live) return;
    uint4* yr = (uint4*)(y + row * d);
#pragma unroll
    for (int j = 0; j < NORM_CHUNKS; ++j) {
        const int c = p + j * tpr;
        if (c < dv) {
            float f[8], g[8], h[8];
            unpack8(xv[j], f);
            unpack8(wv[j], g);
            if (GATED) unpack8(zv[j], h);
            u32 o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = 2 * e;
                o[e] = pack_bf16x2(norm_out<GATED>(f[i], r, g[i], GATED ? h[i] : 0.0f, offset),
                                   norm_out<GATED>(f[i + 1], r, g[i + 1], GATED ? h[i + 1] : 0.0f, offset));
            }
            yr[c] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}

// The `_any` kernels' body: one block per row (blockDim.x a multiple of 32, ≤ 1024), the row read twice
// (sum of squares, then the scaled write, the second time from cache).
template <bool GATED>
__device__ __forceinline__ void rms_norm_row_any(const bf16* __restrict__ x, const bf16* __restrict__ z,
                                                 const bf16* __restrict__ w, bf16* __restrict__ y, int d, float eps,
                                                 float offset) {
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
        yr[i] = f2bf(norm_out<GATED>(bf2f(xr[i]), r, bf2f(w[i]), GATED ? bf2f(z[row * d + i]) : 0.0f, offset));
    }
}

// y[r, :] = x[r, :] · rsqrt(mean(x[r, :]²) + eps) · (offset + w). x, y: [rows, d]; w: [d].
extern "C" __global__ void __launch_bounds__(256) rms_norm_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y, int rows, int d, float eps, float offset, int tpr_log2) {
    pdl_prologue();
    rms_norm_rows<false>(x, nullptr, w, y, rows, d, eps, offset, tpr_log2);
}

// y = w · (x · rsqrt(mean(x²) + eps)) · silu(z), per row of d. x, z, y: [rows, d]; w: [d].
extern "C" __global__ void __launch_bounds__(256) gated_rms_norm_bf16(const bf16* __restrict__ x, const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* __restrict__ y, int rows, int d, float eps, int tpr_log2) {
    pdl_prologue();
    rms_norm_rows<true>(x, z, w, y, rows, d, eps, 0.0f, tpr_log2);
}

// rms_norm_bf16 for any d.
extern "C" __global__ void rms_norm_bf16_any(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y, int d, float eps, float offset) {
    pdl_prologue();
    rms_norm_row_any<false>(x, nullptr, w, y, d, eps, offset);
}

// gated_rms_norm_bf16 for any d.
extern "C" __global__ void gated_rms_norm_bf16_any(const bf16* __restrict__ x, const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* __restrict__ y, int d, float eps) {
    pdl_prologue();
    rms_norm_row_any<true>(x, z, w, y, d, eps, 0.0f);
}
