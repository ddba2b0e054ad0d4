// The decode step of a gated-delta-net layer (one token per sequence) in one launch: causal conv1d +
// SiLU of the token's projection row against the conv state ring, the gated delta rule with f32 state,
// and the gated RMSNorm of the output, all in f32 inside the block.
//
// Conv (as conv.cu): w [c, K], w[ch, K−1] multiplies the current token; out = silu(Σ_j w[ch, j] ·
// x_{p−K+1+j}[ch]) summed in order of j. The conv state of a slot is a ring [K, c] indexed by absolute
// position: input x_q lives at entry q mod K, so the token at position p reads entries (p + 1 + j) mod K
// (j < K − 1, positions p − K + 1 + j) and writes entry p mod K, which held x_{p−K} that nobody reads
// this step. Any number of blocks may read a channel while one of them writes it.
// Delta rule, as transformers with use_qk_l2norm_in_kernel: q and k are l2-normalised (eps 1e-6) per
// head, q is scaled by dk^-0.5; value head h reads key head h / (hv / hk). Gates from the projections:
// g = −exp(A_log[h]) · softplus(a + dt_bias[h]), β = sigmoid(b). Per head, with S [dk, dv]:
// S ← S·exp(g); δ = β(v − Sᵀk); S ← S + k⊗δ; o = Sᵀq.
// Norm: y = w · (o · rsqrt(mean(o²) + eps)) · silu(z) over the dv values of the head (plain weight),
// rounded once to bf16.
#include "gemv.cuh"

#define GDN_MAX_DK 256
// The head's conv outputs and o are kept in shared memory (the norm needs all of o).
#define GDN_MAX_DV 512
// Value columns of one pass over the state: 32 lanes × 4 columns.
#define GDN_TILE 128

// Loads this thread's part of the state tile starting at value column c0: 4 columns (c0 + 4·lane …)
// of rows warp + WARPS·n, n < NR; zeros outside rows [0, dk) and columns [0, dv) (dv, the row
// length). VEC: dv % 4 == 0, a template parameter so that the kernel a
// real model runs holds only the 16-byte path (a short launch waits on fetching its code).
template <int WARPS, int NR, bool VEC>
__device__ __forceinline__ void gdn_load_tile(float4 (&st)[NR], const float* __restrict__ S, int c0, int dk,
                                              int dv) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j0 = c0 + 4 * lane;
    constexpr bool vec = VEC;  // dv % 4 == 0: rows of S are 16-byte aligned
#pragma unroll
    for (int n = 0; n < NR; ++n) {
        const int i = warp + WARPS * n;
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
}

// Stores what gdn_load_tile loaded (same columns and rows, nothing outside [0, dk) × [0, dv)).
template <int WARPS, int NR, bool VEC>
__device__ __forceinline__ void gdn_store_tile(const float4 (&st)[NR], float* __restrict__ S, int c0, int dk,
                                               int dv) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j0 = c0 + 4 * lane;
    constexpr bool vec = VEC;
#pragma unroll
    for (int n = 0; n < NR; ++n) {
        const int i = warp + WARPS * n;
        if (i >= dk || j0 >= dv) break;
        float* dst = S + (size_t)i * dv + j0;
        if (vec) {
            *reinterpret_cast<float4*>(dst) = st[n];
        } else {
            dst[0] = st[n].x;
            if (j0 + 1 < dv) dst[1] = st[n].y;
            if (j0 + 2 < dv) dst[2] = st[n].z;
            if (j0 + 3 < dv) dst[3] = st[n].w;
        }
    }
}

// The sum over the block's warps of one partial column reduction: part[w][4·lane … 4·lane + 3], in
// warp order.
template <int WARPS>
__device__ __forceinline__ float4 gdn_sum_parts(const float (&part)[WARPS][GDN_TILE], int lane) {
    float4 m = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const float4 p = *reinterpret_cast<const float4*>(&part[w][4 * lane]);
        m.x += p.x;
        m.y += p.y;
        m.z += p.z;
        m.w += p.w;
    }
    return m;
}

// Causal conv + SiLU of channel ch for the token at position pos: the K − 1 preceding inputs from the
// ring (entry (pos + 1 + j) mod K holds position pos − K + 1 + j), then the token's own input x.
// first = (pos + 1) mod K, the ring entry of the first tap (computed once by the caller).
__device__ __forceinline__ float gdn_conv_channel(const bf16* __restrict__ ring, const bf16* __restrict__ w,
                                                  float x, u32 first, int ch, int c, int K) {
    float acc = 0.0f;
    u32 e = first;
#pragma unroll 4
    for (int j = 0; j < K - 1; ++j) {  // unrolled: the taps' loads in flight together
        acc += bf2f(w[(size_t)ch * K + j]) * bf2f(ring[(size_t)e * c + ch]);
        e = e + 1u == (u32)K ? 0u : e + 1u;
    }
    acc += bf2f(w[(size_t)ch * K + K - 1]) * x;
    return silu_f(acc);
}

