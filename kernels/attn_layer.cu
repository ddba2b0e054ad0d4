// A gated-attention mixer's one-token decode step in one persistent launch (attn_layer_m1_*), where the
// separate launches take seven: the q|gate, k and v projections (one packed GEMV launch), the q and k
// head norms with RoPE (two), the K/V write, the paged split-K partial and reduce with the output gate,
// and o_proj with the residual add and the next norm (gemv_q*_m1_norm). Every block of one cooperative
// grid (as many as the multiprocessors hold, layer.cuh) works through four phases, separated by grid
// barriers:
//   1. the projections' rows, a warp a row, several rows' loads in flight a warp (x staged once a block
//      in shared memory), each rounded to bf16 as the projection launch writes them; meanwhile each block
//      asks for the first AL_STAGES − 1 K/V tiles of its phase-2 item (cached positions, which no phase
//      writes);
//   2. an item is one KV head's span of AL_TILE-position tiles (the context split over the grid): each
//      warp takes one query head of the KV head's group (two in the wide instance), its q normed
//      (1 + w), roped and rounded to bf16 as qk_norm_rope_bf16 writes it (the norm weights and the
//      rotation's cos and sin read once a block before barrier 1); per tile the scores (a warp_sum a position), an online softmax
//      and Σ e·v (lane: 8 of the head's d = 256 values); the tiles stream through a cp.async ring
//      (AL_STAGES tiles). The item holding the new position norms and ropes its k (the last warp),
//      writes k and v into the pools at kv_dst (kv_write_bf16's bytes) and puts them into its tile.
//      Each item writes its heads' (max, Σ e) and unnormalised Σ e·v, as attn_paged_partial;
//   3. an item is one query head's 32 values: the merge of the splits (log-sum-exp), times
//      sigmoid(gate), rounded to bf16 (attn_paged_reduce's result); each warp's first o_proj row is asked
//      for before the barrier;
//   4. every block stages the attention output in shared memory, then a warp an o_proj row, rounded to
//      bf16 and added to the residual (add_rms_norm_row's rounding) or written out; with the residual,
//      the norm of the new residual over the grid (ml_norm_rows: a fourth barrier).
// Each value's arithmetic is that of the launches it replaces; the sums run in another order (norm sums
// over a warp, softmax over spans of other sizes), so the results match theirs to rounding, not bit for
// bit (deterministically: no float atomics). The parity suite checks them against the CPU and against
// the separate launches.
#include "layer.cuh"

// Positions of a K/V tile and the head size the kernel takes (the query heads of a KV head and the
// attention output it stages are the instance's: see the entry points).
#define AL_TILE 16
#define AL_D 256
// 16-byte chunks of one K (or V) tile, and those a thread copies.
#define AL_CHUNKS (AL_TILE * AL_D / 8)
#define AL_PER_T (AL_CHUNKS / ML_THREADS)
// Tiles in the ring (16 KiB each, dynamic shared memory: the launcher passes AL_STAGES · 16 KiB): while
// one is summed the next AL_STAGES − 1 are on their way.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AL_STAGES 4
#else
#define AL_STAGES 2  // two blocks in the 100 KiB of sm_86 / sm_89
#endif
#define AL_STAGE_ELEMS (2 * AL_TILE * AL_D)

