// The one-launch MoE layer's multi-row form (moe_layer_rows_*): 2 ≤ m ≤ ML_TOKENS rows (a decode step
// of m sequences), with the barriers and counters of the one-row form (moe_layer.cu).
#include "moe_layer.cuh"

// The same phases over every row, each routed pair (row t, choice c; p = t·k + c) taken as an expert
// of its own (pairs naming one expert read its rows twice, from L2 where the other's read left them):
//   1. a warp takes a router row (or the shared gate's, or a shared gate|up row) and dots it with
//      every row's x (x [m, h] in shared memory): logits [m, e + 1], the shared gate|up [m, 2·si];
//   2. warp t < m of every block takes row t's top-k; the block stages the shared expert's SwiGLU
//      rows [m, si]; then a half-warp a shared down row (dotted with every row's SwiGLU row: [m, h]
//      f32), then the pairs' gate|up items (pair p, row j) as the one-row form's;
//   3. an item is (row t, output value r): its k down rows, the SwiGLU rows of the m·k pairs staged
//      in shared memory (where x was), the combine, the residual add;
//   4. each block's per-row sums of squares (partials [m, gridDim.x]), a barrier, warp t sums row t's
//      in block order, and the norm of the block's items.
// Dynamic shared memory: 2 · max(m · (h + si), m · k · inter) bytes (rounded up to 16).
#define ML_TOKENS 8
// Most phase-3 items a warp takes (m · h ≤ ML_TITEMS · the grid's warps; the launcher checks).
#define ML_TITEMS 32

// Asks L2 for the units of a packed row that ml_load<BITS, G, MAXU> would load (and their scales).
template <int BITS, int G, int MAXU>
__device__ __forceinline__ void ml_ask_row(const u32* wr, const float* sr, int k, int group, int sub) {
    const int units = k >> 5;
#pragma unroll
    for (int i = 0; i < MAXU; ++i) {
        const int u = sub + i * G;
        if (u < units) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(wr + (size_t)u * PackedUnit<BITS, true>::WORDS));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(sr + scale_group(u << 5, k, group)));
        }
    }
}

