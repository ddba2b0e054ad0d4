// Gated delta rule, chunked prefill of every sequence of a step in one launch; state f32, f32 arithmetic
// (CUDA-core FMAs). Same inputs, gates and normalisation as the decode step in gdn.cu: q and k
// l2-normalised (eps 1e-6) per head, q scaled by dk^-0.5, value head h reads key head h / (hv / hk),
// g = −exp(A_log[h]) · softplus(a + dt_bias[h]), β = sigmoid(b).
//
// The WY / UT-transform form of sanmai_cpu::ops::gdn_chunked, per chunk of C tokens with the in-chunk
// cumulative log decay G_i = Σ_{j≤i} g_j (summed in order, as the CPU):
//   A[i][j] = β_i (k_i·k_j) e^{G_i−G_j} (j < i),   P[i][j] = (q_i·k_j) e^{G_i−G_j} (j ≤ i),
//   v' = (I + A)⁻¹ · β(v − e^{G}·(K S))            (= U − W·S with U = (I+A)⁻¹βv, W = (I+A)⁻¹βe^{G}k),
//   o_i = e^{G_i} (q_i·S) + Σ_{j≤i} P[i][j] v'_j,
//   S ← e^{G_last} S + Σ_j k_j e^{G_last−G_j} ⊗ v'_j.
// Value columns of S evolve independently given k, so a block owns one (sequence, value head, 32 value
// columns) and recomputes the key-only parts (A, P) itself: at batch 1 the heads × column slices fill
// the device. A tail chunk shorter than C is zero-padded in shared memory (k = v = β = g = 0 rows add
// nothing), so every loop runs over whole chunks.
#include "common.cuh"

#define GDN_CHUNK_THREADS 256
#define GDN_CHUNK_WARPS (GDN_CHUNK_THREADS / 32)
// Value columns per block: one per lane.
#define GDN_CHUNK_COLS 32

// Four-term dot product, accumulated in order onto acc.
__device__ __forceinline__ float dot4(float acc, float4 x, float4 y) {
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
    acc = fmaf(x.z, y.z, acc);
    return fmaf(x.w, y.w, acc);
}

