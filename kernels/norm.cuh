// The row normalisations' pieces (norm.cu, and the kernels that norm a row the way rms_norm_bf16
// does, hc.cu): a row slot of tpr threads, thread p holding the 16-byte chunks p, p + tpr, ... of the
// row (at most NORM_CHUNKS), its sum of squares and one chunk's outputs. Each output rounded once.
#pragma once
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

// The slot's sum of squares of its row: each thread's chunks (zeros past the row) in order, then
// slot_sum.
__device__ __forceinline__ float norm_sumsq(const uint4 (&xv)[NORM_CHUNKS], int tpr, float* red) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_CHUNKS; ++j) {
        float f[8];
        unpack8(xv[j], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    return slot_sum(ss, tpr, red);
}

// One output of the row normalisations: x · r (r = rsqrt(mean(x²) + eps)) times (offset + w), or with
// GATED w · (x · r) · silu(z).
template <bool GATED>
__device__ __forceinline__ float norm_out(float x, float r, float w, float z, float offset) {
    if (GATED) return (w * (x * r)) * silu_f(z);
    return (x * r) * (offset + w);
}

// The 8 outputs of chunk xv (weights wv, gates zv when GATED), packed bf16.
template <bool GATED>
__device__ __forceinline__ uint4 norm_chunk(uint4 xv, uint4 wv, uint4 zv, float r, float offset) {
    float f[8], g[8], h[8];
    unpack8(xv, f);
    unpack8(wv, g);
    if (GATED) unpack8(zv, h);
    u32 o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int i = 2 * e;
        o[e] = pack_bf16x2(norm_out<GATED>(f[i], r, g[i], GATED ? h[i] : 0.0f, offset),
                           norm_out<GATED>(f[i + 1], r, g[i + 1], GATED ? h[i + 1] : 0.0f, offset));
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}