// The kernel's arguments (`AttnLayerArgs` in crates/cuda/src/ops/attn_layer.rs, field for field).
// Packed weights are words [n, k / 32 · BITS] u32 and scales [n, ceil(k / group)] f32.
struct AttnLayerArgs {
    const bf16* x;          // [h] the normed input row
    const u32* q_w;         // [2 hq d, h]: per head d q rows then d gate rows
    const float* q_s;
    const u32* k_w;         // [hkv d, h]
    const float* k_s;
    const u32* v_w;         // [hkv d, h]
    const float* v_s;
    const bf16* q_norm;     // [d] (used as 1 + w)
    const bf16* k_norm;     // [d]
    const float* inv_freq;  // [half]
    bf16* k_pool;           // [num_blocks · bs, hkv d]
    bf16* v_pool;
    const u32* table;       // [max_blocks] the sequence's block ids
    const u32* lens;        // [1] its context (the new token included)
    const u32* positions;   // [1] the new token's position
    const u32* kv_dst;      // [1] the new token's pool row
    const u32* o_w;         // [h, hq d]
    const float* o_s;
    bf16* qkv;              // [2 hq d + 2 hkv d] scratch: q|gate, k, v rounded to bf16
    float* part_o;          // [hq, max_splits, d] scratch
    float* part_ml;         // [hq, max_splits, 2] scratch
    bf16* attn;             // [hq d] scratch: the gated attention output
    float* partials;        // [gridDim.x] scratch (with acc)
    bf16* y;                // [h] the output row (without acc)
    bf16* acc;              // [h] the residual, or null (no add and norm)
    const bf16* norm_w;     // [h]
    bf16* normed;           // [h]
    u32* sync;              // [2]
    int h, hq, hkv, bs, max_blocks, num_blocks, max_splits, half;
    int qkv_group, o_group;
    float head_eps, mscale, scale, eps, offset;
    int pad;
    unsigned long long* trace;  // [16] or null: block 0's phase times (globaltimer, ns)
};

// The split of the context over the grid: AL_TILE-position tiles, `per` tiles an item, `splits` items a
// KV head (at most gridDim.x / hkv, rounded up: the part buffers' max_splits).
struct AlSplit {
    int len, tiles, per, splits;
};
__device__ __forceinline__ AlSplit al_split(const AttnLayerArgs& a) {
    AlSplit s;
    s.len = (int)min(__ldg(a.lens), (u32)a.max_blocks * (u32)a.bs);
    s.tiles = (s.len + AL_TILE - 1) / AL_TILE;
    const int heads = max(1, (int)gridDim.x / a.hkv);
    s.per = max(1, (s.tiles + heads - 1) / heads);
    s.splits = (s.tiles + s.per - 1) / s.per;
    return s;
}

