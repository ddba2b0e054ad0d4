// A MoE layer's one-token decode step in one persistent launch (moe_layer_m1_*), where the separate
// launches take six: the shared expert's gate|up and down GEMVs, the routing (router GEMV, top-k and
// grouping), the routed experts' gate|up and down grouped GEMVs, and the combine with the residual add
// and the next norm. Each of those is a few microseconds of ramp-up and drain around a small amount of
// work; here every block of one grid works through the phases, separated by grid-wide barriers:
//   1. the router logits (bf16 rows, the shared expert's gate as one more row) and the shared expert's
//      gate|up rows (packed), a warp a row over every warp of the grid (the prologue asks L2 for a
//      slice of the router while the kernel ahead finishes); each half-warp that computes shared
//      down rows in phase 2 asks for its first one before the barrier;
//   2. every block computes the softmax keys of the logits (ml_topk_keys: the keys and tie rule of
//      router_topk_sort), then its first warp takes their top-k (ml_topk_warp; block 0 writes the ids
//      and weights out) and the chosen experts' addresses, while its other warps compute the shared
//      expert's down rows (its SwiGLU taken where it is read); then the chosen experts' gate and up rows (packed), a warp a row j of gate and
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
#include "layer.cuh"
#include "moe_route.cuh"  // router_key

// Most 32-value units of a packed row a lane takes in the half-warp down dots (rows of ≤ 512 ·
// ML_DUNITS values); the h-wide dots take GU units (a template parameter) and the router's bf16 rows
// 4 · GU chunks of 8 values.
#define ML_DUNITS 2
// Most routed experts a token takes, and experts a lane of the top-k holds (e ≤ 32 · ML_TOPK_PER).
#define ML_MAX_K 16
#define ML_TOPK_PER 16
// Down rows of routed experts a half-warp loads before it computes (ML_ROUND of them a round).
#define ML_ROUND 5

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
    bf16* act;                // [k, inter] scratch: the chosen experts' SwiGLU rows
    u32* ids;                 // [k]
    float* weights;           // [k]
    float* sdn;               // [h] scratch: the shared expert's down row
    float* partials;          // [gridDim.x] scratch: each block's sum of squares (with acc)
    bf16* y;                  // [h] the combined row (without acc)
    bf16* acc;                // [h] the residual, or null (no add and norm)
    const bf16* norm_w;       // [h]
    bf16* normed;             // [h]
    u32* sync;                // [2]
    int e, h, k, renorm, inter, si;
    int gu_group, dn_group, sgu_group, sdn_group;
    float eps, offset;
    unsigned long long* trace;  // [16] or null: block 0's phase times (globaltimer, ns), for the bench
};

