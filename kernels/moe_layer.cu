// A MoE layer's one-token decode step in one persistent launch (moe_layer_m1_*), where the separate
// launches take six: the shared expert's gate|up and down GEMVs, the routing (router GEMV, top-k and
// grouping), the routed experts' gate|up and down grouped GEMVs, and the combine with the residual add
// and the next norm. Each of those is a few microseconds of ramp-up and drain around a small amount of
// work; here every block of one grid works through the phases, separated by grid-wide barriers:
//   1. the router logits (bf16 rows, the shared expert's gate as one more row) and the shared expert's
//      gate|up rows (packed), a warp a row over every warp of the grid (the prologue asks L2 for a
//      slice of the router while the kernel ahead finishes); each half-warp that computes shared
//      down rows in phase 2 asks for its first one before the barrier;
//   2. every block's first warp takes the softmax top-k of the logits (ml_topk_warp: the keys and tie
//      rule of router_topk_sort; block 0 writes the ids and weights out) and the chosen experts'
//      addresses (each asked for as soon as its rank is decided), while its other warps compute the shared expert's down rows (its SwiGLU taken where
//      it is read); then the chosen experts' gate and up rows (packed), a warp a row j of gate and
//      of up together, several rows' loads in flight, each rounded to bf16 as the grouped GEMV writes
//      them and their SwiGLU bf16(silu(gate) · up) written out as swiglu_bf16 computes it;
//   3. a warp takes one output row for every expert: it asks for the chosen experts' down rows (the
//      first round before barrier 2), then
//      the block copies the SwiGLU rows into shared memory, then the two half-warps each dot one
//      expert's down row at a time and the warp sums
//      Σ_c weight_c · y_c + sigmoid(gate) · shared, rounded once to bf16, and adds it to the residual
//      (rounded, as add_rms_norm_row) or writes it out;
//   4. with a residual: each block's sum of the rounded sums' squares, a third barrier, then every
//      block sums those in block order and writes the RMSNorm of its rows.
// The dots and the norm's sum run in another order than the separate launches', so the results match
// theirs to rounding, not bit for bit (deterministically: no float atomics); the parity suite checks
// them against the CPU.
//
// The grid barriers need every block resident at once: the launcher sizes the grid to what the
// multiprocessors hold (blocks_per_sm from the occupancy API, at most two a multiprocessor) and the
// launch is cooperative. Data a phase writes is read by other blocks only after a barrier and only
// through L2 (__ldcg), never the non-coherent read-only path.
//
// Counters: sync[0] counts the blocks through the barriers (barrier p waits for p · gridDim.x
// arrivals), sync[1] counts the blocks past their last barrier, the last of which resets both; both
// are 0 at launch and left 0 (the kernel ahead on the stream has finished before any block touches
// them: the PDL prologue waits for it).
#include "moe_layer.cuh"

// Units of 8 rows and one 128-value span a warp loads at once in ml_experts_gu_mma (a 16-byte run of
// one row a lane).
#define ML_MMA_UNITS 12

// Whether the one-row MoE launch takes its experts' gate|up on tensor cores: INT4 experts in groups of a
// multiple of 128, h a power of two from 128 to 2048 (the u2 entry points).
__device__ __forceinline__ bool ml_gu_mma(const MoeLayerArgs& a) {
    return (a.gu_group & 127) == 0 && a.h >= 128 && a.h <= 2048 && (a.h & (a.h - 1)) == 0;
}

// x's 16-byte chunks as the A operands of ml_experts_gu_mma's two mma.m16n8k16 a chunk (every row of A
// is x: only row 0 of the product is read): chunk c (values 8c .. 8c + 7) as the register quads
// ((x0, x4), (x0, x4), (x1, x5), (x1, x5)) and ((x2, x6), (x2, x6), (x3, x7), (x3, x7)), matching
// moe_q4_bf16x2's code pairs. Written while x is staged.
__device__ __forceinline__ void ml_x_pairs(uint4 v, uint4* out) {
    const u32 p04 = __byte_perm(v.x, v.z, 0x5410), p15 = __byte_perm(v.x, v.z, 0x7632);
    const u32 p26 = __byte_perm(v.y, v.w, 0x5410), p37 = __byte_perm(v.y, v.w, 0x7632);
    out[0] = make_uint4(p04, p04, p15, p15);
    out[1] = make_uint4(p26, p26, p37, p37);
}