__device__ __forceinline__ void al_cp16(void* dst, const void* src, bool ok) {
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void al_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void al_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits until at most the newest AL_STAGES − 1 groups of this thread's copies are in flight.
__device__ __forceinline__ void al_wait_stages() { asm volatile("cp.async.wait_group %0;\n" ::"n"(AL_STAGES - 1) : "memory"); }

// Whether position p of the sequence is visible (inside its context and a pool block), and its pool row.
__device__ __forceinline__ bool al_row(const AttnLayerArgs& a, int p, int len, size_t& row) {
    if (p >= len) return false;
    const u32 blk = __ldg(a.table + p / a.bs);
    row = (size_t)blk * a.bs + (u32)p % (u32)a.bs;
    return blk < (u32)a.num_blocks;
}

// This thread's chunks of tile t (positions t·AL_TILE ..) of KV head kh into one stage of the ring
// (K rows then V rows, [AL_TILE][AL_D] bf16 each; an invisible position's rows read as zeros); the
// caller commits the group.
__device__ __forceinline__ void al_issue(const AttnLayerArgs& a, bf16* stage, int kh, int t, int len) {
    const size_t rs = (size_t)a.hkv * AL_D;
#pragma unroll
    for (int i = 0; i < AL_PER_T; ++i) {
        const int c = threadIdx.x + ML_THREADS * i, j = c / (AL_D / 8), ch = c % (AL_D / 8);
        size_t row = 0;
        const bool ok = al_row(a, t * AL_TILE + j, len, row);
        const size_t at = ok ? row * rs + (size_t)kh * AL_D + 8 * ch : 0;
        al_cp16(stage + 8 * c, a.k_pool + at, ok);
        al_cp16(stage + AL_TILE * AL_D + 8 * c, a.v_pool + at, ok);
    }
}

// The item's first AL_STAGES − 1 tiles (from t0, none past t1) into stages 0 .., a group each (empty
// past t1), so that al_item always finds tile t complete once all but AL_STAGES − 1 groups are.
__device__ __forceinline__ void al_prime(const AttnLayerArgs& a, bf16* ring, int kh, int t0, int t1, int len) {
#pragma unroll
    for (int u = 0; u < AL_STAGES - 1; ++u) {
        if (t0 + u < t1) al_issue(a, ring + (size_t)u * AL_STAGE_ELEMS, kh, t0 + u, len);
        al_commit();
    }
}

// Item it's KV head and its tiles [t0, t1).
__device__ __forceinline__ void al_span(const AlSplit& s, int it, int& kh, int& sp, int& t0, int& t1) {
    kh = it / s.splits;
    sp = it - kh * s.splits;
    t0 = sp * s.per;
    t1 = min(t0 + s.per, s.tiles);
}

// What every item's head norms and RoPE read, loaded once a block before barrier 1 (none depends on
// phase 1): the q and k norm weights, and the scaled cos and sin of each rotary frequency at the new
// token's position (qk_norm_rope_bf16's sincosf and mscale).
struct AlConst {
    bf16 qw[AL_D];
    bf16 kw[AL_D];
    float cs[AL_D / 2];
    float sn[AL_D / 2];
};
__device__ __forceinline__ void al_consts(const AttnLayerArgs& a, AlConst& c) {
    const float pos = (float)__ldg(a.positions);
    for (int i = threadIdx.x; i < AL_D; i += blockDim.x) {
        c.qw[i] = a.q_norm[i];
        c.kw[i] = a.k_norm[i];
    }
    for (int j = threadIdx.x; j < a.half; j += blockDim.x) {
        float sn, cs;
        sincosf(pos * __ldg(a.inv_freq + j), &sn, &cs);
        c.cs[j] = cs * a.mscale;
        c.sn[j] = sn * a.mscale;
    }
}

// The head norm (1 + w) and RoPE of one head's d values, lane holding values 8·lane .. 8·lane + 7 (x,
// in place), each rounded to bf16 as qk_norm_rope_bf16 writes it; w and the rotation from AlConst.
// Every lane of the warp calls it.
__device__ __forceinline__ void al_norm_rope(const AttnLayerArgs& a, float x[8], const bf16* w, const AlConst& c) {
    const int lane = threadIdx.x & 31;
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
    ss = warp_sum(ss);
    const float rr = 1.0f / sqrtf(ss / (float)AL_D + a.head_eps);
    float wf[8];
    unpack8(((const uint4*)w)[lane], wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = (x[e] * rr) * (1.0f + wf[e]);
    // Value i < half pairs with i + half, which lies half / 8 lanes on (half a multiple of 8).
    const int hl = a.half >> 3, base = 8 * lane;
    const bool rot = lane < 2 * hl, lo = lane < hl;
    const int src = rot ? (lo ? lane + hl : lane - hl) : lane;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float other = __shfl_sync(0xffffffffu, x[e], src);
        if (rot) {
            const int j = lo ? base + e : base + e - a.half;
            const float cs = c.cs[j], sn = c.sn[j];
            const float av = lo ? x[e] : other, bv = lo ? other : x[e];
            x[e] = lo ? av * cs + (-bv) * sn : bv * cs + av * sn;
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = bf2f(f2bf(x[e]));
}

// Phase 2, item `it` of the split: warp g attends query heads kh·group + g + j·ML_WARPS (j < HW) over
// the item's tiles. The item's first tiles were issued (al_prime) before the call.
template <int HW>
__device__ __forceinline__ void al_item(const AttnLayerArgs& a, const AlSplit& s, int it, bf16* ring, bf16* kv_new,
                                        const AlConst& c) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = a.hq / a.hkv;
    int kh, sp, t0, t1;
    al_span(s, it, kh, sp, t0, t1);
    const int qrow = 2 * a.hq * AL_D, krow = qrow + kh * AL_D, vrow = qrow + a.hkv * AL_D + kh * AL_D;
    const int newp = s.len - 1, newt = newp / AL_TILE;
    const bool has_new = newt >= t0 && newt < t1;
    // q of the warp's heads (each its d q values of the q|gate row), normed, roped and rounded.
    bool head[HW];
    float q[HW][8];
#pragma unroll
    for (int u = 0; u < HW; ++u) {
        head[u] = warp + u * ML_WARPS < group;
        const int hq_i = kh * group + (head[u] ? warp + u * ML_WARPS : 0);
        unpack8(__ldcg((const uint4*)(a.qkv + (size_t)hq_i * 2 * AL_D) + lane), q[u]);
        al_norm_rope(a, q[u], c.qw, c);
    }
    // The new position's k (normed, roped, rounded) and v, by the last warp of the item that holds it,
    // into the pools and kv_new ([2][AL_D], which the same warp copies into the tile).
    if (has_new && warp == ML_WARPS - 1) {
        float k[8];
        unpack8(__ldcg((const uint4*)(a.qkv + krow) + lane), k);
        al_norm_rope(a, k, c.kw, c);
        const uint4 kn = make_uint4(pack_bf16x2(k[0], k[1]), pack_bf16x2(k[2], k[3]), pack_bf16x2(k[4], k[5]),
                                    pack_bf16x2(k[6], k[7]));
        const uint4 vn = __ldcg((const uint4*)(a.qkv + vrow) + lane);
        ((uint4*)kv_new)[lane] = kn;
        ((uint4*)(kv_new + AL_D))[lane] = vn;
        const u32 dst = __ldg(a.kv_dst);
        if (dst < (u32)a.num_blocks * (u32)a.bs) {
            const size_t at = (size_t)dst * a.hkv * AL_D + (size_t)kh * AL_D;
            ((uint4*)(a.k_pool + at))[lane] = kn;
            ((uint4*)(a.v_pool + at))[lane] = vn;
        }
    }
    float m[HW], l[HW], acc[HW][8];
#pragma unroll
    for (int u = 0; u < HW; ++u) {
        m[u] = NEG_INF;
        l[u] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
    }
#pragma unroll 1
    for (int t = t0; t < t1; ++t) {
        bf16* st = ring + (size_t)((t - t0) % AL_STAGES) * AL_STAGE_ELEMS;
        const int ahead = t + AL_STAGES - 1;  // into the stage tile t − 1 left
        if (ahead < t1) al_issue(a, ring + (size_t)((ahead - t0) % AL_STAGES) * AL_STAGE_ELEMS, kh, ahead, s.len);
        al_commit();
        al_wait_stages();
        __syncthreads();
        if (has_new && t == newt && warp == ML_WARPS - 1) {
            const int j = newp - t * AL_TILE;
            ((uint4*)(st + j * AL_D))[lane] = ((const uint4*)kv_new)[lane];
            ((uint4*)(st + AL_TILE * AL_D + j * AL_D))[lane] = ((const uint4*)(kv_new + AL_D))[lane];
        }
        __syncthreads();
        if (head[0]) {
            // Lane j < AL_TILE: position t·AL_TILE + j's score (−inf where not visible).
            float sc[HW];
#pragma unroll
            for (int u = 0; u < HW; ++u) sc[u] = NEG_INF;
#pragma unroll
            for (int j = 0; j < AL_TILE; ++j) {
                float kf[8];
                unpack8(((const uint4*)(st + j * AL_D))[lane], kf);
#pragma unroll
                for (int u = 0; u < HW; ++u) {
                    float d = 0.0f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) d += q[u][e] * kf[e];
                    d = warp_sum(d);
                    if (lane == j) sc[u] = d * a.scale;
                }
            }
            if (lane < AL_TILE) {
                size_t row;
                if (!al_row(a, t * AL_TILE + lane, s.len, row)) {
#pragma unroll
                    for (int u = 0; u < HW; ++u) sc[u] = NEG_INF;
                }
            }
            float e[HW];
            bool live[HW];
#pragma unroll
            for (int u = 0; u < HW; ++u) {
                const float mt = fmaxf(m[u], warp_max(sc[u]));
                live[u] = head[u] && mt != NEG_INF;
                e[u] = 0.0f;
                if (live[u]) {
                    const float alpha = m[u] == NEG_INF ? 0.0f : expf(m[u] - mt);
                    e[u] = sc[u] == NEG_INF ? 0.0f : expf(sc[u] - mt);
                    l[u] = l[u] * alpha + warp_sum(e[u]);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[u][i] *= alpha;
                    m[u] = mt;
                }
            }
#pragma unroll
            for (int j = 0; j < AL_TILE; ++j) {
                float ej[HW];
                bool any = false;
#pragma unroll
                for (int u = 0; u < HW; ++u) {
                    ej[u] = __shfl_sync(0xffffffffu, e[u], j);
                    any |= ej[u] != 0.0f;
                }
                if (!any) continue;
                float vf[8];
                unpack8(((const uint4*)(st + AL_TILE * AL_D + j * AL_D))[lane], vf);
#pragma unroll
                for (int u = 0; u < HW; ++u)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[u][i] += ej[u] * vf[i];
            }
        }
        __syncthreads();  // the stage is read before the next tile is issued into it
    }
    al_wait_all();  // only empty groups are left
#pragma unroll
    for (int u = 0; u < HW; ++u) {
        if (!head[u]) continue;
        const size_t slot = (size_t)(kh * group + warp + u * ML_WARPS) * a.max_splits + sp;
        float4* po = (float4*)(a.part_o + slot * AL_D) + 2 * lane;
        po[0] = make_float4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]);
        po[1] = make_float4(acc[u][4], acc[u][5], acc[u][6], acc[u][7]);
        if (lane == 0) {
            a.part_ml[2 * slot] = m[u];
            a.part_ml[2 * slot + 1] = l[u];
        }
    }
}

