// A MoE layer's one-token decode step in one persistent launch (moe_layer_m1_*), where the separate
// launches take six: the shared expert's gate|up and down GEMVs, the routing (router GEMV, top-k and
// grouping), the routed experts' gate|up and down grouped GEMVs, and the combine with the residual add
// and the next norm. Each of those is a few microseconds of ramp-up and drain around a small amount of
// work; here every block of one grid works through the phases, separated by grid-wide barriers:
//   1. the router logits (bf16 rows, the shared expert's gate as one more row) and the shared expert's
//      gate|up rows (packed), a warp a row over every warp of the grid;
//   2. every block takes the softmax top-k of the logits itself (router_topk_rows: the same keys, tie
//      rule and sums as router_topk_sort; block 0 writes the ids and weights out), then the chosen
//      experts' gate|up rows (packed), a warp a row, rounded to bf16 as the grouped GEMV writes them;
//   3. every block stages the SwiGLU of each chosen expert's and of the shared expert's gate|up rows in
//      shared memory (bf16(silu(gate) · up), as swiglu_bf16), then a warp takes one output row for
//      every expert: the two half-warps each dot one expert's down row at a time, and the warp sums
//      Σ_c weight_c · y_c + sigmoid(gate) · shared, rounded once to bf16, into the combined row;
//   4. the last block to finish adds the combined row to the residual and writes its RMSNorm
//      (add_rms_norm_row with this launch's 256 threads: add_rms_norm_bf16's bits for that row), when
//      the launch is given a residual, and resets the counters.
// The dots sum in another order than the separate launches (each lane's units, then the warp), so the
// results match theirs to rounding, not bit for bit; the parity suite checks them against the CPU.
//
// The grid barriers need every block resident at once: the launcher sizes the grid to what the
// multiprocessors hold (blocks_per_sm from the occupancy API, at most two a multiprocessor) and the
// launch is cooperative. Data a phase writes is read by other blocks only after a barrier and only
// through L2 (__ldcg), never the non-coherent read-only path.
//
// Counters: sync[0] counts the blocks through the barriers (phase p waits for p · gridDim.x arrivals),
// sync[1] is the last-block ticket; both are 0 at launch and left 0 (the kernel ahead on the stream has
// finished before any block touches them: the PDL prologue waits for it).
#include "add_norm.cuh"
#include "moe_route.cuh"
#include "packed.cuh"

#define ML_THREADS 256
#define ML_WARPS (ML_THREADS / 32)
// Most 16-byte chunks of a bf16 router row a lane holds (rows of at most 32 · 8 · ML_CHUNKS values).
#define ML_CHUNKS 12
// Most 32-value units of a packed row a lane takes in the full-warp dots (rows of ≤ 1024 · ML_UNITS
// values) and in the half-warp down dots (rows of ≤ 512 · ML_DUNITS values).
#define ML_UNITS 3
#define ML_DUNITS 2
// Most routed experts a token takes.
#define ML_MAX_K 16
// Down rows of routed experts a half-warp loads before it computes (ML_ROUND of them a round).
#define ML_ROUND 4

// The kernel's arguments (`MoeLayerArgs` in crates/cuda/src/ops/moe_layer.rs, field for field).
// Packed weights are words [n, k / 32 · BITS] u32 and scales [n, ceil(k / group)] f32 (group = k: one
// scale a row); the expert tables hold each expert's words and scales addresses.
struct MoeLayerArgs {
    const bf16* x;            // [h] the normed input row
    const bf16* router;       // [e, h]
    const bf16* shared_gate;  // [h] or null (then no shared expert)
    const u32* sgu_w;         // shared gate|up [2 si, h]
    const float* sgu_s;
    const u32* sdn_w;         // shared down [h, si]
    const float* sdn_s;
    const unsigned long long* gu_w;  // [e] expert gate|up [2 inter, h]
    const unsigned long long* gu_s;
    const unsigned long long* dn_w;  // [e] expert down [h, inter]
    const unsigned long long* dn_s;
    float* logits;            // [e + 1] scratch
    bf16* sgu;                // [2 si] scratch
    bf16* gu;                 // [k, 2 inter] scratch
    u32* ids;                 // [k]
    float* weights;           // [k]
    bf16* y;                  // [h] the combined row
    bf16* acc;                // [h] the residual, or null (no add and norm)
    const bf16* norm_w;       // [h]
    bf16* normed;             // [h]
    u32* sync;                // [2]
    int e, h, k, renorm, inter, si;
    int gu_group, dn_group, sgu_group, sdn_group;
    float eps, offset;
};