// The experts' gate|up on tensor cores (phase 2, ml_gu_mma): an item is rows j0 .. j0 + 7 of expert slot
// c's gate and the same rows of its up, cut into units of one 128-value span of the 8 gate or the 8 up
// rows (item-major, then gate before up, then span). A block takes three items at a time, its warps
// consecutive runs of their units, ML_MMA_UNITS loads in flight a lane (the 16-byte run of values
// 32q .. 32q + 31 of row g of the unit). A unit is 8 mma.m16n8k16: the 8 rows as the B operand (the codes
// decoded exactly to bf16 pairs as moe_gemv_q4_mma_tile decodes them), x (xp: ml_x_pairs) as A; a span's
// f32 sums times the rows' group scale. Then each (item, gate or up, row)'s sum over the warps holding
// parts of it, in warp order (deterministic), each rounded to bf16, and their SwiGLU written out as the
// warp-a-row dots do. The sums run in another order than those dots', so the results match theirs to
// rounding.
__device__ __forceinline__ void ml_experts_gu_mma(const MoeLayerArgs& a, const uint4* xp, const u32* const* gw,
                                                  const float* const* gs) {
    __shared__ float red[ML_WARPS][2][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int ls = __ffs(a.h >> 7) - 1, spans = 1 << ls;  // spans a row, a power of two
    const int groups = a.inter >> 3, items = a.k * groups;
    const int block_units = 6 << ls;
    const int per_warp = (block_units + ML_WARPS - 1) / ML_WARPS;
    const int u0 = warp * per_warp, u1 = min(u0 + per_warp, block_units);
    const int k0 = u0 >> ls;  // the first (item, gate or up) of the warp's units
    const size_t wpr = (size_t)(a.h >> 3);
    const int scols = (a.h + a.gu_group - 1) / a.gu_group;
#pragma unroll 1
    for (int base = 3 * blockIdx.x; base < items; base += 3 * gridDim.x) {
        // Rows 2q and 2q + 1 of the warp's first (item, gate or up), then of its second.
        float acc00 = 0.0f, acc01 = 0.0f, acc10 = 0.0f, acc11 = 0.0f;
#pragma unroll 1
        for (int r0 = u0; r0 < u1; r0 += ML_MMA_UNITS) {
            uint4 w[ML_MMA_UNITS];
            float sc[ML_MMA_UNITS];  // lane (0, q): row 2q's scale, lane (1, q): row 2q + 1's
#pragma unroll
            for (int i = 0; i < ML_MMA_UNITS; ++i) {
                const int u = r0 + i, kk = u >> ls, it = base + (kk >> 1);
                if (u < u1 && it < items) {
                    const int sp = u & (spans - 1), c = it / groups;
                    const int row = (kk & 1) * a.inter + ((it - c * groups) << 3);
                    w[i] = __ldcs((const uint4*)(gw[c] + (size_t)(row + g) * wpr) + q + 4 * sp);
                    const float* S = gs[c] + (size_t)(row + 2 * q + (g & 1)) * scols + scale_group(sp << 7, a.h, a.gu_group);
                    sc[i] = g < 2 ? __ldg(S) : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < ML_MMA_UNITS; ++i) {
                const int u = r0 + i;
                if (u >= u1 || base + (u >> (ls + 1)) >= items) continue;
                const uint4* x = xp + 2 * (16 * (u & (spans - 1)) + 4 * q);
                float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const u32 wv[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const uint4 xa = x[2 * jj], xb = x[2 * jj + 1];
                    u32 pb[4];
                    moe_q4_bf16x2(wv[jj], pb);
                    moe_mma_bf16(t, xa.x, xa.y, xa.z, xa.w, pb[0], pb[1]);
                    moe_mma_bf16(t, xb.x, xb.y, xb.z, xb.w, pb[2], pb[3]);
                }
                // Lane (0, q): rows 2q and 2q + 1 of the unit in t[0], t[1]; row 2q + 1's scale from lane (1, q).
                const float s0 = sc[i], s1 = __shfl_down_sync(0xffffffffu, sc[i], 4);
                if ((u >> ls) == k0) {
                    acc00 = fmaf(s0, t[0], acc00);
                    acc01 = fmaf(s1, t[1], acc01);
                } else {
                    acc10 = fmaf(s0, t[0], acc10);
                    acc11 = fmaf(s1, t[1], acc11);
                }
            }
        }
        if (g == 0) {
            red[warp][0][2 * q] = acc00;
            red[warp][0][2 * q + 1] = acc01;
            red[warp][1][2 * q] = acc10;
            red[warp][1][2 * q + 1] = acc11;
        }
        __syncthreads();
        if (threadIdx.x < 24) {
            // Item i's row r: its gate's and its up's sums over the warps holding their units.
            const int i = threadIdx.x >> 3, r = threadIdx.x & 7, it = base + i;
            if (it < items) {
                float sum[2];
#pragma unroll
                for (int gu = 0; gu < 2; ++gu) {
                    const int kk = 2 * i + gu, lo = kk << ls, hi = lo + spans;  // the (item, gu)'s units
                    float v = 0.0f;
                    for (int w2 = 0; w2 < ML_WARPS; ++w2) {
                        const int a0 = w2 * per_warp, a1 = min(a0 + per_warp, block_units);
                        if (a0 < hi && a1 > lo) v += red[w2][kk - (a0 >> ls)][r];
                    }
                    sum[gu] = v;
                }
                const int c = it / groups, j = ((it - c * groups) << 3) + r;
                a.act[c * a.inter + j] = f2bf(silu_f(bf2f(f2bf(sum[0]))) * bf2f(f2bf(sum[1])));
            }
        }
        __syncthreads();
    }
}

template <int EB, int SB, int GU>
__device__ __forceinline__ void moe_layer_m1(const MoeLayerArgs& a) {
    extern __shared__ uint4 ml_smem[];
    __shared__ u32 s_ids[ML_MAX_K];
    __shared__ float s_wts[ML_MAX_K];
    __shared__ const u32* s_gw[2][ML_MAX_K];   // the chosen experts' gate|up and down words
    __shared__ const float* s_gs[2][ML_MAX_K]; // and scales
    __shared__ float s_res[ML_WARPS][ML_MAXROWS];
    __shared__ __align__(16) bf16 s_x[1024 * GU];      // x, chunks in ml_xs_chunk's order
    __shared__ uint4 s_xp[GU == 2 ? 512 : 1];          // x's chunks as ml_x_pairs (the tensor-core gate|up)
    __shared__ __align__(16) bf16 s_sact[32 * 16 * ML_DUNITS];  // the shared expert's SwiGLU row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * ML_WARPS + warp, nw = gridDim.x * ML_WARPS;
    const bool shared = a.shared_gate != nullptr;
    const bool norm = a.acc != nullptr;
    ml_mark(a.trace, 0);
    ml_prefetch_tables(a);
    ml_stage_x(s_x, a.x, a.h);
    if (EB == 4 && GU == 2 && ml_gu_mma(a))
        for (int c = threadIdx.x; c < (a.h >> 3); c += blockDim.x) ml_x_pairs(((const uint4*)a.x)[c], s_xp + 2 * c);
    __syncthreads();

    // 1. Router logits and the shared expert's gate|up rows.
    const int items1 = a.e + (shared ? 1 + 2 * a.si : 0);
#pragma unroll 1
    for (int i = gw; i < items1; i += nw) ml_phase1_item<SB, GU>(a, s_x, i, lane);
    MlRow<SB, ML_DUNITS> srow;
    if (warp > 0 && shared) ml_shared_first<SB>(a, srow, warp, lane);
    ml_mark(a.trace, 1);
    ml_grid_sync(a.sync, gridDim.x, ml_last(a.trace, 0));
    ml_mark(a.trace, 2);
    layer_ask_next(a.next);

    // 2. Top-k in every block's first warp (then the chosen experts' addresses), the shared expert's
    // down rows in the others; then the chosen experts' gate|up rows.
    if (warp == 0) {
        ml_topk_warp(a, a.logits, s_ids, s_wts, s_gw[0], s_gs[0], s_gw[1], s_gs[1]);
        __syncwarp();
        if (lane < a.k && blockIdx.x == 0) {
            a.ids[lane] = s_ids[lane];
            a.weights[lane] = s_wts[lane];
        }
    } else if (shared) {
        ml_shared_down<SB>(a, s_sact, srow, warp, lane);
    }
    __syncthreads();
    ml_mark(a.trace, 3);
    if (EB == 4 && GU == 2 && ml_gu_mma(a)) {
        ml_experts_gu_mma(a, s_xp, s_gw[0], s_gs[0]);
    } else {
        // An item is row j of expert slot c's gate and its row j of up: both dots, each rounded to
        // bf16 as the grouped GEMV writes them, then bf16(silu(gate) · up) as swiglu_bf16. Every load
        // of a warp's batch of items goes out before its first dot.
        constexpr int B = GU == 2 ? 3 : 2;
        const size_t wpr = (size_t)(a.h >> 5) * EB;
        const int scols = (a.h + a.gu_group - 1) / a.gu_group;
        const int items2 = a.k * a.inter;
#pragma unroll 1
        for (int i0 = gw; i0 < items2; i0 += B * nw) {
            MlRow<EB, GU> rows[2 * B];
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < items2) {
                    const int c = i / a.inter, j = i - c * a.inter;
#pragma unroll
                    for (int gu = 0; gu < 2; ++gu) {
                        const int r = j + gu * a.inter;
                        ml_load<EB, 32, GU>(rows[2 * b + gu], s_gw[0][c] + r * wpr, s_gs[0][c] + (size_t)r * scols, a.h,
                                            a.gu_group, lane);
                    }
                }
            }
            float d[2 * B];
            ml_dots<EB, 32, GU, true, 2 * B>(rows, s_x, a.h, lane, d);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < items2) {
                    const float g = warp_sum(d[2 * b]);
                    const float u = warp_sum(d[2 * b + 1]);
                    if (lane == 0) a.act[i] = f2bf(silu_f(bf2f(f2bf(g))) * bf2f(f2bf(u)));
                }
            }
        }
    }
    // 3. A warp an output row: its chosen experts' down rows are asked for first (before barrier 2:
    // no phase writes them), then the block copies the SwiGLU rows into shared memory, then the dots,
    // the combine and the residual add.
    bf16* act = reinterpret_cast<bf16*>(ml_smem);  // [k, inter]
    const int half = lane >> 4, sub = lane & 15;
    const size_t dwpr = (size_t)(a.inter >> 5) * EB;
    const int dscols = (a.inter + a.dn_group - 1) / a.dn_group;
    MlRow<EB, ML_DUNITS> rows[ML_ROUND];
    auto load_round = [&](int r, int c0) {
#pragma unroll
        for (int j = 0; j < ML_ROUND; ++j) {
            const int c = c0 + 2 * j + half;
            if (c < a.k) ml_load<EB, 16, ML_DUNITS>(rows[j], s_gw[1][c] + r * dwpr, s_gs[1][c] + (size_t)r * dscols, a.inter, a.dn_group, sub);
        }
    };
    if (gw < a.h) load_round(gw, 0);
    ml_mark(a.trace, 4);
    ml_grid_sync(a.sync, 2 * gridDim.x, ml_last(a.trace, 1));
    ml_mark(a.trace, 5);
    {
        // The SwiGLU rows (written by other blocks: through L2) into shared memory, four vectors a
        // thread in flight.
        const int vecs = (a.k * a.inter) >> 3;
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
    const float sw = shared ? sigmoid_f(__ldcg(a.logits + a.e)) : 0.0f;
    float sq = 0.0f;
#pragma unroll 1
    for (int j = 0; j < ML_MAXROWS; ++j) {
        const int r = gw + j * nw;
        if (r >= a.h) break;
        // Lane 0's operands of the row: the shared expert's sum, the residual.
        const float sd = shared && lane == 0 ? __ldcg(a.sdn + r) : 0.0f;
        const float res = norm && lane == 0 ? bf2f(a.acc[r]) : 0.0f;
        float routed = 0.0f;
#pragma unroll 1
        for (int c0 = 0; c0 < a.k; c0 += 2 * ML_ROUND) {
            if (j > 0 || c0 > 0) load_round(r, c0);
#pragma unroll
            for (int q = 0; q < ML_ROUND; ++q) {
                const int c = c0 + 2 * q + half;
                if (c < a.k)
                    routed = fmaf(s_wts[c], ml_dot<EB, 16, ML_DUNITS, false>(rows[q], act + (size_t)c * a.inter, a.inter, sub),
                                  routed);
            }
        }
        routed = warp_sum(routed);
        if (lane == 0) {
            const bf16 v = f2bf(routed + sw * sd);
            if (norm)
                sq += ml_add_row(a.acc, r, res, v, s_res[warp][j]);
            else
                a.y[r] = v;
        }
    }
    ml_mark(a.trace, 7);

    // 4. The norm: each block's sum of squares, a barrier, then every block sums them in block order
    // and writes its rows.
    if (norm) ml_norm_rows(sq, s_res, a.partials, a.sync, 3 * gridDim.x, a.h, a.eps, a.offset, a.norm_w, a.normed, gw, nw, ml_last(a.trace, 2));
    ml_mark(a.trace, 8);
    ml_finish(a.sync, a.trace);
}

// Entry points: routed experts of EB bits (INT4), the shared expert of SB bits (INT4, INT6, INT8), GU
// units of 32 values a lane in the h-wide dots (h ≤ 1024 · GU); one row. Grid: blocks_per_sm · multiprocessors
// blocks of ML_THREADS threads, launched cooperatively; dynamic shared memory 2 · k · inter bytes
// (rounded up to 16).
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s4_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 4, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s6_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 6, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s8_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 8, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s4_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 4, 3>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s6_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 6, 3>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s8_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 8, 3>(a); }
