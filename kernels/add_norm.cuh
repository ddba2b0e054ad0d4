// The residual add and the next RMSNorm of one row, shared by add_rms_norm_bf16 (elementwise.cu) and
// moe_combine_add_rms_norm (moe.cu), so that both give the same bits: the same thread owns the same
// elements and sums them in the same order whatever kernel runs it.
#pragma once
#include "common.cuh"

// ar[:] = bf16(ar[:] + yr[:]), then o[:] = ar[:] · rsqrt(mean(ar[:]²) + eps) · (offset + w) over the
// rounded sums, by the whole block (its size decides the order of the sums: row_threads(d) threads in
// both kernels). yr may point to shared memory. A thread keeps up to ADD_NORM_REGS of its sums in
// registers, the rest of a longer row is re-read. A thread issues every load of its register elements
// (ar, yr and w) before its first store: stores to ar between them would make each later load wait for
// the one before (the compiler cannot tell the indices apart), one memory latency per element.
#define ADD_NORM_REGS 8
__device__ __forceinline__ void add_rms_norm_row(bf16* __restrict__ ar, const bf16* __restrict__ yr,
                                                 const bf16* __restrict__ w, bf16* __restrict__ o, int d,
                                                 float eps, float offset, float* scratch) {
    float v[ADD_NORM_REGS], wv[ADD_NORM_REGS];
#pragma unroll
    for (int j = 0; j < ADD_NORM_REGS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        const bool ok = i < d;
        v[j] = ok ? bf2f(ar[i]) + bf2f(yr[i]) : 0.0f;
        wv[j] = ok ? bf2f(w[i]) : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < ADD_NORM_REGS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < d) {
            const bf16 s = f2bf(v[j]);
            ar[i] = s;
            v[j] = bf2f(s);
            ss += v[j] * v[j];
        }
    }
    for (int i = threadIdx.x + ADD_NORM_REGS * blockDim.x; i < d; i += blockDim.x) {
        const bf16 s = f2bf(bf2f(ar[i]) + bf2f(yr[i]));
        ar[i] = s;
        const float f = bf2f(s);
        ss += f * f;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
    for (int j = 0; j < ADD_NORM_REGS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < d) o[i] = f2bf((v[j] * r) * (offset + wv[j]));
    }
    for (int i = threadIdx.x + ADD_NORM_REGS * blockDim.x; i < d; i += blockDim.x)
        o[i] = f2bf((bf2f(ar[i]) * r) * (offset + bf2f(w[i])));
}

// The add and norm of a row that the blocks of one launch computed together (a GEMV's output row y of
// d values, each block writing its slice): every block calls it after its last write of y; the last
// block to finish (last_block_to_arrive, common.cuh) reads y through L2 into row (shared memory, d
// bf16), runs add_rms_norm_row on it and resets the ticket (one u32, 0 at launch and left 0). Every
// thread of every block must call it.
__device__ __forceinline__ void last_block_add_rms_norm(const bf16* y, bf16* __restrict__ acc,
                                                        const bf16* __restrict__ w, bf16* __restrict__ normed,
                                                        int d, float eps, float offset, u32* ticket,
                                                        unsigned short* row) {
    __shared__ float scratch[32];
    if (!last_block_to_arrive(ticket, gridDim.x)) return;
    const unsigned short* y16 = reinterpret_cast<const unsigned short*>(y);
    for (int i = threadIdx.x; i < d; i += blockDim.x) row[i] = __ldcg(y16 + i);
    __syncthreads();
    add_rms_norm_row(acc, reinterpret_cast<const bf16*>(row), w, normed, d, eps, offset, scratch);
    if (threadIdx.x == 0) *ticket = 0u;
}