// Phase 1, one item: router row i < e (+ the gate row at e), else shared gate|up row i - e - gate.
template <int SB, int GU>
__device__ __forceinline__ void ml_phase1_item(const MoeLayerArgs& a, const bf16* xs, int i, int lane) {
    const int gate_rows = a.shared_gate ? 1 : 0;
    if (i < a.e + gate_rows) {
        const uint4* wr = i < a.e ? (const uint4*)(a.router + (size_t)i * a.h) : (const uint4*)a.shared_gate;
        const uint4* x4 = (const uint4*)xs;
        const int chunks = a.h >> 3;
        uint4 wv[4 * GU];
#pragma unroll
        for (int j = 0; j < 4 * GU; ++j) {
            const int c = lane + 32 * j;
            if (c < chunks) wv[j] = __ldcs(wr + c);
        }
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 4 * GU; ++j) {
            const int c = lane + 32 * j;
            if (c < chunks) {
                float wf[8], xf[8];
                unpack8(wv[j], wf);
                unpack8(x4[ml_xs_chunk(c)], xf);
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
        MlRow<SB, GU> row;
        ml_load<SB, 32, GU>(row, a.sgu_w + r * wpr, a.sgu_s + (size_t)r * scols, a.h, a.sgu_group, lane);
        const float s = warp_sum(ml_dot<SB, 32, GU, true>(row, xs, a.h, lane));
        if (lane == 0) a.sgu[r] = f2bf(s);
    }
}

// The softmax keys of the e ≤ 32 · ML_TOPK_PER logits (written in this launch: read through L2) by the
// whole block, into keys (shared memory, [32 · ML_TOPK_PER]; 0 past e): p = exp(x - max) / sum, each
// candidate's key router_key(p, id) (larger probability first, the lower id among equal ones). The sum
// is a warp's: lane i adds experts i, i + 32, ... in turn, then the lanes' sums are added across the
// warp. ex: shared memory, [32 · ML_TOPK_PER]; scratch: block_reduce's. Every thread calls it; it ends
// with a barrier.
__device__ __forceinline__ void ml_topk_keys(const MoeLayerArgs& a, float* ex, unsigned long long* keys,
                                             float* scratch) {
    constexpr int PER = 32 * ML_TOPK_PER / ML_THREADS;
    const int e = a.e, lane = threadIdx.x & 31;
    float x[PER];
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = threadIdx.x + ML_THREADS * j;
        x[j] = i < e ? __ldcg(a.logits + i) : NEG_INF;
        m = fmaxf(m, x[j]);
    }
    m = block_max(m, scratch);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = threadIdx.x + ML_THREADS * j;
        ex[i] = i < e ? expf(x[j] - m) : 0.0f;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < ML_TOPK_PER; ++j) s += ex[lane + 32 * j];
        s = warp_sum(s);
        if (lane == 0) scratch[0] = s;
    }
    __syncthreads();
    const float s = scratch[0];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = threadIdx.x + ML_THREADS * j;
        keys[i] = i < e ? router_key(ex[i] / s, (u32)i) : 0ull;
    }
    __syncthreads();
}

// The top-k of the keys (ml_topk_keys) by one warp, into ids and wts (shared memory, [k]): lane i holds
// experts i, i + 32, ...; each lane's candidates sorted by key, then k rounds of a warp-wide arg-max over
// the lanes' heads (two redux operations: the largest probability, then the lowest id holding it), lane
// r keeping rank r, and then the chosen experts' addresses (each lane its rank's, all in flight at
// once); with renorm the kept probabilities are divided by their sum taken in rank order (as
// router_topk_rows).
__device__ __forceinline__ void ml_topk_warp(const MoeLayerArgs& a, const unsigned long long* keys, u32* ids, float* wts,
                                             const u32* (*gw)[ML_MAX_K], const float* (*gs)[ML_MAX_K]) {
    const int k = a.k, renorm = a.renorm;
    const int lane = threadIdx.x & 31;
    // Each candidate's key, 0 once taken (and for the slots past e).
    unsigned long long key[ML_TOPK_PER];
#pragma unroll
    for (int j = 0; j < ML_TOPK_PER; ++j) key[j] = keys[lane + 32 * j];
    // The lane's candidates sorted once, largest key first (a bitonic network over registers), so a
    // round compares only the lanes' heads and the winner's list moves up by one.
#pragma unroll
    for (int kk = 2; kk <= ML_TOPK_PER; kk <<= 1)
#pragma unroll
        for (int jj = kk >> 1; jj > 0; jj >>= 1)
#pragma unroll
            for (int i = 0; i < ML_TOPK_PER; ++i) {
                const int l = i ^ jj;
                if (l > i) {
                    const unsigned long long x = key[i], y = key[l];
                    const bool sw = (i & kk) == 0 ? x < y : x > y;
                    key[i] = sw ? y : x;
                    key[l] = sw ? x : y;
                }
            }
    u32 my_id = 0xffffffffu;
    float my_p = 0.0f;
#pragma unroll 1
    for (int r = 0; r < k; ++r) {
        // The lane's best key (its list's head), then the warp's: the largest probability bits, and
        // among the lanes that hold it the lowest id.
        const unsigned long long best = key[0];
        const u32 hi = (u32)(best >> 32);
        const u32 top = __reduce_max_sync(0xffffffffu, hi);
        const u32 id = __reduce_min_sync(0xffffffffu, hi == top ? ~(u32)best : 0xffffffffu);
        // The owner's list moves up past the winner (keys of distinct experts differ: one owner).
        if (best != 0ull && ~(u32)best == id && hi == top) {
#pragma unroll
            for (int j = 0; j + 1 < ML_TOPK_PER; ++j) key[j] = key[j + 1];
            key[ML_TOPK_PER - 1] = 0ull;
        }
        if (lane == r) {
            my_id = id;
            my_p = __uint_as_float(top);
        }
    }
    float total = 0.0f;
#pragma unroll 1
    for (int r = 0; r < k; ++r) total += __shfl_sync(0xffffffffu, my_p, r);
    if (lane < k) {
        ids[lane] = my_id;
        wts[lane] = renorm ? my_p / total : my_p;
        gw[0][lane] = (const u32*)a.gu_w[my_id];
        gs[0][lane] = (const float*)a.gu_s[my_id];
        gw[1][lane] = (const u32*)a.dn_w[my_id];
        gs[1][lane] = (const float*)a.dn_s[my_id];
    }
}