// Phase 1 of the multi-row form, one item: router row i < e (+ the gate row at e), else shared
// gate|up row i - e - gate, dotted with each of the m rows of xs ([m, h], ml_xs_chunk's order).
template <int SB, int GU>
__device__ __forceinline__ void ml_rows_phase1_item(const MoeLayerArgs& a, const bf16* xs, int i, int lane) {
    const int gate_rows = a.shared_gate ? 1 : 0;
    const int m = a.m, h = a.h;
    if (i < a.e + gate_rows) {
        const uint4* wr = i < a.e ? (const uint4*)(a.router + (size_t)i * h) : (const uint4*)a.shared_gate;
        const int chunks = h >> 3;
        uint4 wv[4 * GU];
#pragma unroll
        for (int j = 0; j < 4 * GU; ++j) {
            const int c = lane + 32 * j;
            if (c < chunks) wv[j] = __ldcs(wr + c);
        }
        float s[ML_TOKENS];
#pragma unroll
        for (int t = 0; t < ML_TOKENS; ++t) s[t] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4 * GU; ++j) {
            const int c = lane + 32 * j;
            if (c < chunks) {
                float wf[8];
                unpack8(wv[j], wf);
#pragma unroll
                for (int t = 0; t < ML_TOKENS; ++t) {
                    if (t < m) {
                        float xf[8];
                        unpack8(((const uint4*)(xs + (size_t)t * h))[ml_xs_chunk(c)], xf);
#pragma unroll
                        for (int q = 0; q < 8; ++q) s[t] = fmaf(wf[q], xf[q], s[t]);
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < ML_TOKENS; ++t) {
            if (t < m) {
                const float v = warp_sum(s[t]);
                // The gate's logit rounded to bf16, as its own GEMV (a bf16 output) rounds it.
                if (lane == 0) a.logits[(size_t)t * (a.e + 1) + i] = i < a.e ? v : bf2f(f2bf(v));
            }
        }
    } else {
        const int r = i - a.e - gate_rows;
        const size_t wpr = (size_t)(h >> 5) * SB;
        const int scols = (h + a.sgu_group - 1) / a.sgu_group;
        MlRow<SB, GU> row;
        ml_load<SB, 32, GU>(row, a.sgu_w + r * wpr, a.sgu_s + (size_t)r * scols, h, a.sgu_group, lane);
#pragma unroll
        for (int t = 0; t < ML_TOKENS; ++t) {
            if (t < m) {
                const float v = warp_sum(ml_dot<SB, 32, GU, true>(row, xs + (size_t)t * h, h, lane));
                if (lane == 0) a.sgu[(size_t)t * 2 * a.si + r] = f2bf(v);
            }
        }
    }
}

template <int EB, int SB, int GU>
__device__ __forceinline__ void moe_layer_rows(const MoeLayerArgs& a) {
    extern __shared__ uint4 ml_smem[];
    __shared__ u32 s_ids[ML_TOKENS * ML_MAX_K];
    __shared__ float s_wts[ML_TOKENS * ML_MAX_K];
    __shared__ const u32* s_gw[2][ML_TOKENS * ML_MAX_K];   // pair p's gate|up and down words
    __shared__ const float* s_gs[2][ML_TOKENS * ML_MAX_K]; // and scales
    __shared__ float s_res[ML_WARPS][ML_TITEMS];
    __shared__ float s_sq[ML_WARPS][ML_TOKENS];
    __shared__ float s_row[ML_TOKENS];  // each row's shared gate (phase 3), then its 1 / rms (phase 4)
    const int m = a.m, h = a.h, k = a.k, si = a.si;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int half = lane >> 4, sub = lane & 15;
    const int gw = blockIdx.x * ML_WARPS + warp, nw = gridDim.x * ML_WARPS;
    const bool shared = a.shared_gate != nullptr;
    const bool norm = a.acc != nullptr;
    bf16* xs = reinterpret_cast<bf16*>(ml_smem);  // [m, h] (phases 1 and 2)
    bf16* sact = xs + (size_t)m * h;              // [m, si] (phase 2)
    bf16* act = reinterpret_cast<bf16*>(ml_smem); // [m · k, inter] (phase 3)
    ml_mark(a.trace, 0);
    ml_prefetch_tables(a);
    if (threadIdx.x < ML_WARPS * ML_TOKENS) (&s_sq[0][0])[threadIdx.x] = 0.0f;
    for (int t = 0; t < m; ++t) ml_stage_x(xs + (size_t)t * h, a.x + (size_t)t * h, h);
    __syncthreads();

    // 1. Router logits and the shared expert's gate|up rows, for every row.
    const int items1 = a.e + (shared ? 1 + 2 * si : 0);
#pragma unroll 1
    for (int i = gw; i < items1; i += nw) ml_rows_phase1_item<SB, GU>(a, xs, i, lane);
    // The half-warp's first shared down row (no phase writes the weights).
    const size_t swpr = (size_t)(si >> 5) * SB;
    const int sscols = shared ? (si + a.sdn_group - 1) / a.sdn_group : 0;
    MlRow<SB, ML_DUNITS> srow;
    if (shared && 2 * gw + half < h)
        ml_load<SB, 16, ML_DUNITS>(srow, a.sdn_w + (2 * gw + half) * swpr, a.sdn_s + (size_t)(2 * gw + half) * sscols, si,
                                   a.sdn_group, sub);
    ml_mark(a.trace, 1);
    ml_grid_sync(a.sync, gridDim.x, ml_last(a.trace, 0));
    ml_mark(a.trace, 2);
    layer_ask_next(a.next);

    // 2. Row t's top-k in warp t of every block, the shared expert's SwiGLU rows staged meanwhile.
    if (warp < m) {
        const int o = warp * k;
        ml_topk_warp(a, a.logits + (size_t)warp * (a.e + 1), s_ids + o, s_wts + o, s_gw[0] + o, s_gs[0] + o,
                     s_gw[1] + o, s_gs[1] + o);
        __syncwarp();
        if (lane < k && blockIdx.x == 0) {
            a.ids[o + lane] = s_ids[o + lane];
            a.weights[o + lane] = s_wts[o + lane];
        }
    }
    if (shared) {
        const int per = si >> 3;
#pragma unroll 1
        for (int v = threadIdx.x; v < m * per; v += blockDim.x) {
            const int t = v / per, u = v - t * per;
            const uint4* g4 = (const uint4*)(a.sgu + (size_t)t * 2 * si);
            ((uint4*)sact)[v] = ml_swiglu8(__ldcg(g4 + u), __ldcg(g4 + per + u));
        }
    }
    __syncthreads();
    ml_mark(a.trace, 3);
    // The shared expert's down rows, a half-warp a row, each dotted with every row's SwiGLU row.
    if (shared) {
#pragma unroll 1
        for (int r0 = 2 * gw; r0 < h; r0 += 2 * nw) {
            const int r = r0 + half;  // both halves run the shuffles
            if (r0 != 2 * gw && r < h)
                ml_load<SB, 16, ML_DUNITS>(srow, a.sdn_w + r * swpr, a.sdn_s + (size_t)r * sscols, si, a.sdn_group, sub);
#pragma unroll 1
            for (int t = 0; t < m; ++t) {
                float acc = r < h ? ml_dot<SB, 16, ML_DUNITS, false>(srow, sact + (size_t)t * si, si, sub) : 0.0f;
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                if (r < h && sub == 0) a.sdn[(size_t)t * h + r] = acc;
            }
        }
    }
    {
        // The pairs' gate|up items: pair p's row j of gate and of up, as the one-row form's.
        constexpr int B = GU == 2 ? 3 : 2;
        const size_t wpr = (size_t)(h >> 5) * EB;
        const int scols = (h + a.gu_group - 1) / a.gu_group;
        const int items2 = m * k * a.inter;
#pragma unroll 1
        for (int i0 = gw; i0 < items2; i0 += B * nw) {
            MlRow<EB, GU> rows[2 * B];
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < items2) {
                    const int p = i / a.inter, j = i - p * a.inter;
#pragma unroll
                    for (int gu = 0; gu < 2; ++gu) {
                        const int r = j + gu * a.inter;
                        ml_load<EB, 32, GU>(rows[2 * b + gu], s_gw[0][p] + r * wpr, s_gs[0][p] + (size_t)r * scols, h,
                                            a.gu_group, lane);
                    }
                }
            }
            if (a.ahead & 1) {
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const int i = i0 + (B + b) * nw;
                    if (i < items2) {
                        const int p = i / a.inter, j = i - p * a.inter;
#pragma unroll
                        for (int gu = 0; gu < 2; ++gu) {
                            const int r = j + gu * a.inter;
                            ml_ask_row<EB, 32, GU>(s_gw[0][p] + r * wpr, s_gs[0][p] + (size_t)r * scols, h, a.gu_group, lane);
                        }
                    }
                }
            }
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < items2) {
                    const bf16* x = xs + (size_t)(i / a.inter / k) * h;
                    const float g = warp_sum(ml_dot<EB, 32, GU, true>(rows[2 * b], x, h, lane));
                    const float u = warp_sum(ml_dot<EB, 32, GU, true>(rows[2 * b + 1], x, h, lane));
                    if (lane == 0) a.act[i] = f2bf(silu_f(bf2f(f2bf(g))) * bf2f(f2bf(u)));
                }
            }
        }
    }
    // 3. An item (row t, output value r): its pairs' down rows (the first item's asked for before
    // barrier 2), the pairs' SwiGLU rows staged in shared memory, the combine and the residual add.
    const int items3 = m * h;
    const size_t dwpr = (size_t)(a.inter >> 5) * EB;
    const int dscols = (a.inter + a.dn_group - 1) / a.dn_group;
    MlRow<EB, ML_DUNITS> rows[ML_ROUND];
    auto load_round = [&](int t, int r, int c0) {
#pragma unroll
        for (int j = 0; j < ML_ROUND; ++j) {
            const int c = c0 + 2 * j + half;
            if (c < k)
                ml_load<EB, 16, ML_DUNITS>(rows[j], s_gw[1][t * k + c] + r * dwpr, s_gs[1][t * k + c] + (size_t)r * dscols,
                                           a.inter, a.dn_group, sub);
        }
    };
    if (gw < items3) load_round(gw / h, gw % h, 0);
    ml_mark(a.trace, 4);
    ml_grid_sync(a.sync, 2 * gridDim.x, ml_last(a.trace, 1));
    ml_mark(a.trace, 5);
    if (threadIdx.x < m) s_row[threadIdx.x] = shared ? sigmoid_f(__ldcg(a.logits + (size_t)threadIdx.x * (a.e + 1) + a.e)) : 0.0f;
    {
        const int vecs = (m * k * a.inter) >> 3;
        const uint4* src = (const uint4*)a.act;
#pragma unroll 1
        for (int v0 = threadIdx.x; v0 < vecs; v0 += 4 * blockDim.x) {
            uint4 t[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int v = v0 + q * blockDim.x;
                if (v < vecs) t[q] = __ldcg(src + v);
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int v = v0 + q * blockDim.x;
                if (v < vecs) ((uint4*)act)[v] = t[q];
            }
        }
    }
    __syncthreads();
    ml_mark(a.trace, 6);
