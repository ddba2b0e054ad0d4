// Depthwise causal conv1d (kernel K, no bias) + SiLU of the GDN mixer over a prefill chunk, with its
// state of the preceding inputs (bf16, exact: it holds inputs). w: [c, K], w[ch, K−1] multiplies the
// current token: the row at position p gives silu(Σ_j w[ch, j] · x_{p−K+1+j}[ch]), summed in order of j.
// The state of a slot is a ring [K, c] indexed by absolute position: input x_q lives at entry q mod K
// (the decode step in gdn.cu reads and writes the same ring).
#include "common.cuh"

// Prefill of every sequence of a step. x, out: [rows, c]; sequence b owns rows starts[b] … starts[b] +
// lens[b] − 1 (clamped to rows), its first row at position positions[starts[b]], and slot slots[b] of
// state_pool [num_slots, K, c], read only here (a slot id out of range gives zero outputs): inputs of
// positions before the chunk come from the ring, the others from x. Rows of no sequence are untouched.
// One thread per (row, channel) of a sequence: grid (ceil(c / block), any, n_seq), rows strided by
// gridDim.y. Run conv1d_ring_store_seqs_bf16 afterwards on the same stream to store the chunk's inputs.
extern "C" __global__ void conv1d_prefill_seqs_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                    const bf16* __restrict__ state_pool,
                                                    const u32* __restrict__ positions,
                                                    const u32* __restrict__ starts, const u32* __restrict__ lens,
                                                    const u32* __restrict__ slots, bf16* __restrict__ out, int rows,
                                                    int c, int K, u32 num_slots) {
    pdl_prologue();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.z;
    if (ch >= c) return;
    const u32 s0 = starts[b];
    const int t = s0 < (u32)rows ? (int)min(lens[b], (u32)rows - s0) : 0;
    if (t == 0) return;
    const bool ok = slots[b] < num_slots;
    const u32 pos0 = positions[s0];
    const bf16* ring = state_pool + (ok ? (size_t)slots[b] * K * c : 0);
    const bf16* xs = x + (size_t)s0 * c;
    bf16* os = out + (size_t)s0 * c;
    for (int s = blockIdx.y; s < t; s += gridDim.y) {
        if (!ok) {
            os[(size_t)s * c + ch] = f2bf(0.0f);
            continue;
        }
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            // Row r of the chunk, at position pos0 + r; r < 0 lies before the chunk, in ring entry
            // (pos0 + r) mod K = (pos0 + s + 1 + j) mod K.
            const int r = s + j - (K - 1);
            const bf16 v = r >= 0 ? xs[(size_t)r * c + ch]
                                  : ring[(size_t)((pos0 + (u32)(s + 1 + j)) % (u32)K) * c + ch];
            acc += bf2f(w[(size_t)ch * K + j]) * bf2f(v);
        }
        os[(size_t)s * c + ch] = f2bf(silu_f(acc));
    }
}

// Stores the chunk's inputs into the rings after conv1d_prefill_seqs_bf16 (same sequence arguments):
// row r of sequence b goes to ring entry (positions[starts[b]] + r) mod K for the last min(len, K − 1)
// rows, the ones a later token reads (a separate launch: the convolution reads ring entries these
// writes may reuse). One thread per (channel, sequence), grid (ceil(c / block), n_seq). Sequences
// without rows or with a slot id out of range are skipped.
extern "C" __global__ void conv1d_ring_store_seqs_bf16(const bf16* __restrict__ x, bf16* __restrict__ state_pool,
                                                       const u32* __restrict__ positions,
                                                       const u32* __restrict__ starts,
                                                       const u32* __restrict__ lens, const u32* __restrict__ slots,
                                                       int rows, int c, int K, u32 num_slots) {
    pdl_prologue();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (ch >= c) return;
    const u32 s0 = starts[b];
    const int t = s0 < (u32)rows ? (int)min(lens[b], (u32)rows - s0) : 0;
    if (t == 0 || slots[b] >= num_slots) return;
    const u32 pos0 = positions[s0];
    bf16* ring = state_pool + (size_t)slots[b] * K * c;
    const bf16* xs = x + (size_t)s0 * c;
    for (int r = max(0, t - (K - 1)); r < t; ++r)
        ring[(size_t)((pos0 + (u32)r) % (u32)K) * c + ch] = xs[(size_t)r * c + ch];
}