// bf16(silu(g) · u) of 8 gate values g and up values u, as swiglu_bf16.
__device__ __forceinline__ uint4 ml_swiglu8(uint4 g, uint4 u) {
    float gf[8], uf[8];
    unpack8(g, gf);
    unpack8(u, uf);
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        o[i] = pack_bf16x2(silu_f(gf[2 * i]) * uf[2 * i], silu_f(gf[2 * i + 1]) * uf[2 * i + 1]);
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// Where chunk v of the SwiGLU rows (rc chunks a row, a multiple of 4) goes in shared memory: each row
// in ml_xs_chunk's order, so that the half-warp dots' lanes (64 bytes apart, four to a bank in chunk
// order) read eight different banks a quarter-warp.
__device__ __forceinline__ int ml_act_slot(int v, int rc) {
    const int q = v % rc;
    return v - q + ml_xs_chunk(q);
}

// The shared expert's down rows (phase 2, by warps 1.. of every block while warp 0 takes the top-k):
// a half-warp a row, x = bf16(silu(gate) · up) of the shared gate|up row (written in this launch:
// through L2), staged in sact (shared memory, [si]) by these warps; f32 sums into a.sdn.
// The half-warp's first shared down row (ml_shared_down's hw), loaded into row.
template <int SB>
__device__ __forceinline__ void ml_shared_first(const MoeLayerArgs& a, MlRow<SB, ML_DUNITS>& row, int warp, int lane) {
    const int half = lane >> 4, sub = lane & 15;
    const int hw = (blockIdx.x * (ML_WARPS - 1) + warp - 1) * 2 + half;
    const size_t swpr = (size_t)(a.si >> 5) * SB;
    const int sscols = (a.si + a.sdn_group - 1) / a.sdn_group;
    if (hw < a.h) ml_load<SB, 16, ML_DUNITS>(row, a.sdn_w + hw * swpr, a.sdn_s + (size_t)hw * sscols, a.si, a.sdn_group, sub);
}

// row: the half-warp's first row (ml_shared_first, asked for before barrier 1: no phase writes the
// weights); the SwiGLU row is staged by these warps' threads, then their own barrier (warp 0 is taking
// the top-k).
template <int SB>
__device__ __forceinline__ void ml_shared_down(const MoeLayerArgs& a, bf16* sact, MlRow<SB, ML_DUNITS>& row, int warp,
                                               int lane) {
    const int half = lane >> 4, sub = lane & 15;
    const int hw = (blockIdx.x * (ML_WARPS - 1) + warp - 1) * 2 + half, nhw = gridDim.x * (ML_WARPS - 1) * 2;
    const size_t swpr = (size_t)(a.si >> 5) * SB;
    const int sscols = (a.si + a.sdn_group - 1) / a.sdn_group;
    const uint4* g4 = (const uint4*)a.sgu;
    const uint4* u4 = (const uint4*)(a.sgu + a.si);
#pragma unroll 1
    for (int v = threadIdx.x - 32; v < (a.si >> 3); v += blockDim.x - 32)
        ((uint4*)sact)[ml_xs_chunk(v)] = ml_swiglu8(__ldcg(g4 + v), __ldcg(u4 + v));
    asm volatile("bar.sync 1, %0;" ::"r"(blockDim.x - 32) : "memory");
#pragma unroll 1
    for (int r0 = hw - half; r0 < a.h; r0 += nhw) {
        const int r = r0 + half;  // both halves run the loop's shuffles
        if (r0 != hw - half && r < a.h)
            ml_load<SB, 16, ML_DUNITS>(row, a.sdn_w + r * swpr, a.sdn_s + (size_t)r * sscols, a.si, a.sdn_group, sub);
        float acc = r < a.h ? ml_dot<SB, 16, ML_DUNITS, true>(row, sact, a.si, sub) : 0.0f;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (r < a.h && sub == 0) a.sdn[r] = acc;
    }
}

// The experts' four address tables into L2, a 128-byte line a block (lines counted from the one
// holding a table's first entry, clipped to the table; lines past the grid's blocks are left to the
// top-k's loads): phase 2 reads the chosen experts' entries right after the top-k, where a miss to
// DRAM would wait before every expert's first weight load.
__device__ __forceinline__ void ml_prefetch_tables(const MoeLayerArgs& a) {
    const int lines = (a.e * 8 + 127) / 128 + 1;  // one more where a table does not start a line
    if ((int)blockIdx.x >= 4 * lines) return;
    const int which = blockIdx.x / lines, line = blockIdx.x - which * lines;
    const unsigned long long* t = which == 0 ? a.gu_w : which == 1 ? a.gu_s : which == 2 ? a.dn_w : a.dn_s;
    const unsigned long long p = (unsigned long long)t, start = (p & ~127ull) + 128ull * (unsigned long long)line;
    const unsigned long long lo = max(p, start), hi = min(p + 8ull * (unsigned long long)a.e, start + 128ull);
    if (lo < hi) l2_prefetch((const void*)lo, (long long)(hi - lo));
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
    __shared__ __align__(16) bf16 s_sact[32 * 16 * ML_DUNITS];  // the shared expert's SwiGLU row
    __shared__ float s_ex[32 * ML_TOPK_PER];                  // the router's exponentials
    __shared__ unsigned long long s_keys[32 * ML_TOPK_PER];   // and the top-k's keys
    __shared__ float s_scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * ML_WARPS + warp, nw = gridDim.x * ML_WARPS;
    const bool shared = a.shared_gate != nullptr;
    const bool norm = a.acc != nullptr;
    ml_mark(a.trace, 0);
    ml_prefetch_tables(a);
    ml_stage_x(s_x, a.x, a.h);
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

    // 2. Top-k in every block's first warp (then the chosen experts' addresses), the shared expert's
    // down rows in the others; then the chosen experts' gate|up rows.
    ml_topk_keys(a, s_ex, s_keys, s_scratch);
    if (warp == 0) {
        ml_topk_warp(a, s_keys, s_ids, s_wts, s_gw, s_gs);
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
    {
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
                if (v < vecs) ((uint4*)act)[ml_act_slot(v, a.inter >> 3)] = t[q];
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
                    routed = fmaf(s_wts[c], ml_dot<EB, 16, ML_DUNITS, true>(rows[q], act + (size_t)c * a.inter, a.inter, sub),
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

// The router rows of this block's share (a contiguous slice of the router, for the prologue's L2
// prefetch); the block's entry marked (ml_entered).
__device__ __forceinline__ RowSpan ml_router_span(const MoeLayerArgs& a) {
    ml_entered(a.trace);
    const long long bytes = (long long)a.e * a.h * 2;
    const long long per = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~15ll;
    const long long b0 = (long long)blockIdx.x * per;
    return RowSpan{(const char*)a.router + b0, b0 < bytes ? min(per, bytes - b0) : 0};
}

// Entry points: routed experts of EB bits (INT4), the shared expert of SB bits (INT4, INT6, INT8), GU
// units of 32 values a lane in the h-wide dots (h ≤ 1024 · GU). Grid: blocks_per_sm · multiprocessors
// blocks of ML_THREADS threads, launched cooperatively; dynamic shared memory 2 · k · inter bytes
// (rounded up to 16).
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s4_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 4, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s6_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 6, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s8_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 8, 2>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s4_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 4, 3>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s6_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 6, 3>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s8_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 8, 3>(a); }