#pragma unroll 1
    for (int j = 0; j < ML_TITEMS; ++j) {
        const int i = gw + j * nw;
        if (i >= items3) break;
        const int t = i / h, r = i - t * h;
        // Lane 0's operands of the item: the shared expert's sum, the residual.
        const float sd = shared && lane == 0 ? __ldcg(a.sdn + i) : 0.0f;
        const float res = norm && lane == 0 ? bf2f(a.acc[i]) : 0.0f;
        float routed = 0.0f;
#pragma unroll 1
        for (int c0 = 0; c0 < k; c0 += 2 * ML_ROUND) {
            if (j > 0 || c0 > 0) load_round(t, r, c0);
            if ((a.ahead & 2) && c0 == 0 && i + nw < items3) {
                // The next item's down rows into L2 while this one's are dotted.
                const int tn = (i + nw) / h, rn = i + nw - tn * h;
                for (int c = half; c < k; c += 2)
                    ml_ask_row<EB, 16, ML_DUNITS>(s_gw[1][tn * k + c] + rn * dwpr, s_gs[1][tn * k + c] + (size_t)rn * dscols,
                                                  a.inter, a.dn_group, sub);
            }
#pragma unroll
            for (int q = 0; q < ML_ROUND; ++q) {
                const int c = c0 + 2 * q + half;
                if (c < k)
                    routed = fmaf(s_wts[t * k + c],
                                  ml_dot<EB, 16, ML_DUNITS, false>(rows[q], act + (size_t)(t * k + c) * a.inter, a.inter, sub),
                                  routed);
            }
        }
        routed = warp_sum(routed);
        if (lane == 0) {
            const bf16 v = f2bf(routed + s_row[t] * sd);
            if (norm)
                s_sq[warp][t] += ml_add_row(a.acc, i, res, v, s_res[warp][j]);
            else
                a.y[i] = v;
        }
    }
    ml_mark(a.trace, 7);

    // 4. The norm of every row: each block's sums of squares, a barrier, warp t sums row t's partials
    // in block order, then the block's items.
    if (norm) {
        __syncthreads();
        if (threadIdx.x < m) {
            float sq = 0.0f;
#pragma unroll
            for (int w = 0; w < ML_WARPS; ++w) sq += s_sq[w][threadIdx.x];
            a.partials[(size_t)threadIdx.x * gridDim.x + blockIdx.x] = sq;
        }
        ml_grid_sync(a.sync, 3 * gridDim.x, ml_last(a.trace, 2));
        if (warp < m) {
            float ss = 0.0f;
            for (int b = lane; b < (int)gridDim.x; b += 32) ss += __ldcg(a.partials + (size_t)warp * gridDim.x + b);
            ss = warp_sum(ss);
            if (lane == 0) s_row[warp] = 1.0f / sqrtf(ss / (float)h + a.eps);
        }
        __syncthreads();
        if (lane == 0) {
#pragma unroll 1
            for (int j = 0; j < ML_TITEMS; ++j) {
                const int i = gw + j * nw;
                if (i >= items3) break;
                const int t = i / h, r = i - t * h;
                a.normed[i] = f2bf((s_res[warp][j] * s_row[t]) * (a.offset + bf2f(a.norm_w[r])));
            }
        }
    }
    ml_mark(a.trace, 8);
    ml_finish(a.sync, a.trace);
}

// Entry points: routed experts of EB bits (INT4), the shared expert of SB bits (INT4, INT6, INT8), GU
// units of 32 values a lane in the h-wide dots (h ≤ 1024 · GU); m = a.m rows. Grid: blocks_per_sm ·
// multiprocessors blocks of ML_THREADS threads, launched cooperatively; dynamic shared memory as the
// opening comment says.
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_rows_q4_s4_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_rows<4, 4, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_rows_q4_s6_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_rows<4, 6, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_rows_q4_s8_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_rows<4, 8, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_rows_q4_s4_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_rows<4, 4, 3>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_rows_q4_s6_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_rows<4, 6, 3>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_rows_q4_s8_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_rows<4, 8, 3>(a); }
