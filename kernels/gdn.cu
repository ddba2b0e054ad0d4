// Gated delta rule, recurrent decode step (one token per sequence), state f32.
// As transformers with use_qk_l2norm_in_kernel: q and k are l2-normalised (eps 1e-6) per head, q is
// scaled by dk^-0.5; value head h reads key head h / (hv / hk). Gates from the projections:
// g = −exp(A_log[h]) · softplus(a + dt_bias[h]), β = sigmoid(b). Per head, with S [dk, dv]:
// S ← S·exp(g); δ = β(v − Sᵀk); S ← S + k⊗δ; o = Sᵀq.
#include "common.cuh"

#define GDN_MAX_DK 256
#define GDN_MAX_GROUPS 32

// Grid (hv, ceil(dv / 32), B); block 32·G threads (G ≤ 32 row groups). Lane l of every warp owns column
// j = 32·blockIdx.y + l; warp g owns rows g, g + G, … of S. q, k, v: token b's rows start at
// q + b·qkv_stride (same stride for the three; q, k [hk·dk], v [hv·dv]); a, b_gate: [B, hv] at stride
// ab_stride; state_pool: [num_slots, hv, dk, dv], sequence b in slot slots[b] (out of range: zeros,
// nothing touched); out: [B, hv·dv]; q_scale = dk^-0.5 as the host rounds it.
// Loads one token's query and key head into shared memory, l2-normalised (eps 1e-6, as FLA) with the
// query also scaled by q_scale (dk^-0.5). Ends with a barrier: qs and ks are ready for every thread.
__device__ __forceinline__ void load_qk_normed(const bf16* qr, const bf16* kr, int dk, float q_scale, float* qs,
                                               float* ks, float* scratch) {
    float sq = 0.0f, sk = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float qv = bf2f(qr[i]), kv = bf2f(kr[i]);
        qs[i] = qv;
        ks[i] = kv;
        sq += qv * qv;
        sk += kv * kv;
    }
    sq = block_sum(sq, scratch);
    sk = block_sum(sk, scratch);
    const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        qs[i] = (qs[i] * rq) * q_scale;
        ks[i] = ks[i] * rk;
    }
    __syncthreads();
}

extern "C" __global__ void gdn_recurrent_step(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, long long qkv_stride,
                                              const bf16* __restrict__ a, const bf16* __restrict__ b_gate,
                                              long long ab_stride, const float* __restrict__ A_log,
                                              const float* __restrict__ dt_bias, float* __restrict__ state_pool,
                                              const u32* __restrict__ slots, bf16* __restrict__ out, int hk,
                                              int hv, int dk, int dv, float q_scale,
                                              u32 num_slots) {
    __shared__ float qs[GDN_MAX_DK], ks[GDN_MAX_DK];
    __shared__ float part[GDN_MAX_GROUPS][32];
    __shared__ float scratch[32];
    __shared__ float delta_s[32];
    const int h = blockIdx.x, b = blockIdx.z;
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5, ng = blockDim.x >> 5;
    if (dk > GDN_MAX_DK || ng > GDN_MAX_GROUPS) return;
    if (slots[b] >= num_slots) {  // a bad slot id: zeros, no state touched
        for (int j = blockIdx.y * 32 + threadIdx.x; j < min(dv, (int)(blockIdx.y * 32 + 32)); j += blockDim.x)
            out[((size_t)b * hv + h) * dv + j] = f2bf(0.0f);
        return;
    }
    const int kh = h / (hv / hk);

    load_qk_normed(q + b * qkv_stride + (size_t)kh * dk, k + b * qkv_stride + (size_t)kh * dk, dk, q_scale,
                   qs, ks, scratch);

    const float g = -expf(A_log[h]) * softplus_f(bf2f(a[b * ab_stride + h]) + dt_bias[h]);
    const float decay = expf(g);
    const float beta = sigmoid_f(bf2f(b_gate[b * ab_stride + h]));

    const int j = blockIdx.y * 32 + lane;
    const bool active = j < dv;
    float* S = state_pool + ((size_t)slots[b] * hv + h) * (size_t)dk * dv;

    // mem = (S·decay)ᵀ k, column j, partial over this warp's rows.
    float mem = 0.0f;
    if (active)
        for (int i = grp; i < dk; i += ng) mem += (S[(size_t)i * dv + j] * decay) * ks[i];
    part[grp][lane] = mem;
    __syncthreads();
    if (grp == 0) {
        float t = 0.0f;
        for (int w = 0; w < ng; ++w) t += part[w][lane];
        const float vj = active ? bf2f(v[b * qkv_stride + (size_t)h * dv + j]) : 0.0f;
        delta_s[lane] = (vj - t) * beta;
    }
    __syncthreads();
    const float delta = delta_s[lane];

    // S ← S·decay + k⊗δ; o = Sᵀq.
    float o = 0.0f;
    if (active)
        for (int i = grp; i < dk; i += ng) {
            const size_t at = (size_t)i * dv + j;
            const float s = S[at] * decay + ks[i] * delta;
            S[at] = s;
            o += s * qs[i];
        }
    part[grp][lane] = o;
    __syncthreads();
    if (grp == 0 && active) {
        float t = 0.0f;
        for (int w = 0; w < ng; ++w) t += part[w][lane];
        out[((size_t)b * hv + h) * dv + j] = f2bf(t);
    }
}