// Phase 3, item (head h, values 32·c ..): the splits merged, lane i value 32·c + i, warp w the splits
// w, w + ML_WARPS, …, each keeping a running max M, Σ e·o and Σ e·l; then the warps' in warp order.
__device__ __forceinline__ void al_reduce(const AttnLayerArgs& a, int splits, int item, float (*red)[32][3]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = item / (AL_D / 32), i = (item % (AL_D / 32)) * 32 + lane;
    const size_t slot0 = (size_t)h * a.max_splits;
    const float gate = warp == 0 ? bf2f(__ldcg(a.qkv + (size_t)h * 2 * AL_D + AL_D + i)) : 0.0f;
    float M = NEG_INF, num = 0.0f, den = 0.0f;
#pragma unroll 1
    for (int s0 = warp; s0 < splits; s0 += 4 * ML_WARPS) {
        float ms[4], ls[4], os[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int s = s0 + u * ML_WARPS;
            ms[u] = s < splits ? __ldcg(a.part_ml + 2 * (slot0 + s)) : NEG_INF;
            ls[u] = s < splits ? __ldcg(a.part_ml + 2 * (slot0 + s) + 1) : 0.0f;
            os[u] = s < splits ? __ldcg(a.part_o + (slot0 + s) * AL_D + i) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (ms[u] == NEG_INF) continue;
            if (ms[u] > M) {
                const float f = M == NEG_INF ? 0.0f : expf(M - ms[u]);
                num *= f;
                den *= f;
                M = ms[u];
            }
            const float e = expf(ms[u] - M);
            num += e * os[u];
            den += e * ls[u];
        }
    }
    red[warp][lane][0] = M;
    red[warp][lane][1] = num;
    red[warp][lane][2] = den;
    __syncthreads();
    if (warp == 0) {
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < ML_WARPS; ++w) mm = fmaxf(mm, red[w][lane][0]);
        float nn = 0.0f, dd = 0.0f;
#pragma unroll
        for (int w = 0; w < ML_WARPS; ++w) {
            const float mw = red[w][lane][0];
            if (mw == NEG_INF) continue;
            const float f = expf(mw - mm);
            nn += f * red[w][lane][1];
            dd += f * red[w][lane][2];
        }
        float o = dd > 0.0f ? nn / dd : 0.0f;
        o *= sigmoid_f(gate);
        a.attn[(size_t)h * AL_D + i] = f2bf(o);
    }
    __syncthreads();  // red is read before the next item writes it
}

