// The hyper-connections' gated residual (spec §4) of a decode step (M ≤ 8 rows) in two kernels:
//   hc_down_inject_silu: s[m, r] = bf16(silu(down[r]·y[m] + inject[r]·x[m]))          s: [M, rank]
//   hc_up_gate_mix:      R[m, j] = bf16(R[m, j] + sigmoid(up[j]·s[m]) · y[m, j % h])    R: [M, S·h]
//                        and, when given pre, the next sublayer's pre-mix of the new R into xn [M, h]
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
// Output rows a hc_up_gate_mix block computes (its row slots).
#define HC_UP_ROWS (HC_UP_THREADS / HC_UP_TPR)

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

// Row slots of HC_UP_TPR threads; block b takes columns b·cpb .. b·cpb + cpb − 1 of every stream
// (cpb = HC_UP_ROWS / S columns, S = n / h streams ≤ HC_UP_ROWS): slot k computes output j = c·h + i of
// stream c = k / cpb, column i = b·cpb + k % cpb. Thread p of a slot takes the 32-value units p,
// p + HC_UP_TPR, ... of up's row j against s[m] for all M rows; the slot's sums are combined with
// shuffles (every thread of the slot gets them), and thread p = m applies the gate to R[m, j]. A slot
// past its stream's h columns (or past S · cpb) computes nothing but still takes part in the shuffles.
// With xn (and pre): the block then pre-mixes its columns, xn[m, i] = Σ_c softmax(pre)_c · R[m, c·h + i]
// (hc_premix_bf16's sum: softmax in f32 with the max subtracted, the sum in stream order, one rounding).
template <int M>
__device__ __forceinline__ void hc_up_gate_mix_impl(const u32* __restrict__ up, const float* __restrict__ up_scales,
                                                    const bf16* __restrict__ s, const bf16* __restrict__ y,
                                                    bf16* __restrict__ streams, int n, int h, int rank,
                                                    const float* __restrict__ pre, bf16* __restrict__ xn) {
    __shared__ float mixed[M][HC_UP_ROWS];
    const int slot = threadIdx.x / HC_UP_TPR, p = threadIdx.x % HC_UP_TPR;
    const int ns = n / h, cpb = HC_UP_ROWS / ns;
    const int c = slot / cpb, i = blockIdx.x * cpb + slot % cpb;
    const bool valid = c < ns && i < h;
    const int j = c * h + i;
    const int units = valid ? rank / 32 : 0;
    const u32* wrow = up + (size_t)(valid ? j : 0) * (rank / 4);
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
#pragma unroll 1
    for (int u = p; u < units; u += HC_UP_TPR) {
        u32 w[8];
        PackedUnit<8, true>::load(wrow, u, w);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float qv[8];
            hc_decode8(w[2 * q], w[2 * q + 1], qv);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float sf[8];
                unpack8(__ldg((const uint4*)(s + (size_t)m * rank + u * 32 + q * 8)), sf);
                acc[m] += hc_dot8(qv, sf);
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
    if (valid) {
        const float scale = __ldg(up_scales + j);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m != p) continue;
            const size_t at = (size_t)m * n + j;
            const float gate = sigmoid_f(scale * acc[m]);
            const bf16 r = f2bf(bf2f(streams[at]) + gate * bf2f(y[(size_t)m * h + i]));
            streams[at] = r;
            mixed[m][slot] = bf2f(r);
        }
    }
    if (xn == nullptr) return;
    __syncthreads();
    const int t = threadIdx.x, m = t / cpb, col = t % cpb, ic = blockIdx.x * cpb + col;
    if (m >= M || ic >= h) return;
    float mx = NEG_INF;
    for (int q = 0; q < ns; ++q) mx = fmaxf(mx, pre[q]);
    float z = 0.0f;
    for (int q = 0; q < ns; ++q) z += expf(pre[q] - mx);
    float v = 0.0f;
    for (int q = 0; q < ns; ++q) v += (expf(pre[q] - mx) / z) * mixed[m][q * cpb + col];
    xn[(size_t)m * h + ic] = f2bf(v);
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

#define HC_UP_ARGS                                                                                         \
    const u32 *up, const float *up_scales, const bf16 *s, const bf16 *y, bf16 *streams, int n, int h, int rank, \
        const float *pre, bf16 *xn
#define HC_UP_CALL up, up_scales, s, y, streams, n, h, rank, pre, xn

// The up rows block b reads: each stream's run of cpb rows (hc_up_gate_mix_impl's columns).
struct HcUpRows {
    const u32* up;
    int n, h, rank;
};

// pdl_prologue, first asking L2 for the block's up rows (no kernel writes them).
__device__ __forceinline__ void pdl_prologue_prefetch(const HcUpRows& r) {
    const int ns = r.n / r.h, cpb = HC_UP_ROWS / ns, i0 = blockIdx.x * cpb;
    const long long cols = min(cpb, r.h - i0);
    for (int c = 0; c < ns; ++c) l2_prefetch(r.up + ((size_t)c * r.h + i0) * (r.rank / 4), cols * r.rank);
    pdl_prologue();
}
#define HC_UP_PREFETCH HcUpRows{up, n, h, rank}

extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m1(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<1>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m2(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<2>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m3(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<3>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m4(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<4>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m5(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<5>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m6(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<6>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m7(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<7>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m8(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<8>(HC_UP_CALL); }
