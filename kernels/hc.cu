// The hyper-connections' gated residual (spec §4) of a decode step (M ≤ 8 rows) in two kernels:
//   hc_down_inject_silu: s[m, r] = bf16(silu(down[r]·y[m] + inject[r]·x[m]))          s: [M, rank]
//   hc_up_gate_mix:      R[m, j] = bf16(R[m, j] + sigmoid(up[j]·s[m]) · y[m, j % h])    R: [M, S·h]
// down [rank, h] and up [S·h, rank] are packed INT8 with one f32 scale per row (compressed-tensors
// channel strategy: value j of a row is the unsigned code q + 128 at bits 8(j%4) of word j/4), inject
// [rank, h] is bf16. Dot products and the gate are f32; each output is rounded once. Requirements
// (checked on the host): h % 32 == 0, rank % 32 == 0, 16-byte aligned buffers.
#include "packed.cuh"

// Threads of a hc_down_inject_silu block (one block per output r).
#define HC_DOWN_THREADS 128
// Threads of a hc_up_gate_mix block, and threads per output row j (a row slot).
#define HC_UP_THREADS 256
#define HC_UP_TPR 8

// The 8 INT8 codes of words a (values 0..3) and b (values 4..7) as signed f32: each code becomes the low
// byte of the float 2^23 + code (one byte permute), then the offset is subtracted; exact.
__device__ __forceinline__ void hc_decode8(u32 a, u32 b, float q[8]) {
    const float base = 8388608.0f + 128.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        q[e] = __uint_as_float(__byte_perm(a, 0x4B000000u, 0x7540u | e)) - base;
        q[4 + e] = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7540u | e)) - base;
    }
}

// Σ_e a[e] · b[e] over 8 values, in order.
__device__ __forceinline__ float hc_dot8(const float a[8], const float b[8]) {
    float t = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) t = fmaf(a[e], b[e], t);
    return t;
}

// One block per output r of rank. Thread t takes the 8-value chunks c = t, t + HC_DOWN_THREADS, ... of
// the row: 8 INT8 codes of down (one 8-byte load) against y and 8 bf16 of inject (one 16-byte load)
// against x, for all M rows (each weight chunk read once). The down sum gets the row's scale once; the
// block's sums are reduced through shared memory, and thread m < M writes s[m, r].
template <int M>
__device__ __forceinline__ void hc_down_inject_silu_impl(const u32* __restrict__ down,
                                                         const float* __restrict__ down_scales,
                                                         const bf16* __restrict__ inject,
                                                         const bf16* __restrict__ x, const bf16* __restrict__ y,
                                                         bf16* __restrict__ s, int h, int rank) {
    __shared__ float red[HC_DOWN_THREADS / 32][M];
    const int r = blockIdx.x;
    const uint2* drow = (const uint2*)(down + (size_t)r * (h / 4));
    const uint4* irow = (const uint4*)(inject + (size_t)r * h);
    const int chunks = h / 8;
    float accd[M], acci[M];
#pragma unroll
    for (int m = 0; m < M; ++m) accd[m] = acci[m] = 0.0f;
#pragma unroll 1
    for (int c = threadIdx.x; c < chunks; c += HC_DOWN_THREADS) {
        const uint2 dw = __ldcs(drow + c);
        float q[8], wi[8];
        hc_decode8(dw.x, dw.y, q);
        unpack8(__ldcs(irow + c), wi);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float yf[8], xf[8];
            unpack8(__ldg((const uint4*)(y + (size_t)m * h) + c), yf);
            unpack8(__ldg((const uint4*)(x + (size_t)m * h) + c), xf);
            accd[m] += hc_dot8(q, yf);
            acci[m] += hc_dot8(wi, xf);
        }
    }
    const float scale = __ldg(down_scales + r);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float v = warp_sum(fmaf(scale, accd[m], acci[m]));
        if (lane == 0) red[warp][m] = v;
    }
    __syncthreads();
    if (threadIdx.x < M) {
        const int m = threadIdx.x;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < HC_DOWN_THREADS / 32; ++w) v += red[w][m];
        s[(size_t)m * rank + r] = f2bf(silu_f(v));
    }
}

