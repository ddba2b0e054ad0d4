// The PLE mix (spec §3.7) after its projections: per token and stream the gate u_c and its normed copy
// z_c, then the dilated causal depthwise conv + SiLU over the S·H channels with its per-sequence state
// (f32, the last (K−1)·dil rows of z) and the residual update R_c += u_c + y_c. Every rmsnorm is
// plain-weight with eps 1e-6 over the H channels of one stream, in f32.
#include "common.cuh"

#define PLE_EPS 1e-6f

// Grid (rows); block a multiple of 32 threads. Stream c of row r: v = v_lin + vb, key = rmsnorm(k_lin
// + kb; kn), q = rmsnorm(R_c; qn), σ = ⟨key, q⟩ / sqrt(H), σ = sign(σ)·sqrt(max(|σ|, 1e-6)) (sign(0)
// = 0), u = sigmoid(σ)·v, z = rmsnorm(u; cn). v_lin, k_lin: [rows, H] f32; R: [rows, S·H] bf16; u, z:
// [rows, S·H] f32 (columns c·H ..).
extern "C" __global__ void ple_gate(const float* __restrict__ v_lin, const bf16* __restrict__ vb,
                                    const float* __restrict__ k_lin, const bf16* __restrict__ kb,
                                    const bf16* __restrict__ kn, const bf16* __restrict__ R,
                                    const bf16* __restrict__ qn, const bf16* __restrict__ cn,
                                    float* __restrict__ u, float* __restrict__ z, int H, int S, int c) {
    pdl_prologue();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const size_t sh = (size_t)S * H;
    const float* vr = v_lin + (size_t)r * H;
    const float* kr = k_lin + (size_t)r * H;
    const bf16* rr = R + (size_t)r * sh + (size_t)c * H;
    float sk = 0.0f, sq = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float k = kr[i] + bf2f(kb[i]);
        const float q = bf2f(rr[i]);
        sk += k * k;
        sq += q * q;
    }
    sk = block_sum(sk, scratch);
    sq = block_sum(sq, scratch);
    const float ik = 1.0f / sqrtf(sk / (float)H + PLE_EPS);
    const float iq = 1.0f / sqrtf(sq / (float)H + PLE_EPS);
    float dot = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float k = ((kr[i] + bf2f(kb[i])) * ik) * bf2f(kn[i]);
        const float q = (bf2f(rr[i]) * iq) * bf2f(qn[i]);
        dot += k * q;
    }
    dot = block_sum(dot, scratch);
    float s = dot / sqrtf((float)H);
    if (s != 0.0f && !isnan(s)) s = copysignf(sqrtf(fmaxf(fabsf(s), 1e-6f)), s);
    const float g = sigmoid_f(s);
    float* ur = u + (size_t)r * sh + (size_t)c * H;
    float* zr = z + (size_t)r * sh + (size_t)c * H;
    float su = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float x = g * (vr[i] + bf2f(vb[i]));
        ur[i] = x;
        su += x * x;
    }
    su = block_sum(su, scratch);  // ends with a barrier: ur is written
    const float iz = 1.0f / sqrtf(su / (float)H + PLE_EPS);
    for (int i = threadIdx.x; i < H; i += blockDim.x) zr[i] = (ur[i] * iz) * bf2f(cn[i]);
}

// One chunk of one sequence, one thread per (s, ch): y = silu(Σ_j w[ch, j] · xx[s + j·dil, ch]) with
// xx = state ++ z (state [(K−1)·dil, C] read only here), summed in order of j; R[s, ch] += u[s, ch] +
// y. z, u: [t, C] f32; R: [t, C] bf16; w: [C, K]. Run ple_conv_state afterwards on the same stream.
extern "C" __global__ void ple_conv(const float* __restrict__ z, const bf16* __restrict__ w,
                                    const float* __restrict__ state, const float* __restrict__ u,
                                    bf16* __restrict__ R, int t, int C, int K, int dil) {
    pdl_prologue();
    const long long total = (long long)t * C;
    const int past = (K - 1) * dil;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int s = (int)(idx / C), ch = (int)(idx - (long long)s * C);
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int i = s + j * dil;
            const float x = i < past ? state[(size_t)i * C + ch] : z[(size_t)(i - past) * C + ch];
            acc += bf2f(w[(size_t)ch * K + j]) * x;
        }
        const float y = silu_f(acc);
        R[idx] = f2bf(bf2f(R[idx]) + (u[idx] + y));
    }
}

// Rolls the state after a chunk of t rows: state ← last past rows of state ++ z. One thread per channel,
// rows ascending (row i reads row t + i > i, not yet overwritten).
extern "C" __global__ void ple_conv_state(const float* __restrict__ z, float* __restrict__ state, int t, int C,
                                          int past) {
    pdl_prologue();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    for (int i = 0; i < past; ++i) {
        const int src = t + i;
        state[(size_t)i * C + ch] = src < past ? state[(size_t)src * C + ch] : z[(size_t)(src - past) * C + ch];
    }
}

// The decode form: one token of each of `rows` sequences, row r's conv state in state slot slots[r]
// (read on the device) of state_pool ([n_slots, (K−1)·dil, C] f32; a slot at or beyond n_slots is
// skipped). One thread per (r, ch), as ple_conv then ple_conv_state with t = 1: y = silu(Σ_j w[ch, j] ·
// xx[j·dil, ch]) over xx = state ++ z[r], R[r, ch] += u[r, ch] + y, then state ← its rows 1.. ++ z[r].
// The thread owns its channel of its slot's state, so the roll follows the reads in the same thread.
extern "C" __global__ void ple_conv_decode(const float* __restrict__ z, const bf16* __restrict__ w,
                                           float* __restrict__ state_pool, const u32* __restrict__ slots,
                                           u32 n_slots, const float* __restrict__ u, bf16* __restrict__ R, int rows,
                                           int C, int K, int dil) {
    pdl_prologue();
    const long long total = (long long)rows * C;
    const int past = (K - 1) * dil;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(idx / C), ch = (int)(idx - (long long)r * C);
        const u32 slot = slots[r];
        if (slot >= n_slots) continue;
        float* st = state_pool + (size_t)slot * past * C;
        const float zi = z[idx];
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int i = j * dil;
            const float x = i < past ? st[(size_t)i * C + ch] : zi;
            acc += bf2f(w[(size_t)ch * K + j]) * x;
        }
        const float y = silu_f(acc);
        R[idx] = f2bf(bf2f(R[idx]) + (u[idx] + y));
        for (int i = 0; i < past; ++i) st[(size_t)i * C + ch] = i + 1 < past ? st[(size_t)(i + 1) * C + ch] : zi;
    }
}