#define GDN_PF_GROUPS 4
#define GDN_PF_ROWS (GDN_MAX_DK / GDN_PF_GROUPS)

// Prefill of one sequence's t tokens, token by token inside one launch (the recurrent form; the state
// column this block owns stays in registers across the tokens). Grid (hv, ceil(dv / 32)); block
// 32·GDN_PF_GROUPS threads. q, k, v: token i's rows start at q + i·qkv_stride (as the step kernel);
// a, b_gate: [t, hv] at stride ab_stride; state: [hv, dk, dv], read at the start and written at the
// end; out: [t, hv·dv].
extern "C" __global__ void gdn_recurrent_prefill(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                 const bf16* __restrict__ v, long long qkv_stride,
                                                 const bf16* __restrict__ a, const bf16* __restrict__ b_gate,
                                                 long long ab_stride, const float* __restrict__ A_log,
                                                 const float* __restrict__ dt_bias, float* __restrict__ state,
                                                 bf16* __restrict__ out, int t, int hk, int hv, int dk, int dv,
                                                 float q_scale) {
    __shared__ float qs[GDN_MAX_DK], ks[GDN_MAX_DK];
    __shared__ float part[GDN_PF_GROUPS][32];
    __shared__ float scratch[32];
    __shared__ float delta_s[32];
    const int h = blockIdx.x;
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    if (dk > GDN_MAX_DK || blockDim.x != 32 * GDN_PF_GROUPS) return;
    const int kh = h / (hv / hk);
    const int j = blockIdx.y * 32 + lane;
    const bool active = j < dv;
    float* S = state + (size_t)h * dk * dv;
    float reg[GDN_PF_ROWS];
#pragma unroll
    for (int n = 0; n < GDN_PF_ROWS; ++n) {
        const int i = grp + n * GDN_PF_GROUPS;
        reg[n] = (active && i < dk) ? S[(size_t)i * dv + j] : 0.0f;
    }
    const float A = -expf(A_log[h]), bias = dt_bias[h];

    for (int tok = 0; tok < t; ++tok) {
        load_qk_normed(q + tok * qkv_stride + (size_t)kh * dk, k + tok * qkv_stride + (size_t)kh * dk, dk,
                       q_scale, qs, ks, scratch);

        const float g = A * softplus_f(bf2f(a[tok * ab_stride + h]) + bias);
        const float decay = expf(g);
        const float beta = sigmoid_f(bf2f(b_gate[tok * ab_stride + h]));

        float mem = 0.0f;
#pragma unroll
        for (int n = 0; n < GDN_PF_ROWS; ++n) {
            const int i = grp + n * GDN_PF_GROUPS;
            if (i < dk) mem += (reg[n] * decay) * ks[i];
        }
        part[grp][lane] = mem;
        __syncthreads();
        if (grp == 0) {
            float s = 0.0f;
            for (int w = 0; w < GDN_PF_GROUPS; ++w) s += part[w][lane];
            const float vj = active ? bf2f(v[tok * qkv_stride + (size_t)h * dv + j]) : 0.0f;
            delta_s[lane] = (vj - s) * beta;
        }
        __syncthreads();
        const float delta = delta_s[lane];

        float o = 0.0f;
#pragma unroll
        for (int n = 0; n < GDN_PF_ROWS; ++n) {
            const int i = grp + n * GDN_PF_GROUPS;
            if (i < dk) {
                const float s = reg[n] * decay + ks[i] * delta;
                reg[n] = s;
                o += s * qs[i];
            }
        }
        part[grp][lane] = o;
        __syncthreads();
        if (grp == 0 && active) {
            float s = 0.0f;
            for (int w = 0; w < GDN_PF_GROUPS; ++w) s += part[w][lane];
            out[((size_t)tok * hv + h) * dv + j] = f2bf(s);
        }
        __syncthreads();  // part, qs and ks are rewritten by the next token
    }
#pragma unroll
    for (int n = 0; n < GDN_PF_ROWS; ++n) {
        const int i = grp + n * GDN_PF_GROUPS;
        if (active && i < dk) S[(size_t)i * dv + j] = reg[n];
    }
}