// One block per (value head h = blockIdx.x, sequence b = blockIdx.y), WARPS warps; a_in, b_in are the
// head's raw gate projections a and b. Thread (warp, lane)
// keeps state rows warp + WARPS·n (n < NR, so dk ≤ WARPS·NR) of the value columns c0 + 4·lane … + 3 of
// the current tile in registers, read once and written once. One pass gives both column reductions,
// since with S' = S·decay + k⊗δ the output is o = S'ᵀq = decay·Sᵀq + δ·(k·q): mem = Sᵀk, sq = Sᵀq per
// thread, then across the warps through shared memory, δ = β(v − decay·mem), o = decay·sq + δ·(k·q).
// The parameters of gdn_decode_impl and of gdn_decode_any (which picks its instance), and their names.
#define GDN_IMPL_PARAMS                                                                                        \
    const bf16 *__restrict__ qkv, const bf16 *__restrict__ z, float a_in, float b_in,                         \
        const bf16 *__restrict__ conv_w, const float *__restrict__ A_log, const float *__restrict__ dt_bias,  \
        const bf16 *__restrict__ norm_w, bf16 *__restrict__ conv_pool, float *__restrict__ state_pool,        \
        const u32 *__restrict__ slots, const u32 *__restrict__ positions, bf16 *__restrict__ out, int hk,     \
        int hv, int dk, int dv, int K, float q_scale, float eps, u32 num_slots
#define GDN_IMPL_PASS                                                                                          \
    qkv, z, a_in, b_in, conv_w, A_log, dt_bias, norm_w, conv_pool, state_pool, slots, positions, out, hk, hv,  \
        dk, dv, K, q_scale, eps, num_slots
