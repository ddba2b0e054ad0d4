// MoE router: softmax over the expert logits in f32, top-k (ties to the lower expert id), optional
// renormalisation of the kept probabilities. One block per token.
#include "common.cuh"

#define ROUTER_MAX_K 64
#define NONE 0xffffffffu

// Whether candidate (pa, ia) ranks before (pb, ib): larger probability, then lower id; NONE ranks last.
__device__ __forceinline__ bool ranks_before(float pa, u32 ia, float pb, u32 ib) {
    if (ia == NONE) return false;
    if (ib == NONE) return true;
    return pa > pb || (pa == pb && ia < ib);
}

// logits: [t, e]; ids, weights: [t, k], each row by descending weight. Dynamic shared memory: 5·e bytes.
// Block size a multiple of 32; k ≤ ROUTER_MAX_K.
extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, u32* __restrict__ ids,
                                           float* __restrict__ weights, int e, int k, int renorm) {
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
