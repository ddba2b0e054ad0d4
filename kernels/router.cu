// MoE router: softmax over the expert logits in f32, top-k (ties to the lower expert id), optional
// renormalisation of the kept probabilities. Up to 1024 experts and k ≤ 16: one block per token, one
// expert a thread, a sort-and-merge top-16 by warp shuffles (router_topk_sort). Larger k up to 32·V
// experts (V = 8, 16, 32): one warp per token with the token's probabilities in registers
// (router_topk_w{V}); more experts: one block per token with k arg-max rounds (router_topk_f32).
#include "moe_route.cuh"

#define ROUTER_MAX_K 64
#define NONE 0xffffffffu

// Whether candidate (pa, ia) ranks before (pb, ib): larger probability, then lower id; NONE ranks last.
__device__ __forceinline__ bool ranks_before(float pa, u32 ia, float pb, u32 ib) {
    if (ia == NONE) return false;
    if (ib == NONE) return true;
    return pa > pb || (pa == pb && ia < ib);
}

// logits: [t, e]; ids, weights: [t, k], each row by descending weight. Grid (t); dynamic shared memory:
// 5·e bytes; block size a multiple of 32; k ≤ ROUTER_MAX_K.
extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, u32* __restrict__ ids,
                                           float* __restrict__ weights, int e, int k, int renorm) {
    pdl_prologue();
    extern __shared__ float smem[];
    float* p = smem;
    unsigned char* used = (unsigned char*)(smem + e);
    __shared__ float scratch[32];
    __shared__ float red_p[32];
    __shared__ u32 red_i[32];
    __shared__ float sel_p[ROUTER_MAX_K];
    __shared__ u32 sel_i[ROUTER_MAX_K];
    const float* row = logits + (size_t)blockIdx.x * e;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;

    float m = NEG_INF;
    for (int i = threadIdx.x; i < e; i += blockDim.x) m = fmaxf(m, row[i]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        const float v = expf(row[i] - m);
        p[i] = v;
        used[i] = 0;
        s += v;
    }
    s = block_sum(s, scratch);
    for (int i = threadIdx.x; i < e; i += blockDim.x) p[i] = p[i] / s;
    __syncthreads();

    for (int r = 0; r < k; ++r) {
        float bp = 0.0f;
        u32 bi = NONE;
        for (int i = threadIdx.x; i < e; i += blockDim.x)
            if (!used[i] && ranks_before(p[i], (u32)i, bp, bi)) {
                bp = p[i];
                bi = (u32)i;
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float op = __shfl_xor_sync(0xffffffffu, bp, o);
            const u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ranks_before(op, oi, bp, bi)) {
                bp = op;
                bi = oi;
            }
        }
        if (lane == 0) {
            red_p[warp] = bp;
            red_i[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nwarps; ++w)
                if (ranks_before(red_p[w], red_i[w], bp, bi)) {
                    bp = red_p[w];
                    bi = red_i[w];
                }
            sel_p[r] = bp;
            sel_i[r] = bi;
            if (bi != NONE) used[bi] = 1;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int r = 0; r < k; ++r) total += sel_p[r];
        const size_t o = (size_t)blockIdx.x * k;
        for (int r = 0; r < k; ++r) {
            ids[o + r] = sel_i[r];
            weights[o + r] = renorm ? sel_p[r] / total : sel_p[r];
        }
    }
}

// One block per token: router_topk_rows (moe_route.cuh) on the block's row, one 32-expert list a warp:
// softmax with the sum taken per warp and over the warps in order; each warp sorts its 32 keys
// (router_key: probability, then lower id) by a bitonic network of shuffles and keeps its best 16; then
// a merge tree halves the lists until one holds the token's top 16 in rank order. The kept
// probabilities are summed in rank order (as router_topk_f32 sums them) for the renormalisation.
// logits: [t, e]; ids, weights: [t, k], each row by descending weight. Grid (t); block 32·W threads with
// W a power of two, 32·W ≥ e, W ≤ 32; k ≤ 16; no dynamic shared memory.
extern "C" __global__ void router_topk_sort(const float* __restrict__ logits, u32* __restrict__ ids,
                                            float* __restrict__ weights, int e, int k, int renorm) {
    pdl_prologue();
    __shared__ RouterSortSmem sm;
    const size_t row = blockIdx.x;
    router_topk_rows(logits + row * e, 1, e, k, renorm, ids + row * k, weights + row * k, nullptr, sm);
}