// Row slots of HC_UP_TPR threads, one output j = blockIdx.x · (HC_UP_THREADS / HC_UP_TPR) + slot each
// (n = S·h outputs). Thread p of a slot takes the 32-value units p, p + HC_UP_TPR, ... of up's row j
// against s[m] for all M rows; the slot's sums are combined with shuffles (every thread of the slot gets
// them), and thread p = m applies the gate to R[m, j]. A slot past n computes nothing but still takes
// part in the shuffles.
template <int M>
__device__ __forceinline__ void hc_up_gate_mix_impl(const u32* __restrict__ up, const float* __restrict__ up_scales,
                                                    const bf16* __restrict__ s, const bf16* __restrict__ y,
                                                    bf16* __restrict__ streams, int n, int h, int rank) {
    const int slot = threadIdx.x / HC_UP_TPR, p = threadIdx.x % HC_UP_TPR;
    const long long j = (long long)blockIdx.x * (HC_UP_THREADS / HC_UP_TPR) + slot;
    const bool valid = j < n;
    const int units = valid ? rank / 32 : 0;
    const u32* wrow = up + (valid ? j : 0) * (long long)(rank / 4);
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
#pragma unroll 1
    for (int u = p; u < units; u += HC_UP_TPR) {
        u32 w[8];
        PackedUnit<8, true>::load(wrow, u, w);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float q[8];
            hc_decode8(w[2 * c], w[2 * c + 1], q);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float sf[8];
                unpack8(__ldg((const uint4*)(s + (size_t)m * rank + u * 32 + c * 8)), sf);
                acc[m] += hc_dot8(q, sf);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float v = acc[m];
#pragma unroll
        for (int o = HC_UP_TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[m] = v;
    }
    if (!valid) return;
    const float scale = __ldg(up_scales + j);
    const int col = (int)(j % h);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m != p) continue;
        const size_t i = (size_t)m * n + j;
        const float gate = sigmoid_f(scale * acc[m]);
        streams[i] = f2bf(bf2f(streams[i]) + gate * bf2f(y[(size_t)m * h + col]));
    }
}

// Entry points per row count M (the host picks hc_down_inject_silu_m{M} / hc_up_gate_mix_m{M}). Grids:
// rank blocks of HC_DOWN_THREADS; ceil(n / (HC_UP_THREADS / HC_UP_TPR)) blocks of HC_UP_THREADS. Each
// block first asks L2 for the weight rows it reads (inject's row: two thirds of the down kernel's bytes).
#define HC_DOWN_ARGS                                                                                        \
    const u32 *down, const float *down_scales, const bf16 *inject, const bf16 *x, const bf16 *y, bf16 *s, \
        int h, int rank
#define HC_DOWN_PREFETCH inject + (size_t)blockIdx.x * h, 2LL * h
#define HC_DOWN_CALL down, down_scales, inject, x, y, s, h, rank

extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m1(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<1>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m2(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<2>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m3(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<3>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m4(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<4>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m5(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<5>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m6(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<6>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m7(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<7>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m8(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<8>(HC_DOWN_CALL); }

#define HC_UP_ARGS \
    const u32 *up, const float *up_scales, const bf16 *s, const bf16 *y, bf16 *streams, int n, int h, int rank
#define HC_UP_ROWS (HC_UP_THREADS / HC_UP_TPR)
#define HC_UP_PREFETCH \
    up + (size_t)blockIdx.x * HC_UP_ROWS * (rank / 4), \
        (long long)min(HC_UP_ROWS, n - (int)blockIdx.x * HC_UP_ROWS) * rank
#define HC_UP_CALL up, up_scales, s, y, streams, n, h, rank

extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m1(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<1>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m2(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<2>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m3(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<3>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m4(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<4>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m5(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<5>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m6(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<6>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m7(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<7>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m8(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<8>(HC_UP_CALL); }