template <int WARPS, int NR, bool VEC>
__device__ __forceinline__ void gdn_decode_impl(GDN_IMPL_PARAMS) {
    __shared__ float xs[2 * GDN_MAX_DK + GDN_MAX_DV];  // conv outputs q | k | v of this head
    __shared__ float os[GDN_MAX_DV];                    // o of this head, before the norm
    __shared__ __align__(16) float part[2][WARPS][GDN_TILE];
    __shared__ float sums[3][WARPS];
    __shared__ float scratch[32];
    const int h = blockIdx.x, b = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ratio = hv / hk, kh = h / ratio;
    const int c = 2 * hk * dk + hv * dv;
    bf16* orow = out + ((size_t)b * hv + h) * dv;
    const u32 slot = slots[b];
    if (slot >= num_slots) {  // a bad slot id: zeros, no state touched
        for (int j = threadIdx.x; j < dv; j += blockDim.x) orow[j] = f2bf(0.0f);
        return;
    }
    const u32 pos = positions[b];
    float* S = state_pool + ((size_t)slot * hv + h) * (size_t)dk * dv;
    // The first state tile is requested before the conv, so its loads overlap the conv's.
    float4 st[NR];
    gdn_load_tile<WARPS, NR, VEC>(st, S, 0, dk, dv);

    // Conv of this head's channels: local t < dk is q of key head kh, dk ≤ t < 2dk its k, then v of
    // head h. The first value head of a key group stores the q/k inputs, every head its own v (with
    // K = 1 no token reads the ring: nothing is stored).
    bf16* ring = conv_pool + (size_t)slot * K * c;
    const bf16* xrow = qkv + (size_t)b * c;
    const bool store_qk = K > 1 && h % ratio == 0, store_v = K > 1;
    const size_t wr = (size_t)(pos % (u32)K) * c;
    const u32 first = (pos + 1u) % (u32)K;
#pragma unroll 1
    for (int t = threadIdx.x; t < 2 * dk + dv; t += blockDim.x) {
        const int ch = t < dk       ? kh * dk + t
                       : t < 2 * dk ? (hk + kh) * dk + (t - dk)
                                    : 2 * hk * dk + h * dv + (t - 2 * dk);
        const bf16 x = xrow[ch];
        xs[t] = gdn_conv_channel(ring, conv_w, bf2f(x), first, ch, c, K);
        if (t >= 2 * dk ? store_v : store_qk) ring[wr + ch] = x;
    }
    __syncthreads();

    // Σq², Σk², Σq·k over the block.
    float sq = 0.0f, sk = 0.0f, sqk = 0.0f;
#pragma unroll 1
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float qv = xs[i], kv = xs[dk + i];
        sq += qv * qv;
        sk += kv * kv;
        sqk += qv * kv;
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
    for (int w = 0; w < WARPS; ++w) {
        sq += sums[0][w];
        sk += sums[1][w];
        sqk += sums[2][w];
    }
    const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
    const float kq = sqk * rk * rq * q_scale;  // k·q of the normalised, scaled vectors
    const float g = -expf(A_log[h]) * softplus_f(a_in + dt_bias[h]);
    const float decay = expf(g);
    const float beta = sigmoid_f(b_in);

    for (int c0 = 0;;) {
        const int j0 = c0 + 4 * lane;
        // Partial Sᵀk and Sᵀq over this thread's rows.
        float mem[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sqp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < NR; ++n) {
            const int i = warp + WARPS * n;
            if (i >= dk) break;
            const float kn = xs[dk + i] * rk;
            const float qn = (xs[i] * rq) * q_scale;
            const float s[4] = {st[n].x, st[n].y, st[n].z, st[n].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                mem[e] += s[e] * kn;
                sqp[e] += s[e] * qn;
            }
        }
        *reinterpret_cast<float4*>(&part[0][warp][4 * lane]) = make_float4(mem[0], mem[1], mem[2], mem[3]);
        *reinterpret_cast<float4*>(&part[1][warp][4 * lane]) = make_float4(sqp[0], sqp[1], sqp[2], sqp[3]);
        __syncthreads();
        float delta[4];
        {
            const float4 m = gdn_sum_parts<WARPS>(part[0], lane);
            const float mm[4] = {m.x, m.y, m.z, m.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = j0 + e < dv ? xs[2 * dk + j0 + e] : 0.0f;
                delta[e] = (v - decay * mm[e]) * beta;
            }
        }
        if (warp == 0) {
            const float4 t = gdn_sum_parts<WARPS>(part[1], lane);
            const float tt[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (j0 + e < dv) os[j0 + e] = decay * tt[e] + delta[e] * kq;
        }
        // S ← S·decay + k⊗δ.
#pragma unroll
        for (int n = 0; n < NR; ++n) {
            const int i = warp + WARPS * n;
            if (i >= dk) break;
            const float kn = xs[dk + i] * rk;
            st[n].x = st[n].x * decay + kn * delta[0];
            st[n].y = st[n].y * decay + kn * delta[1];
            st[n].z = st[n].z * decay + kn * delta[2];
            st[n].w = st[n].w * decay + kn * delta[3];
        }
        gdn_store_tile<WARPS, NR, VEC>(st, S, c0, dk, dv);
        c0 += GDN_TILE;
        if (c0 >= dv) break;
        __syncthreads();  // every warp has read `part` before the next tile rewrites it
        gdn_load_tile<WARPS, NR, VEC>(st, S, c0, dk, dv);
    }
    __syncthreads();  // os complete

    // The gated RMSNorm over the head's dv values.
    float ss = 0.0f;
#pragma unroll 1
    for (int j = threadIdx.x; j < dv; j += blockDim.x) ss += os[j] * os[j];
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)dv + eps);
    const bf16* zr = z + ((size_t)b * hv + h) * dv;
#pragma unroll 1
    for (int j = threadIdx.x; j < dv; j += blockDim.x)
        orow[j] = f2bf((bf2f(norm_w[j]) * (os[j] * r)) * silu_f(bf2f(zr[j])));
}

// gdn_decode_impl with its state tiles' 16-byte path where dv % 4 == 0.
template <int WARPS, int NR>
__device__ __forceinline__ void gdn_decode_any(GDN_IMPL_PARAMS) {
    if ((dv & 3) == 0)
        gdn_decode_impl<WARPS, NR, true>(GDN_IMPL_PASS);
    else
        gdn_decode_impl<WARPS, NR, false>(GDN_IMPL_PASS);
}