// One warp per token: lane l holds probabilities l, l + 32, ..., l + 32·(V - 1) (e ≤ 32·V) in
// registers. Softmax with warp reductions; then k rounds, each a 5-step shuffle arg-max of the lanes'
// best remaining candidates under ranks_before (so ties go to the lower id, as in router_topk_f32), after
// which only the winner's lane rescans its V values. The kept probabilities are summed in rank order,
// as router_topk_f32 sums them. Grid (ceil(t / warps per block)); block a multiple of 32 threads;
// k ≤ ROUTER_MAX_K; no shared memory.
template <int V>
__device__ __forceinline__ void router_topk_warp(const float* __restrict__ logits, u32* __restrict__ ids,
                                                 float* __restrict__ weights, int t, int e, int k, int renorm) {
    const int lane = threadIdx.x & 31;
    const int tok = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (tok >= t) return;
    const float* row = logits + (size_t)tok * e;
    float v[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int i = j * 32 + lane;
        v[j] = i < e ? __ldg(row + i) : NEG_INF;
    }
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < V; ++j) m = fmaxf(m, v[j]);
    m = warp_max(m);
    float s = 0.0f;
    u32 avail = 0;
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (j * 32 + lane < e) {
            v[j] = expf(v[j] - m);
            s += v[j];
            avail |= 1u << j;
        }
    s = warp_sum(s);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = v[j] / s;
    // This lane's best remaining candidate.
    float bp = 0.0f;
    u32 bi = NONE;
#pragma unroll
    for (int j = 0; j < V; ++j)
        if (((avail >> j) & 1u) && ranks_before(v[j], (u32)(j * 32 + lane), bp, bi)) {
            bp = v[j];
            bi = (u32)(j * 32 + lane);
        }
    // Lane r keeps rank r (and r + 32).
    float out_p0 = 0.0f, out_p1 = 0.0f;
    u32 out_i0 = NONE, out_i1 = NONE;
    float total = 0.0f;
    for (int r = 0; r < k; ++r) {
        float wp = bp;
        u32 wi = bi;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float op = __shfl_xor_sync(0xffffffffu, wp, o);
            const u32 oi = __shfl_xor_sync(0xffffffffu, wi, o);
            if (ranks_before(op, oi, wp, wi)) {
                wp = op;
                wi = oi;
            }
        }
        // One winner for every lane (lane 0's, should the order not be total, as with NaN).
        wp = __shfl_sync(0xffffffffu, wp, 0);
        wi = __shfl_sync(0xffffffffu, wi, 0);
        total += wp;
        if (lane == (r & 31)) {
            if (r < 32) {
                out_p0 = wp;
                out_i0 = wi;
            } else {
                out_p1 = wp;
                out_i1 = wi;
            }
        }
        if (wi != NONE && (int)(wi & 31u) == lane && wi == bi) {
            avail &= ~(1u << (wi >> 5));
            bp = 0.0f;
            bi = NONE;
#pragma unroll
            for (int j = 0; j < V; ++j)
                if (((avail >> j) & 1u) && ranks_before(v[j], (u32)(j * 32 + lane), bp, bi)) {
                    bp = v[j];
                    bi = (u32)(j * 32 + lane);
                }
        }
    }
    const size_t o = (size_t)tok * k;
    if (lane < k) {
        ids[o + lane] = out_i0;
        weights[o + lane] = renorm ? out_p0 / total : out_p0;
    }
    if (lane + 32 < k) {
        ids[o + lane + 32] = out_i1;
        weights[o + lane + 32] = renorm ? out_p1 / total : out_p1;
    }
}

extern "C" __global__ void router_topk_w8(const float* logits, u32* ids, float* weights, int t, int e, int k, int renorm) {
    pdl_prologue();
    router_topk_warp<8>(logits, ids, weights, t, e, k, renorm);
}
extern "C" __global__ void router_topk_w16(const float* logits, u32* ids, float* weights, int t, int e, int k, int renorm) {
    pdl_prologue();
    router_topk_warp<16>(logits, ids, weights, t, e, k, renorm);
}
extern "C" __global__ void router_topk_w32(const float* logits, u32* ids, float* weights, int t, int e, int k, int renorm) {
    pdl_prologue();
    router_topk_warp<32>(logits, ids, weights, t, e, k, renorm);
}