// One block: sequence blockIdx.z, value head blockIdx.x, value columns 32·blockIdx.y … + 31. C: chunk
// length (a multiple of 16, at most 32); R: state rows per thread, dk rounded up to 4 must be ≤ 8R.
// Shared memory (floats; dk4 = dk rounded up to 4, kstr = dk4 + 4 keeps float4 rows aligned and spreads
// the rows of a quarter-warp's float4 loads over distinct banks): Ks, Qs [C][kstr] (normalised k, scaled
// q; zero beyond the chunk and in columns dk … dk4), Ss [dk4][32] (the block's state columns, zero rows
// dk … dk4), As, Ps [C][C], Xs [C][32] (v, then β(v − e^G·KS), then v'), Gs, Bs, Es [C].
template <int C, int R>
__device__ __forceinline__ void gdn_chunk_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                               const bf16* __restrict__ v, long long qkv_stride,
                                               const bf16* __restrict__ a, const bf16* __restrict__ b_gate,
                                               long long ab_stride, const float* __restrict__ A_log,
                                               const float* __restrict__ dt_bias, float* __restrict__ state_pool,
                                               const u32* __restrict__ starts, const u32* __restrict__ lens,
                                               const u32* __restrict__ slots, bf16* __restrict__ out, int rows,
                                               int hk, int hv, int dk, int dv, float q_scale, u32 num_slots) {
    constexpr int NC = GDN_CHUNK_COLS, W = GDN_CHUNK_WARPS;
    constexpr int RPW = C / W;  // chunk rows per warp (token loads, K·S and Q·S, outputs)
    constexpr int TP = C / 16;  // A and P: a 16 × 16 thread grid, TP × TP entries per thread
    constexpr int NQ = R / 4;   // q / k values per lane of one token (32·NQ = 8R ≥ dk4)
    constexpr int NG = R / 4;   // groups of 4 state rows per thread in the state update
    extern __shared__ __align__(16) float smem[];

    const int h = blockIdx.x, seq = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j0 = blockIdx.y * NC;  // the block's first value column
    const int col = j0 + lane;       // this lane's value column
    const bool has_col = col < dv;
    const int dk4 = (dk + 3) & ~3, kstr = dk4 + 4;
    if (blockDim.x != GDN_CHUNK_THREADS || dk4 > 8 * R) return;
    const int kh = h / (hv / hk);

    // The sequence's rows, clamped to the step's rows.
    const u32 s0 = starts[seq];
    const int n = s0 < (u32)rows ? (int)min(lens[seq], (u32)rows - s0) : 0;
    if (n == 0) return;
    const u32 slot = slots[seq];
    if (slot >= num_slots) {  // a bad slot id: zeros, no state touched
        if (has_col)
            for (int i = warp; i < n; i += W) out[((size_t)(s0 + i) * hv + h) * dv + col] = f2bf(0.0f);
        return;
    }

    float* Ks = smem;
    float* Qs = Ks + C * kstr;
    float* Ss = Qs + C * kstr;
    float* As = Ss + dk4 * NC;
    float* Ps = As + C * C;
    float* Xs = Ps + C * C;
    float* Gs = Xs + C * NC;
    float* Bs = Gs + C;
    float* Es = Bs + C;

    float* S = state_pool + ((size_t)slot * hv + h) * (size_t)dk * dv;
    for (int idx = threadIdx.x; idx < dk4 * NC; idx += GDN_CHUNK_THREADS) {
        const int r = idx / NC, c = idx % NC;
        Ss[idx] = (r < dk && j0 + c < dv) ? S[(size_t)r * dv + j0 + c] : 0.0f;
    }
    const float neg_a = -expf(A_log[h]), bias = dt_bias[h];

    for (int c0 = 0; c0 < n; c0 += C) {
        const int L = min(C, n - c0);
        const long long row0 = (long long)s0 + c0;

        // Phase 1: the chunk's q, k (one warp per token, normalised) and v into shared memory; the gates
        // and the cumulative decay (warp 0).
#pragma unroll
        for (int u = 0; u < RPW; ++u) {
            const int i = warp + W * u;
            const bool live = i < L;
            const long long off = (row0 + i) * qkv_stride;
            float qv[NQ], kv[NQ];
            float sq = 0.0f, sk = 0.0f;
#pragma unroll
            for (int m = 0; m < NQ; ++m) {
                const int e = lane + 32 * m;
                qv[m] = (live && e < dk) ? bf2f(q[off + (size_t)kh * dk + e]) : 0.0f;
                kv[m] = (live && e < dk) ? bf2f(k[off + (size_t)kh * dk + e]) : 0.0f;
                sq += qv[m] * qv[m];
                sk += kv[m] * kv[m];
            }
            sq = warp_sum(sq);
            sk = warp_sum(sk);
            const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
#pragma unroll
            for (int m = 0; m < NQ; ++m) {
                const int e = lane + 32 * m;
                if (e < dk4) {
                    Qs[i * kstr + e] = (qv[m] * rq) * q_scale;
                    Ks[i * kstr + e] = kv[m] * rk;
                }
            }
            Xs[i * NC + lane] = (live && has_col) ? bf2f(v[off + (size_t)h * dv + col]) : 0.0f;
        }
        if (warp == 0) {
            float gl = 0.0f, bl = 0.0f;
            if (lane < L) {
                const long long r = (row0 + lane) * ab_stride + h;
                gl = neg_a * softplus_f(bf2f(a[r]) + bias);
                bl = sigmoid_f(bf2f(b_gate[r]));
            }
            // Prefix sum in token order (each lane adds the first lane + 1 values one by one).
            float cum = 0.0f;
#pragma unroll
            for (int j = 0; j < C; ++j) {
                const float gj = __shfl_sync(0xffffffffu, gl, j);
                if (j <= lane) cum = j == 0 ? gj : cum + gj;
            }
            if (lane < C) {
                Gs[lane] = cum;
                Bs[lane] = bl;
            }
        }
        __syncthreads();

        // Phase 2a: A and P. Thread (ti, tj) owns rows ti + 16u and columns tj + 16v.
        {
            const int ti = threadIdx.x >> 4, tj = threadIdx.x & 15;
            float kk[TP][TP], qk[TP][TP];
#pragma unroll
            for (int u = 0; u < TP; ++u)
#pragma unroll
                for (int w = 0; w < TP; ++w) kk[u][w] = qk[u][w] = 0.0f;
            for (int e = 0; e < dk4; e += 4) {
                float4 ki[TP], qi[TP], kj[TP];
#pragma unroll
                for (int u = 0; u < TP; ++u) {
                    ki[u] = *reinterpret_cast<const float4*>(&Ks[(ti + 16 * u) * kstr + e]);
                    qi[u] = *reinterpret_cast<const float4*>(&Qs[(ti + 16 * u) * kstr + e]);
                    kj[u] = *reinterpret_cast<const float4*>(&Ks[(tj + 16 * u) * kstr + e]);
                }
#pragma unroll
                for (int u = 0; u < TP; ++u)
#pragma unroll
                    for (int w = 0; w < TP; ++w) {
                        kk[u][w] = dot4(kk[u][w], ki[u], kj[w]);
                        qk[u][w] = dot4(qk[u][w], qi[u], kj[w]);
                    }
            }
#pragma unroll
            for (int u = 0; u < TP; ++u)
#pragma unroll
                for (int w = 0; w < TP; ++w) {
                    const int i = ti + 16 * u, j = tj + 16 * w;
                    const float d = j <= i ? expf(Gs[i] - Gs[j]) : 0.0f;
                    As[i * C + j] = j < i ? Bs[i] * kk[u][w] * d : 0.0f;
                    Ps[i * C + j] = qk[u][w] * d;
                }
        }
        // Phase 2b: K·S and Q·S of this warp's rows at this lane's column; the right-hand side
        // β(v − e^G·KS) replaces v. Q·S stays in registers for the output.
        float qs_acc[RPW];
        {
            float ks_acc[RPW];
#pragma unroll
            for (int u = 0; u < RPW; ++u) ks_acc[u] = qs_acc[u] = 0.0f;
            for (int e = 0; e < dk4; e += 4) {
                const float4 s = make_float4(Ss[e * NC + lane], Ss[(e + 1) * NC + lane], Ss[(e + 2) * NC + lane],
                                             Ss[(e + 3) * NC + lane]);
#pragma unroll
                for (int u = 0; u < RPW; ++u) {
                    const int i = warp + W * u;
                    ks_acc[u] = dot4(ks_acc[u], *reinterpret_cast<const float4*>(&Ks[i * kstr + e]), s);
                    qs_acc[u] = dot4(qs_acc[u], *reinterpret_cast<const float4*>(&Qs[i * kstr + e]), s);
                }
            }
#pragma unroll
            for (int u = 0; u < RPW; ++u) {
                const int i = warp + W * u;
                Xs[i * NC + lane] = Bs[i] * (Xs[i * NC + lane] - expf(Gs[i]) * ks_acc[u]);
            }
        }
        if (threadIdx.x < C) Es[threadIdx.x] = (int)threadIdx.x < L ? expf(Gs[L - 1] - Gs[threadIdx.x]) : 0.0f;
        __syncthreads();

        // Phase 3: v' = (I + A)⁻¹ · rhs by forward substitution, one lane per value column (warp 0):
        // x_i = rhs_i − Σ_{j<i} A[i][j] x_j.
        if (warp == 0) {
            float x[C];
#pragma unroll
            for (int i = 0; i < C; ++i) {
                if (i >= L) break;
                float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < i; ++j) p[j & 3] = fmaf(As[i * C + j], x[j], p[j & 3]);
                x[i] = Xs[i * NC + lane] - ((p[0] + p[1]) + (p[2] + p[3]));
                Xs[i * NC + lane] = x[i];
            }
        }
        __syncthreads();

        // Phase 4a: outputs o_i = e^{G_i}·(q_i·S) + Σ_{j≤i} P[i][j] v'_j.
#pragma unroll
        for (int u = 0; u < RPW; ++u) {
            const int i = warp + W * u;
            if (i < L) {
                float o = 0.0f;
                for (int j = 0; j <= i; ++j) o = fmaf(Ps[i * C + j], Xs[j * NC + lane], o);
                o = fmaf(expf(Gs[i]), qs_acc[u], o);
                if (has_col) out[((size_t)(row0 + i) * hv + h) * dv + col] = f2bf(o);
            }
        }
        // Phase 4b: S ← e^{G_last}·S + Σ_j k_j e^{G_last−G_j} ⊗ v'_j; thread rows 4g … 4g + 3 for the
        // groups g = warp + 8·m, column lane.
        {
            float4 upd[NG];
#pragma unroll
            for (int m = 0; m < NG; ++m) upd[m] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int j = 0; j < L; ++j) {
                const float wj = Es[j] * Xs[j * NC + lane];
#pragma unroll
                for (int m = 0; m < NG; ++m) {
                    const int e = 4 * (warp + W * m);
                    if (e < dk4) {
                        const float4 kf = *reinterpret_cast<const float4*>(&Ks[j * kstr + e]);
                        upd[m].x = fmaf(kf.x, wj, upd[m].x);
                        upd[m].y = fmaf(kf.y, wj, upd[m].y);
                        upd[m].z = fmaf(kf.z, wj, upd[m].z);
                        upd[m].w = fmaf(kf.w, wj, upd[m].w);
                    }
                }
            }
            const float decay = expf(Gs[L - 1]);
#pragma unroll
            for (int m = 0; m < NG; ++m) {
                const int e = 4 * (warp + W * m);
                if (e < dk4) {
                    float* sp = &Ss[e * NC + lane];
                    sp[0] = fmaf(sp[0], decay, upd[m].x);
                    sp[NC] = fmaf(sp[NC], decay, upd[m].y);
                    sp[2 * NC] = fmaf(sp[2 * NC], decay, upd[m].z);
                    sp[3 * NC] = fmaf(sp[3 * NC], decay, upd[m].w);
                }
            }
        }
        __syncthreads();  // the next chunk rewrites Ks, Qs, Xs, Gs and Bs; Ss is final after the last
    }

    for (int idx = threadIdx.x; idx < dk4 * NC; idx += GDN_CHUNK_THREADS) {
        const int r = idx / NC, c = idx % NC;
        if (r < dk && j0 + c < dv) S[(size_t)r * dv + j0 + c] = Ss[idx];
    }
}

