// Depthwise causal conv1d (kernel K, no bias) + SiLU of the GDN mixer, with its rolling state of the
// last K − 1 inputs (bf16, exact: it holds inputs). w: [c, K], w[ch, K−1] multiplies the current token.
// out[s, ch] = silu(Σ_j w[ch, j] · xx[s + j, ch]) with xx = state ++ x, summed in order of j.
#include "common.cuh"

// Prefill of one sequence. x, out: [t, c]; state: [K−1, c] (read only here). One thread per (s, ch).
// Run conv1d_state_bf16 afterwards on the same stream to roll the state.
extern "C" __global__ void conv1d_prefill_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                               const bf16* __restrict__ state, bf16* __restrict__ out,
                                               int t, int c, int K) {
    const long long total = (long long)t * c;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int s = (int)(idx / c), ch = (int)(idx - (long long)s * c);
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int r = s + j;
            const bf16 v = r < K - 1 ? state[(size_t)r * c + ch] : x[(size_t)(r - (K - 1)) * c + ch];
            acc += bf2f(w[(size_t)ch * K + j]) * bf2f(v);
        }
        out[idx] = f2bf(silu_f(acc));
    }
}

// Rolls the state after a prefill of t tokens: state ← last K−1 rows of state ++ x. One thread per
// channel, rows in ascending order (row r reads row t + r > r, not yet overwritten).
extern "C" __global__ void conv1d_state_bf16(const bf16* __restrict__ x, bf16* __restrict__ state, int t,
                                             int c, int K) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    for (int r = 0; r < K - 1; ++r) {
        const int src = t + r;
        state[(size_t)r * c + ch] =
            src < K - 1 ? state[(size_t)src * c + ch] : x[(size_t)(src - (K - 1)) * c + ch];
    }
}

// One-token update for a batch of sequences: x, out: [B, c]; token b uses state slot slots[b] of
// state_pool [num_slots, K−1, c], which it reads, convolves and rolls (a slot id out of range gives
// zeros and touches nothing). One thread per (b, ch); grid (ceil(c / block), B). K ≤ 8.
extern "C" __global__ void conv1d_update_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              bf16* __restrict__ state_pool, const u32* __restrict__ slots,
                                              bf16* __restrict__ out, int B, int c, int K, u32 num_slots) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (ch >= c || b >= B || K > 8) return;
    if (slots[b] >= num_slots) {  // a bad slot id: no state to touch
        out[(size_t)b * c + ch] = f2bf(0.0f);
        return;
    }
    bf16* st = state_pool + (size_t)slots[b] * (K - 1) * c;
    // The window xx = state ++ x in registers (compile-time indices only).
    float win[8];
    const float xv = bf2f(x[(size_t)b * c + ch]);
#pragma unroll
    for (int j = 0; j < 8; ++j) win[j] = j < K - 1 ? bf2f(st[(size_t)j * c + ch]) : (j == K - 1 ? xv : 0.0f);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < K) acc += bf2f(w[(size_t)ch * K + j]) * win[j];
    out[(size_t)b * c + ch] = f2bf(silu_f(acc));
#pragma unroll
    for (int r = 0; r < 7; ++r)
        if (r < K - 1) st[(size_t)r * c + ch] = f2bf(win[r + 1]);
}