template <int BITS, int GU, int OU, int HW>
__device__ __forceinline__ void attn_layer_m1(const AttnLayerArgs& a) {
    // x (phase 1), then the attention output (phase 4)
    __shared__ __align__(16) bf16 s_buf[(GU > OU ? GU : OU) * 32 * 32];
    extern __shared__ __align__(16) bf16 ring[];  // AL_STAGES K/V tiles in phase 2; phase 3's sums
    __shared__ __align__(16) bf16 kv_new[2 * AL_D];                // the new position's k and v
    __shared__ __align__(16) AlConst consts;
    __shared__ float s_res[ML_WARPS][ML_MAXROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * ML_WARPS + warp, nw = gridDim.x * ML_WARPS;
    const bool norm = a.acc != nullptr;
    const int nq = 2 * a.hq * AL_D, nkv = a.hkv * AL_D, rows1 = nq + 2 * nkv, ko = a.hq * AL_D;
    const AlSplit sp = al_split(a);
    const int items2 = a.hkv * sp.splits;
    ml_mark(a.trace, 0);
    ml_stage_x(s_buf, a.x, a.h);
    __syncthreads();

    // 1. The projections' rows: q|gate, then k, then v rows, in batches of B a warp.
    {
        constexpr int B = GU == 2 ? 3 : 2;
        const size_t wpr = (size_t)(a.h >> 5) * BITS;
        const int cols = (a.h + a.qkv_group - 1) / a.qkv_group;
#pragma unroll 1
        for (int i0 = gw; i0 < rows1; i0 += B * nw) {
            MlRow<BITS, GU> rows[B];
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < rows1) {
                    const u32* w = i < nq ? a.q_w : i < nq + nkv ? a.k_w : a.v_w;
                    const float* s = i < nq ? a.q_s : i < nq + nkv ? a.k_s : a.v_s;
                    const int r = i < nq ? i : i < nq + nkv ? i - nq : i - nq - nkv;
                    ml_load<BITS, 32, GU>(rows[b], w + r * wpr, s + (size_t)r * cols, a.h, a.qkv_group, lane);
                }
            }
            float d[B];
            ml_dots<BITS, 32, GU, true, B>(rows, s_buf, a.h, lane, d);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < rows1) {
                    const float s = warp_sum(d[b]);
                    if (lane == 0) a.qkv[i] = f2bf(s);
                }
            }
        }
    }
    // The first tile of the block's first item: cached positions only, which no phase writes (the new
    // position's rows are replaced in phase 2).
    if ((int)blockIdx.x < items2) {
        int kh, s0, t0, t1;
        al_span(sp, blockIdx.x, kh, s0, t0, t1);
        al_prime(a, ring, kh, t0, t1, sp.len);
    }
    al_consts(a, consts);  // read after barrier 1's __syncthreads
    ml_mark(a.trace, 1);
    ml_grid_sync(a.sync, gridDim.x, ml_last(a.trace, 0));
    ml_mark(a.trace, 2);

    // 2. The attention partials, an item a block.