// A grid-wide barrier: every block's writes before it are visible to every block after it (through
// L2). `target`: the arrivals that complete this barrier (phase · gridDim.x).
__device__ __forceinline__ void ml_grid_sync(u32* count, u32 target) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        u32 seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
        } while (seen < target);
        __threadfence();
    }
    __syncthreads();
}

// One packed row's units a lane takes (units sub, sub + G, ... below MAXU · G) and their scales.
template <int BITS, int MAXU>
struct MlRow {
    u32 w[MAXU][PackedUnit<BITS, true>::WORDS];
    float s[MAXU];
};

template <int BITS, int G, int MAXU>
__device__ __forceinline__ void ml_load(MlRow<BITS, MAXU>& r, const u32* __restrict__ wr, const float* __restrict__ sr,
                                        int k, int group, int sub) {
    const int units = k >> 5;
#pragma unroll
    for (int i = 0; i < MAXU; ++i) {
        const int u = sub + i * G;
        if (u < units) {
            PackedUnit<BITS, true>::load(wr, u, r.w[i]);
            r.s[i] = __ldg(sr + scale_group(u << 5, k, group));
        }
    }
}

// The lane's part of row · x: per unit the codes' dot with x (f32), times the unit's scale. x: bf16,
// global memory written before this launch (XS false, read-only path) or shared memory (XS true).
template <int BITS, int G, int MAXU, bool XS>
__device__ __forceinline__ float ml_dot(const MlRow<BITS, MAXU>& r, const bf16* x, int k, int sub) {
    const int units = k >> 5;
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < MAXU; ++i) {
        const int u = sub + i * G;
        if (u < units) {
            float d = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float q[8], xf[8];
                decode8<BITS>(r.w[i], c, q);
                const uint4* xp = (const uint4*)(x + (u << 5) + 8 * c);
                unpack8(XS ? *xp : __ldg(xp), xf);
#pragma unroll
                for (int j = 0; j < 8; ++j) d = fmaf(q[j], xf[j], d);
            }
            acc = fmaf(d, r.s[i], acc);
        }
    }
    return acc;
}

// Phase 1, one item: router row i < e (+ the gate row at e), else shared gate|up row i - e - gate.
template <int SB>
__device__ __forceinline__ void ml_phase1_item(const MoeLayerArgs& a, int i, int lane) {
    const int gate_rows = a.shared_gate ? 1 : 0;
    if (i < a.e + gate_rows) {
        const uint4* wr = i < a.e ? (const uint4*)(a.router + (size_t)i * a.h) : (const uint4*)a.shared_gate;
        const uint4* x4 = (const uint4*)a.x;
        const int chunks = a.h >> 3;
        uint4 wv[ML_CHUNKS];
#pragma unroll
        for (int j = 0; j < ML_CHUNKS; ++j) {
            const int c = lane + 32 * j;
            if (c < chunks) wv[j] = __ldcs(wr + c);
        }
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < ML_CHUNKS; ++j) {
            const int c = lane + 32 * j;
            if (c < chunks) {
                float wf[8], xf[8];
                unpack8(wv[j], wf);
                unpack8(__ldg(x4 + c), xf);
#pragma unroll
                for (int q = 0; q < 8; ++q) s = fmaf(wf[q], xf[q], s);
            }
        }
        s = warp_sum(s);
        // The gate's logit rounded to bf16, as its own GEMV (a bf16 output) rounds it.
        if (lane == 0) a.logits[i] = i < a.e ? s : bf2f(f2bf(s));
    } else {
        const int r = i - a.e - gate_rows;
        const size_t wpr = (size_t)(a.h >> 5) * SB;
        const int scols = (a.h + a.sgu_group - 1) / a.sgu_group;
        MlRow<SB, ML_UNITS> row;
        ml_load<SB, 32, ML_UNITS>(row, a.sgu_w + r * wpr, a.sgu_s + (size_t)r * scols, a.h, a.sgu_group, lane);
        const float s = warp_sum(ml_dot<SB, 32, ML_UNITS, false>(row, a.x, a.h, lane));
        if (lane == 0) a.sgu[r] = f2bf(s);
    }
}