// Grid (hv, B); block 32·WARPS threads (256 for gdn_decode_fused, 512 for gdn_decode_fused_dk256).
// qkv: [B, c] the token's projection rows [q | k | v] (q, k [hk, dk], v [hv, dv], c = 2·hk·dk +
// hv·dv); z: [B, hv·dv]; a, b_gate: [B, hv]; conv_w: [c, K]; A_log, dt_bias: [hv] f32; norm_w: [dv];
// sequence b at position positions[b] in slot slots[b] of conv_pool [num_slots, K, c] (the ring) and
// state_pool [num_slots, hv, dk, dv] (out of range: zero output, nothing touched); out: [B, hv·dv];
// q_scale = dk^-0.5 as the host rounds it. dv ≤ GDN_MAX_DV, hk divides hv; gdn_decode_fused takes
// dk ≤ 128, gdn_decode_fused_dk256 dk ≤ 256.
// The arguments after a and b_gate (the gates, read-only except in the _gates entries, which write them).
#define GDN_TAIL                                                                                              \
    const bf16 *__restrict__ conv_w, const float *__restrict__ A_log, const float *__restrict__ dt_bias,      \
        const bf16 *__restrict__ norm_w, bf16 *__restrict__ conv_pool, float *__restrict__ state_pool,        \
        const u32 *__restrict__ slots, const u32 *__restrict__ positions, bf16 *__restrict__ out, int hk,     \
        int hv, int dk, int dv, int K, float q_scale, float eps, u32 num_slots
#define GDN_ARGS                                                                                              \
    const bf16 *__restrict__ qkv, const bf16 *__restrict__ z, const bf16 *__restrict__ a,                     \
        const bf16 *__restrict__ b_gate, GDN_TAIL
#define GDN_GATES_ARGS                                                                                        \
    const bf16 *__restrict__ qkv, const bf16 *__restrict__ z, bf16 *a, bf16 *b_gate, GDN_TAIL,              \
        const bf16 *__restrict__ x, const bf16 *__restrict__ w_b, const bf16 *__restrict__ w_a, int k
#define GDN_REST conv_w, A_log, dt_bias, norm_w, conv_pool, state_pool, slots, positions, out, hk, hv, dk, dv, K, \
                 q_scale, eps, num_slots
// Whether the launch fits a 256-thread entry.
#define GDN_FITS (blockDim.x == 256 && dk <= 128 && dv <= GDN_MAX_DV && K >= 1 && hk >= 1 && hv % hk == 0)

extern "C" __global__ void __launch_bounds__(256) gdn_decode_fused(GDN_ARGS) {
    pdl_prologue();
    if (!GDN_FITS) return;
    const size_t ab = (size_t)blockIdx.y * hv + blockIdx.x;
    gdn_decode_any<8, 16>(qkv, z, bf2f(a[ab]), bf2f(b_gate[ab]), GDN_REST);
}

// gdn_decode_fused for one sequence (grid (hv, 1)) that first projects its own head's gates from the
// layer's normed row x [1, k]: b_gate[h] = W_b[h] · x and a[h] = W_a[h] · x (W_b, W_a [hv, k] bf16),
// written to b_gate and a ([1, hv])
// by gemv_impl with one row a block and 256 threads a row (rps = 1, tpr = 256), the cut gemv_bf16_m1
// takes for these rows (the host checks it): the same values as the GEMV launch it replaces. The block
// then reads them back (after a barrier: its own writes) from L2, not the read-only path.
__device__ __forceinline__ void gdn_decode_gates_body(GDN_GATES_ARGS) {
    if (gridDim.y != 1 || !GDN_FITS) return;
    // b, then a, through one copy of the GEMV's code; the barrier after each: its reduction buffer is
    // read before the next GEMV writes it, and this block's a[h], b_gate[h] are written.
#pragma unroll 1
    for (int gi = 0; gi < 2; ++gi) {
        gemv_impl<1, bf16>(gi == 0 ? w_b : w_a, x, gi == 0 ? b_gate : a, hv, k, 1, 8, blockIdx.x);
        __syncthreads();
    }
    gdn_decode_any<8, 16>(qkv, z, bf2f(__ldcg(a + blockIdx.x)), bf2f(__ldcg(b_gate + blockIdx.x)), GDN_REST);
}
extern "C" __global__ void __launch_bounds__(256) gdn_decode_fused_gates(GDN_GATES_ARGS) {
    pdl_prologue();
    gdn_decode_gates_body(qkv, z, a, b_gate, GDN_REST, x, w_b, w_a, k);
}

extern "C" __global__ void __launch_bounds__(512) gdn_decode_fused_dk256(GDN_ARGS) {
    pdl_prologue();
    if (blockDim.x != 512 || dk > GDN_MAX_DK || dv > GDN_MAX_DV || K < 1 || hk < 1 || hv % hk != 0) return;
    const size_t ab = (size_t)blockIdx.y * hv + blockIdx.x;
    gdn_decode_any<16, 16>(qkv, z, bf2f(a[ab]), bf2f(b_gate[ab]), GDN_REST);
}
#undef GDN_TAIL
#undef GDN_ARGS
#undef GDN_GATES_ARGS
#undef GDN_REST
#undef GDN_FITS