#pragma unroll 1
    for (int it = blockIdx.x; it < items2; it += gridDim.x) {
        if (it != (int)blockIdx.x) {
            int kh, s0, t0, t1;
            al_span(sp, it, kh, s0, t0, t1);
            al_prime(a, ring, kh, t0, t1, sp.len);
        }
        al_item<HW>(a, sp, it, ring, kv_new, consts);
    }
    ml_mark(a.trace, 3);
    ml_grid_sync(a.sync, 2 * gridDim.x, ml_last(a.trace, 1));
    ml_mark(a.trace, 4);

    // 3. The merge of the splits and the gate, an item a block; each warp's first o_proj row is asked
    // for first.
    const size_t owpr = (size_t)(ko >> 5) * BITS;
    const int ocols = (ko + a.o_group - 1) / a.o_group;
    MlRow<BITS, OU> orow;
    if (gw < a.h) ml_load<BITS, 32, OU>(orow, a.o_w + gw * owpr, a.o_s + (size_t)gw * ocols, ko, a.o_group, lane);
    {
        float(*red)[32][3] = reinterpret_cast<float(*)[32][3]>(ring);
        const int items3 = a.hq * (AL_D / 32);
#pragma unroll 1
        for (int it = blockIdx.x; it < items3; it += gridDim.x) al_reduce(a, sp.splits, it, red);
    }
    ml_mark(a.trace, 5);
    ml_grid_sync(a.sync, 3 * gridDim.x, ml_last(a.trace, 2));
    ml_mark(a.trace, 6);

    // 4. The attention output into shared memory, then a warp an o_proj row.
    for (int q = threadIdx.x; q < (ko >> 3); q += blockDim.x)
        ((uint4*)s_buf)[ml_xs_chunk(q)] = __ldcg((const uint4*)a.attn + q);
    __syncthreads();
    ml_mark(a.trace, 7);
    float sq = 0.0f;