// bf16(silu(g) · u) of 8 values from a gate|up row written in this launch (through L2), as swiglu_bf16.
__device__ __forceinline__ uint4 ml_swiglu8(const bf16* gu_row, int inter, int v) {
    float gf[8], uf[8];
    unpack8(__ldcg((const uint4*)gu_row + v), gf);
    unpack8(__ldcg((const uint4*)(gu_row + inter) + v), uf);
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        o[i] = pack_bf16x2(silu_f(gf[2 * i]) * uf[2 * i], silu_f(gf[2 * i + 1]) * uf[2 * i + 1]);
    return make_uint4(o[0], o[1], o[2], o[3]);
}

template <int EB, int SB>
__device__ __forceinline__ void moe_layer_m1(const MoeLayerArgs& a) {
    extern __shared__ uint4 ml_smem[];
    __shared__ u32 s_ids[ML_MAX_K];
    __shared__ float s_wts[ML_MAX_K];
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * ML_WARPS + warp, nw = gridDim.x * ML_WARPS;
    const bool shared = a.shared_gate != nullptr;

    // 1. Router logits and the shared expert's gate|up rows.
    const int items1 = a.e + (shared ? 1 + 2 * a.si : 0);
#pragma unroll 1
    for (int i = gw; i < items1; i += nw) ml_phase1_item<SB>(a, i, lane);
    ml_grid_sync(a.sync, gridDim.x);

    // 2. Top-k in every block, then the chosen experts' gate|up rows.
    router_topk_rows(a.logits, 1, a.e, a.k, a.renorm, s_ids, s_wts, nullptr,
                     *reinterpret_cast<RouterSortSmem*>(ml_smem));
    if (blockIdx.x == 0 && threadIdx.x < a.k) {
        a.ids[threadIdx.x] = s_ids[threadIdx.x];
        a.weights[threadIdx.x] = s_wts[threadIdx.x];
    }
    {
        const int n2 = 2 * a.inter;
        const size_t wpr = (size_t)(a.h >> 5) * EB;
        const int scols = (a.h + a.gu_group - 1) / a.gu_group;
        const int items2 = a.k * n2;
        // Two rows a warp in flight: the second's loads go out before the first's dot.
#pragma unroll 1
        for (int i = gw; i < items2; i += 2 * nw) {
            MlRow<EB, ML_UNITS> r0, r1;
            const int i1 = i + nw;
            {
                const int c = i / n2, r = i - c * n2;
                const u32 x = s_ids[c];
                ml_load<EB, 32, ML_UNITS>(r0, (const u32*)a.gu_w[x] + r * wpr, (const float*)a.gu_s[x] + (size_t)r * scols,
                                          a.h, a.gu_group, lane);
            }
            if (i1 < items2) {
                const int c = i1 / n2, r = i1 - c * n2;
                const u32 x = s_ids[c];
                ml_load<EB, 32, ML_UNITS>(r1, (const u32*)a.gu_w[x] + r * wpr, (const float*)a.gu_s[x] + (size_t)r * scols,
                                          a.h, a.gu_group, lane);
            }
            const float s0 = warp_sum(ml_dot<EB, 32, ML_UNITS, false>(r0, a.x, a.h, lane));
            if (lane == 0) a.gu[i] = f2bf(s0);
            if (i1 < items2) {
                const float s1 = warp_sum(ml_dot<EB, 32, ML_UNITS, false>(r1, a.x, a.h, lane));
                if (lane == 0) a.gu[i1] = f2bf(s1);
            }
        }
    }
    ml_grid_sync(a.sync, 2 * gridDim.x);

    // 3. The SwiGLU rows in shared memory, then the down rows and the combine, a warp an output row.
    bf16* act = reinterpret_cast<bf16*>(ml_smem);  // [k, inter], then the shared expert's [si]
    bf16* sact = act + (size_t)a.k * a.inter;
    {
        const int per = a.inter >> 3, sper = a.si >> 3;
        const int vecs = a.k * per + (shared ? sper : 0);
#pragma unroll 1
        for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
            if (v < a.k * per) {
                const int c = v / per, u = v - c * per;
                ((uint4*)act)[v] = ml_swiglu8(a.gu + (size_t)c * 2 * a.inter, a.inter, u);
            } else {
                const int u = v - a.k * per;
                ((uint4*)sact)[u] = ml_swiglu8(a.sgu, a.si, u);
            }
        }
    }
    __syncthreads();
    {
        const int half = lane >> 4, sub = lane & 15;
        const float sw = shared ? sigmoid_f(__ldcg(a.logits + a.e)) : 0.0f;
        const size_t wpr = (size_t)(a.inter >> 5) * EB, swpr = (size_t)(a.si >> 5) * SB;
        const int scols = (a.inter + a.dn_group - 1) / a.dn_group;
        const int sscols = (a.si + a.sdn_group - 1) / a.sdn_group;
#pragma unroll 1
        for (int r = gw; r < a.h; r += nw) {
            float routed = 0.0f, sh = 0.0f;
            // The shared expert's down row goes to the second half-warp, whose share of the routed
            // rows is the smaller one for an even k.
            const bool sown = shared && half == 1;
            MlRow<SB, ML_DUNITS> srow;
            if (sown) ml_load<SB, 16, ML_DUNITS>(srow, a.sdn_w + r * swpr, a.sdn_s + (size_t)r * sscols, a.si, a.sdn_group, sub);
#pragma unroll 1
            for (int c0 = 0; c0 < a.k; c0 += 2 * ML_ROUND) {
                MlRow<EB, ML_DUNITS> rows[ML_ROUND];
#pragma unroll
                for (int j = 0; j < ML_ROUND; ++j) {
                    const int c = c0 + 2 * j + half;
                    if (c < a.k) {
                        const u32 x = s_ids[c];
                        ml_load<EB, 16, ML_DUNITS>(rows[j], (const u32*)a.dn_w[x] + r * wpr,
                                                   (const float*)a.dn_s[x] + (size_t)r * scols, a.inter, a.dn_group, sub);
                    }
                }
#pragma unroll
                for (int j = 0; j < ML_ROUND; ++j) {
                    const int c = c0 + 2 * j + half;
                    if (c < a.k)
                        routed = fmaf(s_wts[c], ml_dot<EB, 16, ML_DUNITS, true>(rows[j], act + (size_t)c * a.inter, a.inter, sub),
                                      routed);
                }
            }
            if (sown) sh = ml_dot<SB, 16, ML_DUNITS, true>(srow, sact, a.si, sub);
            routed = warp_sum(routed);
            sh = warp_sum(sh);
            if (lane == 0) a.y[r] = f2bf(routed + sw * sh);
        }
    }

    // 4. The residual add and the norm in the last block; the counters back to 0.
    if (!last_block_to_arrive(a.sync + 1, gridDim.x)) return;
    if (a.acc != nullptr) {
        unsigned short* row = reinterpret_cast<unsigned short*>(ml_smem);
        const unsigned short* y16 = reinterpret_cast<const unsigned short*>(a.y);
        for (int i = threadIdx.x; i < a.h; i += blockDim.x) row[i] = __ldcg(y16 + i);
        __syncthreads();
        add_rms_norm_row(a.acc, reinterpret_cast<const bf16*>(row), a.norm_w, a.normed, a.h, a.eps, a.offset, scratch);
    }
    if (threadIdx.x == 0) {
        a.sync[0] = 0u;
        a.sync[1] = 0u;
    }
}

// Entry points: routed experts of EB bits (INT4), the shared expert of SB bits (INT4, INT6, INT8).
// Grid: blocks_per_sm · multiprocessors blocks of ML_THREADS threads, launched cooperatively; dynamic
// shared memory: max(sizeof(RouterSortSmem), 2 · (k · inter + si), 2 · h) bytes, rounded up to 16.
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s4(const MoeLayerArgs a) { pdl_prologue(); moe_layer_m1<4, 4>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s6(const MoeLayerArgs a) { pdl_prologue(); moe_layer_m1<4, 6>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s8(const MoeLayerArgs a) { pdl_prologue(); moe_layer_m1<4, 8>(a); }
