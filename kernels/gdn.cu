// Gated delta rule, recurrent decode step (one token per sequence), state f32.
// As transformers with use_qk_l2norm_in_kernel: q and k are l2-normalised (eps 1e-6) per head, q is
// scaled by dk^-0.5; value head h reads key head h / (hv / hk). Gates from the projections:
// g = −exp(A_log[h]) · softplus(a + dt_bias[h]), β = sigmoid(b). Per head, with S [dk, dv]:
// S ← S·exp(g); δ = β(v − Sᵀk); S ← S + k⊗δ; o = Sᵀq.
#include "common.cuh"

#define GDN_MAX_DK 256
// The decode step: threads per block, value columns per block (8 lanes × 4 columns per state row),
// row groups per block (each owns rows rg, rg + 16, … of S).
#define GDN_STEP_THREADS 128
#define GDN_STEP_COLS 32
#define GDN_STEP_RG 16

// One decode step of one (sequence, value head, 32 value columns): the block's slice of S [dk, 32]
// stays in registers (thread: 4 columns of NR rows, row group rg = warp·4 + lane / 8 owning rows
// rg + 16·n), read once and written once. One pass gives both column reductions, since with
// S' = S·decay + k⊗δ the output is o = S'ᵀq = decay·Sᵀq + δ·(k·q):
// mem = Sᵀk, sq = Sᵀq (per thread, then across the 4 row groups of a warp by shuffles and across
// the warps through shared memory), δ = β(v − decay·mem), o = decay·sq + δ·(k·q), S' stored.
template <int NR>
__device__ __forceinline__ void gdn_step_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                              const bf16* __restrict__ v, long long qkv_stride,
                                              const bf16* __restrict__ a, const bf16* __restrict__ b_gate,
                                              long long ab_stride, const float* __restrict__ A_log,
                                              const float* __restrict__ dt_bias, float* __restrict__ state_pool,
                                              const u32* __restrict__ slots, bf16* __restrict__ out, int hk, int hv,
                                              int dk, int dv, float q_scale, u32 num_slots) {
    __shared__ float qs[GDN_MAX_DK], ks[GDN_MAX_DK];
    __shared__ __align__(16) float part[2][GDN_STEP_THREADS / 32][GDN_STEP_COLS];
    __shared__ float sums[3][GDN_STEP_THREADS / 32];
    const int h = blockIdx.x, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rg = warp * 4 + (lane >> 3);
    const int c0 = 4 * (lane & 7);                    // first of this thread's columns inside the tile
    const int j0 = blockIdx.y * GDN_STEP_COLS + c0;  // … and in the head
    const bool vec = (dv & 3) == 0;                   // rows of S are 16-byte aligned
    const int kh = h / (hv / hk);

    // Everything that does not depend on the slot is requested first.
    const bf16* qr = q + b * qkv_stride + (size_t)kh * dk;
    const bf16* kr = k + b * qkv_stride + (size_t)kh * dk;
    float qv[GDN_MAX_DK / GDN_STEP_THREADS], kv[GDN_MAX_DK / GDN_STEP_THREADS];
#pragma unroll
    for (int u = 0; u < GDN_MAX_DK / GDN_STEP_THREADS; ++u) {
        const int i = threadIdx.x + u * GDN_STEP_THREADS;
        qv[u] = i < dk ? bf2f(qr[i]) : 0.0f;
        kv[u] = i < dk ? bf2f(kr[i]) : 0.0f;
    }
    float vj[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) vj[c] = j0 + c < dv ? bf2f(v[b * qkv_stride + (size_t)h * dv + j0 + c]) : 0.0f;
    const float araw = bf2f(a[b * ab_stride + h]), braw = bf2f(b_gate[b * ab_stride + h]);
    const float alog = A_log[h], bias = dt_bias[h];
    const u32 slot = slots[b];
    if (slot >= num_slots) {  // a bad slot id: zeros, no state touched
        if (rg == 0)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (j0 + c < dv) out[((size_t)b * hv + h) * dv + j0 + c] = f2bf(0.0f);
        return;
    }
    float* S = state_pool + ((size_t)slot * hv + h) * (size_t)dk * dv;
    float4 st[NR];
#pragma unroll
    for (int n = 0; n < NR; ++n) {
        const int i = rg + GDN_STEP_RG * n;
        st[n] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < dk && j0 < dv) {
            const float* src = S + (size_t)i * dv + j0;
            if (vec) {
                st[n] = *reinterpret_cast<const float4*>(src);
            } else {
                st[n].x = src[0];
                if (j0 + 1 < dv) st[n].y = src[1];
                if (j0 + 2 < dv) st[n].z = src[2];
                if (j0 + 3 < dv) st[n].w = src[3];
            }
        }
    }

    // q, k into shared memory with Σq², Σk², Σq·k over the block.
    float sq = 0.0f, sk = 0.0f, sqk = 0.0f;