// Grid (hv, ceil(dv / 32), n_seq); block GDN_CHUNK_THREADS threads; dynamic shared memory as
// gdn_chunk_impl lays it out (the host computes the same size). Sequence b owns rows starts[b] …
// starts[b] + lens[b] − 1 of the step (clamped to rows) and state slot slots[b] of state_pool
// [num_slots, hv, dk, dv], read at the start and written at the end (out of range: zero outputs,
// nothing touched). q, k, v: row r at q + r·qkv_stride (q, k [hk·dk], v [hv·dv] inside the conv
// output row); a, b_gate: [rows, hv] at stride ab_stride; out: [rows, hv·dv], rows of no sequence
// untouched; q_scale = dk^-0.5 as the host rounds it. gdn_chunk_prefill: chunks of 32 tokens, dk ≤ 128;
// gdn_chunk_prefill_dk256: chunks of 16, dk ≤ 256 (the same shared memory budget).
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS) gdn_chunk_prefill(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, long long qkv_stride,
    const bf16* __restrict__ a, const bf16* __restrict__ b_gate, long long ab_stride, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, float* __restrict__ state_pool, const u32* __restrict__ starts,
    const u32* __restrict__ lens, const u32* __restrict__ slots, bf16* __restrict__ out, int rows, int hk, int hv,
    int dk, int dv, float q_scale, u32 num_slots) {
    pdl_prologue();
    gdn_chunk_impl<32, 16>(q, k, v, qkv_stride, a, b_gate, ab_stride, A_log, dt_bias, state_pool, starts, lens, slots,
                           out, rows, hk, hv, dk, dv, q_scale, num_slots);
}
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS) gdn_chunk_prefill_dk256(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, long long qkv_stride,
    const bf16* __restrict__ a, const bf16* __restrict__ b_gate, long long ab_stride, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, float* __restrict__ state_pool, const u32* __restrict__ starts,
    const u32* __restrict__ lens, const u32* __restrict__ slots, bf16* __restrict__ out, int rows, int hk, int hv,
    int dk, int dv, float q_scale, u32 num_slots) {
    pdl_prologue();
    gdn_chunk_impl<16, 32>(q, k, v, qkv_stride, a, b_gate, ab_stride, A_log, dt_bias, state_pool, starts, lens, slots,
                           out, rows, hk, hv, dk, dv, q_scale, num_slots);
}