#pragma unroll 1
    for (int j = 0; j < ML_MAXROWS; ++j) {
        const int r = gw + j * nw;
        if (r >= a.h) break;
        const float res = norm && lane == 0 ? bf2f(a.acc[r]) : 0.0f;
        if (j > 0) ml_load<BITS, 32, OU>(orow, a.o_w + r * owpr, a.o_s + (size_t)r * ocols, ko, a.o_group, lane);
        const float s = warp_sum(ml_dot<BITS, 32, OU, true>(orow, s_buf, ko, lane));
        if (lane == 0) {
            const bf16 v = f2bf(s);
            if (norm)
                sq += ml_add_row(a.acc, r, res, v, s_res[warp][j]);
            else
                a.y[r] = v;
        }
    }
    ml_mark(a.trace, 8);
    if (norm) ml_norm_rows(sq, s_res, a.partials, a.sync, 4 * gridDim.x, a.h, a.eps, a.offset, a.norm_w, a.normed, gw, nw, ml_last(a.trace, 3));
    ml_finish(a.sync, a.trace);
}

// The q|gate rows of this block's warps' first item (for the prologue's L2 prefetch); the block's
// entry marked (ml_entered).
template <int BITS>
__device__ __forceinline__ RowSpan al_first_rows(const AttnLayerArgs& a) {
    ml_entered(a.trace);
    const long long row_bytes = (long long)(a.h >> 5) * BITS * 4;
    const long long r0 = (long long)blockIdx.x * ML_WARPS, nq = 2ll * a.hq * AL_D;
    return RowSpan{(const char*)a.q_w + r0 * row_bytes, r0 < nq ? min((long long)ML_WARPS, nq - r0) * row_bytes : 0};
}

// Entry points: projections of BITS bits (q|gate, k, v and o_proj of one width), 2 units of 32 values
// a lane in the h-wide dots (h ≤ 2048), 4 in the o_proj dots (hq · d ≤ 4096), a query head a warp
// (8 a KV head); and for INT8 at the qwen4_exp width, 3 units (h ≤ 3072), 6 (hq · d ≤ 6144) and two
// query heads a warp (16 a KV head). Grid: blocks_per_sm · multiprocessors blocks of ML_THREADS
// threads, launched cooperatively; dynamic shared memory AL_STAGES · 16 KiB (4 stages from sm_90 on,
// else 2).
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) attn_layer_m1_p8_u2_o4(const AttnLayerArgs a) { pdl_prologue_prefetch(al_first_rows<8>(a)); attn_layer_m1<8, 2, 4, 1>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) attn_layer_m1_p6_u2_o4(const AttnLayerArgs a) { pdl_prologue_prefetch(al_first_rows<6>(a)); attn_layer_m1<6, 2, 4, 1>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) attn_layer_m1_p4_u2_o4(const AttnLayerArgs a) { pdl_prologue_prefetch(al_first_rows<4>(a)); attn_layer_m1<4, 2, 4, 1>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) attn_layer_m1_p8_u3_o6(const AttnLayerArgs a) { pdl_prologue_prefetch(al_first_rows<8>(a)); attn_layer_m1<8, 3, 6, 2>(a); }