#pragma unroll
    for (int u = 0; u < GDN_MAX_DK / GDN_STEP_THREADS; ++u) {
        const int i = threadIdx.x + u * GDN_STEP_THREADS;
        if (i < dk) {
            qs[i] = qv[u];
            ks[i] = kv[u];
        }
        sq += qv[u] * qv[u];
        sk += kv[u] * kv[u];
        sqk += qv[u] * kv[u];
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    sqk = warp_sum(sqk);
    if (lane == 0) {
        sums[0][warp] = sq;
        sums[1][warp] = sk;
        sums[2][warp] = sqk;
    }
    __syncthreads();
    sq = sk = sqk = 0.0f;
#pragma unroll
    for (int w = 0; w < GDN_STEP_THREADS / 32; ++w) {
        sq += sums[0][w];
        sk += sums[1][w];
        sqk += sums[2][w];
    }
    const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
    const float kq = sqk * rk * rq * q_scale;  // k·q of the normalised, scaled vectors
    const float g = -expf(alog) * softplus_f(araw + bias);
    const float decay = expf(g);
    const float beta = sigmoid_f(braw);

    // Partial Sᵀk and Sᵀq over this thread's rows.
    float mem[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sqp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float kn[NR];
#pragma unroll
    for (int n = 0; n < NR; ++n) {
        const int i = rg + GDN_STEP_RG * n;
        if (i >= dk) break;
        kn[n] = ks[i] * rk;
        const float qn = (qs[i] * rq) * q_scale;
        const float s[4] = {st[n].x, st[n].y, st[n].z, st[n].w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            mem[c] += s[c] * kn[n];
            sqp[c] += s[c] * qn;
        }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
        for (int o = 8; o < 32; o <<= 1) {
            mem[c] += __shfl_xor_sync(0xffffffffu, mem[c], o);
            sqp[c] += __shfl_xor_sync(0xffffffffu, sqp[c], o);
        }
    }
    if (lane < 8) {
        *reinterpret_cast<float4*>(&part[0][warp][c0]) = make_float4(mem[0], mem[1], mem[2], mem[3]);
        *reinterpret_cast<float4*>(&part[1][warp][c0]) = make_float4(sqp[0], sqp[1], sqp[2], sqp[3]);
    }
    __syncthreads();
    float delta[4];
    {
        float4 m = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < GDN_STEP_THREADS / 32; ++w) {
            const float4 p = *reinterpret_cast<const float4*>(&part[0][w][c0]);
            m.x += p.x;
            m.y += p.y;
            m.z += p.z;
            m.w += p.w;
        }
        const float mm[4] = {m.x, m.y, m.z, m.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) delta[c] = (vj[c] - decay * mm[c]) * beta;
    }
    if (rg == 0) {
        float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < GDN_STEP_THREADS / 32; ++w) {
            const float4 p = *reinterpret_cast<const float4*>(&part[1][w][c0]);
            t.x += p.x;
            t.y += p.y;
            t.z += p.z;
            t.w += p.w;
        }
        const float tt[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int c = 0; c < 4; ++c)
            if (j0 + c < dv) out[((size_t)b * hv + h) * dv + j0 + c] = f2bf(decay * tt[c] + delta[c] * kq);
    }

    // S ← S·decay + k⊗δ.
#pragma unroll
    for (int n = 0; n < NR; ++n) {
        const int i = rg + GDN_STEP_RG * n;
        if (i >= dk || j0 >= dv) break;
        float4 s = st[n];
        s.x = s.x * decay + kn[n] * delta[0];
        s.y = s.y * decay + kn[n] * delta[1];
        s.z = s.z * decay + kn[n] * delta[2];
        s.w = s.w * decay + kn[n] * delta[3];
        float* dst = S + (size_t)i * dv + j0;
        if (vec) {
            *reinterpret_cast<float4*>(dst) = s;
        } else {
            dst[0] = s.x;
            if (j0 + 1 < dv) dst[1] = s.y;
            if (j0 + 2 < dv) dst[2] = s.z;
            if (j0 + 3 < dv) dst[3] = s.w;
        }
    }
}

// Grid (hv, ceil(dv / 32), B); block GDN_STEP_THREADS threads. Block (h, c, b) updates value columns
// 32c .. 32c + 31 of head h of sequence b. q, k, v: token b's rows start at q + b·qkv_stride (same
// stride for the three; q, k [hk·dk], v [hv·dv]); a, b_gate: [B, hv] at stride ab_stride; state_pool:
// [num_slots, hv, dk, dv], sequence b in slot slots[b] (out of range: zeros, nothing touched); out:
// [B, hv·dv]; q_scale = dk^-0.5 as the host rounds it. gdn_recurrent_step takes dk ≤ 128,
// gdn_recurrent_step_dk256 dk ≤ 256 (more registers).
extern "C" __global__ void __launch_bounds__(GDN_STEP_THREADS) gdn_recurrent_step(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, long long qkv_stride,
    const bf16* __restrict__ a, const bf16* __restrict__ b_gate, long long ab_stride, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, float* __restrict__ state_pool, const u32* __restrict__ slots,
    bf16* __restrict__ out, int hk, int hv, int dk, int dv, float q_scale, u32 num_slots) {
    pdl_prologue();
    if (dk > GDN_STEP_RG * 8 || blockDim.x != GDN_STEP_THREADS) return;
    gdn_step_impl<8>(q, k, v, qkv_stride, a, b_gate, ab_stride, A_log, dt_bias, state_pool, slots, out, hk, hv, dk,
                     dv, q_scale, num_slots);
}
extern "C" __global__ void __launch_bounds__(GDN_STEP_THREADS) gdn_recurrent_step_dk256(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, long long qkv_stride,
    const bf16* __restrict__ a, const bf16* __restrict__ b_gate, long long ab_stride, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, float* __restrict__ state_pool, const u32* __restrict__ slots,
    bf16* __restrict__ out, int hk, int hv, int dk, int dv, float q_scale, u32 num_slots) {
    pdl_prologue();
    if (dk > GDN_STEP_RG * 16 || blockDim.x != GDN_STEP_THREADS) return;
    gdn_step_impl<16>(q, k, v, qkv_stride, a, b_gate, ab_stride, A_log, dt_bias, state_pool, slots, out, hk, hv,
                      dk, dv, q_scale, num_slots);
}
