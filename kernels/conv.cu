// Depthwise causal conv1d (kernel K, no bias) + SiLU of the GDN mixer, with its rolling state of the
// last K − 1 inputs (bf16, exact: it holds inputs). w: [c, K], w[ch, K−1] multiplies the current token.
// out[s, ch] = silu(Σ_j w[ch, j] · xx[s + j, ch]) with xx = state ++ x, summed in order of j.
#include "common.cuh"

// Prefill of every sequence of a step. x, out: [rows, c]; sequence b owns rows starts[b] … starts[b] +
// lens[b] − 1 (clamped to rows) and slot slots[b] of state_pool [num_slots, K−1, c], read only here (a
// slot id out of range gives zero outputs). Rows of no sequence are untouched. One thread per (row,
// channel) of a sequence: grid (ceil(c / block), any, n_seq), rows strided by gridDim.y. Run
// conv1d_roll_seqs_bf16 afterwards on the same stream to roll the states.
extern "C" __global__ void conv1d_prefill_seqs_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                    const bf16* __restrict__ state_pool,
                                                    const u32* __restrict__ starts, const u32* __restrict__ lens,
                                                    const u32* __restrict__ slots, bf16* __restrict__ out, int rows,
                                                    int c, int K, u32 num_slots) {
    pdl_prologue();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.z;
    if (ch >= c) return;
    const u32 s0 = starts[b];
    const int t = s0 < (u32)rows ? (int)min(lens[b], (u32)rows - s0) : 0;
    const bool ok = slots[b] < num_slots;
    const bf16* state = state_pool + (ok ? (size_t)slots[b] * (K - 1) * c : 0);
    const bf16* xs = x + (size_t)s0 * c;
    bf16* os = out + (size_t)s0 * c;
    for (int s = blockIdx.y; s < t; s += gridDim.y) {
        if (!ok) {
            os[(size_t)s * c + ch] = f2bf(0.0f);
            continue;
        }
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int r = s + j;
            const bf16 v = r < K - 1 ? state[(size_t)r * c + ch] : xs[(size_t)(r - (K - 1)) * c + ch];
            acc += bf2f(w[(size_t)ch * K + j]) * bf2f(v);
        }
        os[(size_t)s * c + ch] = f2bf(silu_f(acc));
    }
}

// Rolls the states after conv1d_prefill_seqs_bf16 (same arguments): slot slots[b] ← last K−1 rows of
// its state ++ the sequence's rows of x. One thread per (channel, sequence), grid (ceil(c / block),
// n_seq); rows in ascending order (row r reads row t + r > r, not yet overwritten). Sequences without
// rows or with a slot id out of range are skipped.
extern "C" __global__ void conv1d_roll_seqs_bf16(const bf16* __restrict__ x, bf16* __restrict__ state_pool,
                                                 const u32* __restrict__ starts, const u32* __restrict__ lens,
                                                 const u32* __restrict__ slots, int rows, int c, int K,
                                                 u32 num_slots) {
    pdl_prologue();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (ch >= c) return;
    const u32 s0 = starts[b];
    const int t = s0 < (u32)rows ? (int)min(lens[b], (u32)rows - s0) : 0;
    if (t == 0 || slots[b] >= num_slots) return;
    bf16* state = state_pool + (size_t)slots[b] * (K - 1) * c;
    const bf16* xs = x + (size_t)s0 * c;
    for (int r = 0; r < K - 1; ++r) {
        const int src = t + r;
        state[(size_t)r * c + ch] = src < K - 1 ? state[(size_t)src * c + ch] : xs[(size_t)(src - (K - 1)) * c + ch];
    }
}

// One-token update for a batch of sequences: x, out: [B, c]; token b uses state slot slots[b] of
// state_pool [num_slots, K−1, c], which it reads, convolves and rolls (a slot id out of range gives
// zeros and touches nothing). One thread per (b, ch); grid (ceil(c / block), B). K ≤ 8.
extern "C" __global__ void conv1d_update_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              bf16* __restrict__ state_pool, const u32* __restrict__ slots,
                                              bf16* __restrict__ out, int B, int c, int K, u32 num_slots) {
    pdl_prologue();
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
