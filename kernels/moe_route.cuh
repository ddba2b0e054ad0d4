// The routing steps shared by the router and MoE kernels (router.cu, moe.cu) and the fused decode
// routing (moe_route.cu), so that each exists once. Their loops stay rolled (#pragma unroll 1), the
// sorting networks' too: a decode launch is short, and much of its time may go to fetching its code;
// loops of loads whose results a sum takes in turn are unrolled by 4, so that the loads overlap.
//   router_topk_rows  softmax and top-k (k ≤ 16, e ≤ 1024) of several tokens' logits in one block: each
//                     token's experts cut into lists of 32, each list sorted by a bitonic network of warp
//                     shuffles and cut to its best 16, then a merge tree of the lists;
//   moe_sort_block    the (token, choice) pairs grouped by expert and cut into tiles of at most MOE_TILE
//                     pairs, in one block.
#pragma once
#include "common.cuh"

// Pairs per tile of the grouped GEMV (`MOE_TILE` in crates/cuda/src/ops/moe.rs).
#define MOE_TILE 8

// ---- Top-k ----

// Candidates a list keeps (the largest k router_topk_rows takes).
#define ROUTER_SORT_KEEP 16
// Lists (32-expert pieces of a token's row) one pass of router_topk_rows holds in shared memory.
#define ROUTER_SORT_LISTS 64

// Sort key of a candidate: larger keys rank first. Probabilities are ≥ 0, so their bits order as the
// values do; the low word ~id puts the lower id first among equal probabilities. Key 0 (probability
// +0 and id 0xffffffff) is the empty slot and ranks after every expert. Keys of distinct experts
// differ, so any exact selection under this order gives the same ranks: the networks below are one way
// to compute them, not part of the result.
__device__ __forceinline__ unsigned long long router_key(float p, u32 id) {
    return ((unsigned long long)__float_as_uint(p) << 32) | (unsigned long long)(~id);
}

// One compare-exchange step of a bitonic network across lanes lane and lane ^ stride: the lane that
// keeps the larger key is the lower one when `desc`, else the upper one.
__device__ __forceinline__ unsigned long long router_cx(unsigned long long key, int stride, bool desc) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, stride);
    const bool lower = (threadIdx.x & stride) == 0;
    const bool keep_max = lower == desc;
    const unsigned long long hi = key > other ? key : other, lo = key > other ? other : key;
    return keep_max ? hi : lo;
}

// The warp's 32 keys sorted descending along the lanes (lane r holds rank r). The whole warp calls it.
__device__ __forceinline__ unsigned long long router_warp_sort(unsigned long long key) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int size = 2; size <= 32; size <<= 1) {
        const bool desc = (lane & size) == 0;
#pragma unroll 1
        for (int stride = size >> 1; stride > 0; stride >>= 1) key = router_cx(key, stride, desc);
    }
    return key;
}

// The best ROUTER_SORT_KEEP of two descending lists of ROUTER_SORT_KEEP keys, in lanes 0..15 by rank:
// lanes 0..15 take list a, lanes 16..31 list b reversed (a bitonic sequence of 32), then 5 merge steps.
// The whole warp calls it.
__device__ __forceinline__ unsigned long long router_warp_merge(const unsigned long long* a,
                                                                const unsigned long long* b) {
    const int lane = threadIdx.x & 31;
    unsigned long long key = lane < ROUTER_SORT_KEEP ? a[lane] : b[31 - lane];
#pragma unroll 1
    for (int stride = 16; stride > 0; stride >>= 1) key = router_cx(key, stride, true);
    return key;
}

// Shared memory of router_topk_rows. A pass routes up to ROUTER_SORT_LISTS / W tokens of W lists each:
// val holds each list's logits, then their exponentials; red_m and red_s each list's max and sum;
// cand the lists' kept candidates, ping-ponging between two buffers along the merge tree.
struct RouterSortSmem {
    float val[ROUTER_SORT_LISTS * 32];
    float red_m[ROUTER_SORT_LISTS];
    float red_s[ROUTER_SORT_LISTS];
    unsigned long long cand[2][ROUTER_SORT_LISTS * ROUTER_SORT_KEEP];
};

// One pass of router_topk_rows over tokens g0 .. g0 + gn of W lists each (gn · W ≤ ROUTER_SORT_LISTS).
// List l is token l / W's experts 32·(l % W) .. 32·(l % W) + 31, lane i holding expert 32·(l % W) + i;
// warp w takes lists w, w + nwarps, ... in every phase, so a lane reads back only the values it wrote.
__device__ __forceinline__ void router_topk_pass(const float* logits, int g0, int gn, int W, int e, int k,
                                                 int renorm, u32* ids, float* weights, u32* ids_copy,
                                                 RouterSortSmem& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int lists = gn * W;
    // Each list's logits and their max.
#pragma unroll 1
    for (int l = warp; l < lists; l += nwarps) {
        const int tok = l / W, i = (l - tok * W) * 32 + lane;
        const float x = i < e ? __ldcg(logits + (size_t)(g0 + tok) * e + i) : NEG_INF;
        sm.val[l * 32 + lane] = x;
        const float m = warp_max(x);
        if (lane == 0) sm.red_m[l] = m;
    }
    __syncthreads();
    // The token's max (over its lists in order), each lane's exponential, each list's sum.
#pragma unroll 1
    for (int l = warp; l < lists; l += nwarps) {
        const int tok = l / W, i = (l - tok * W) * 32 + lane;
        const float* rm = sm.red_m + tok * W;
        float m = rm[0];
#pragma unroll 4
        for (int c = 1; c < W; ++c) m = fmaxf(m, rm[c]);
        const float ex = i < e ? expf(sm.val[l * 32 + lane] - m) : 0.0f;
        sm.val[l * 32 + lane] = ex;
        const float s = warp_sum(ex);
        if (lane == 0) sm.red_s[l] = s;
    }
    __syncthreads();
    // The token's sum (its lists' sums in list order), each probability's key, each list sorted and
    // cut to its best ROUTER_SORT_KEEP.
#pragma unroll 1
    for (int l = warp; l < lists; l += nwarps) {
        const int tok = l / W, i = (l - tok * W) * 32 + lane;
        const float* rs = sm.red_s + tok * W;
        float s = rs[0];
#pragma unroll 4
        for (int c = 1; c < W; ++c) s += rs[c];
        const float p = sm.val[l * 32 + lane] / s;
        const unsigned long long key = router_warp_sort(i < e ? router_key(p, (u32)i) : 0ull);
        if (lane < ROUTER_SORT_KEEP) sm.cand[0][l * ROUTER_SORT_KEEP + lane] = key;
    }
    __syncthreads();
    // Merge tree: at each level a token's lists 2j and 2j + 1 become its list j.
    int buf = 0;
#pragma unroll 1
    for (int cur = W; cur > 1; cur >>= 1) {
        const int half = cur >> 1;
#pragma unroll 1
        for (int j = warp; j < gn * half; j += nwarps) {
            const int tok = j / half, pair = j - tok * half;
            const unsigned long long* a = sm.cand[buf] + (tok * cur + 2 * pair) * ROUTER_SORT_KEEP;
            const unsigned long long key = router_warp_merge(a, a + ROUTER_SORT_KEEP);
            if (lane < ROUTER_SORT_KEEP) sm.cand[buf ^ 1][j * ROUTER_SORT_KEEP + lane] = key;
        }
        __syncthreads();
        buf ^= 1;
    }
    // Lane r of token tok's warp holds rank r; the kept probabilities are summed in rank order.
#pragma unroll 1
    for (int tok = warp; tok < gn; tok += nwarps) {
        const unsigned long long key = lane < ROUTER_SORT_KEEP ? sm.cand[buf][tok * ROUTER_SORT_KEEP + lane] : 0ull;
        const float kp = __uint_as_float((u32)(key >> 32));
        const u32 kid = ~(u32)key;  // 0xffffffff for the empty key
        float total = 0.0f;
#pragma unroll 1
        for (int r = 0; r < k; ++r) total += __shfl_sync(0xffffffffu, kp, r);
        if (lane < k) {
            const size_t o = (size_t)(g0 + tok) * k + lane;
            ids[o] = kid;
            weights[o] = renorm ? kp / total : kp;
            if (ids_copy) ids_copy[o] = kid;
        }
    }
    __syncthreads();
}

// Softmax, top-k (ties to the lower id) and optional renormalisation of `ntok` tokens' logits
// ([ntok, e], read through L2 so that logits other blocks of the same launch wrote are seen) in one
// block: p = exp(x - max) / sum with the sum taken per 32 experts by warp_sum and over those pieces in
// order; ids, weights: [ntok, k] by descending weight, the kept probabilities summed in rank order for
// the renormalisation; ids_copy (optional, e.g. shared memory) gets the ids too. Tokens go in passes of
// ROUTER_SORT_LISTS / W (W = the power of two ≥ ceil(e / 32)). Needs e ≤ 1024, 1 ≤ k ≤ 16, k ≤ e and
// blockDim.x a multiple of 32; the whole block calls it and it ends with a barrier.
__device__ __forceinline__ void router_topk_rows(const float* logits, int ntok, int e, int k, int renorm,
                                                 u32* ids, float* weights, u32* ids_copy, RouterSortSmem& sm) {
    int W = 1;
    while (W * 32 < e) W <<= 1;
    const int per_pass = ROUTER_SORT_LISTS / W;
#pragma unroll 1
    for (int g0 = 0; g0 < ntok; g0 += per_pass)
        router_topk_pass(logits, g0, min(per_pass, ntok - g0), W, e, k, renorm, ids, weights, ids_copy, sm);
}

// ---- Grouping by expert ----

// Groups n_pairs expert ids (`ids`, any memory space; ids ≥ e are dropped) by expert in one block of
// blockDim.x threads (a multiple of 32, at most 1024): perm [n_pairs] pair numbers grouped by expert,
// experts in ascending order; tiles [max_tiles, 3] (expert, start in perm, count), expert after expert,
// the unused tail (0, 0, 0). `sh`: (2·e + 2) u32 of shared memory (each expert's pair offset and tile
// offset, plus the totals). Steps: count (shared atomics), one block-wide exclusive scan of the counts
// and of the tile counts ceil(count / MOE_TILE) (each thread a run of consecutive experts), each tile
// slot finds its expert by binary search over the tile offsets, and the pairs are scattered: `stable`
// puts an expert's pairs in ascending order (each pair counts the earlier pairs of its expert: for few
// pairs), else through per-expert atomic cursors (the order within an expert unspecified).
__device__ __forceinline__ void moe_sort_block(const u32* ids, int n_pairs, int e, u32* __restrict__ perm,
                                               u32* __restrict__ tiles, int max_tiles, u32* sh, bool stable) {
    u32* off = sh;          // [e + 1]: counts, then pair offsets, then scatter cursors
    u32* toff = sh + e + 1; // [e + 1]: tile offsets
    __shared__ u32 wsum[2][32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
#pragma unroll 1
    for (int i = tid; i <= e; i += blockDim.x) off[i] = 0;
    __syncthreads();
#pragma unroll 1
    for (int p = tid; p < n_pairs; p += blockDim.x) {
        const u32 x = ids[p];
        if (x < (u32)e) atomicAdd(&off[x], 1u);
    }
    __syncthreads();
    // Thread tid owns experts [lo, hi): local sums, then an exclusive scan over the threads.
    const int per = (e + blockDim.x - 1) / blockDim.x;
    const int lo = min(e, tid * per), hi = min(e, lo + per);
    u32 c_sum = 0, t_sum = 0;
#pragma unroll 1
    for (int x = lo; x < hi; ++x) {
        const u32 c = off[x];
        c_sum += c;
        t_sum += (c + MOE_TILE - 1) / MOE_TILE;
    }
    u32 c_inc = c_sum, t_inc = t_sum;
    warp_inclusive_scan2(c_inc, t_inc);
    if (lane == 31) {
        wsum[0][warp] = c_inc;
        wsum[1][warp] = t_inc;
    }
    __syncthreads();
    if (warp == 0) {
        u32 a = lane < nwarps ? wsum[0][lane] : 0u, b = lane < nwarps ? wsum[1][lane] : 0u;
        warp_inclusive_scan2(a, b);
        wsum[0][lane] = a; // inclusive over warps
        wsum[1][lane] = b;
    }
    __syncthreads();
    u32 c_off = c_inc - c_sum + (warp > 0 ? wsum[0][warp - 1] : 0u);
    u32 t_off = t_inc - t_sum + (warp > 0 ? wsum[1][warp - 1] : 0u);
#pragma unroll 1
    for (int x = lo; x < hi; ++x) {
        const u32 c = off[x];
        off[x] = c_off;
        toff[x] = t_off;
        c_off += c;
        t_off += (c + MOE_TILE - 1) / MOE_TILE;
    }
    if (tid == 0) {
        off[e] = wsum[0][nwarps - 1];
        toff[e] = wsum[1][nwarps - 1];
    }
    __syncthreads();
    const int nt = (int)min(toff[e], (u32)max_tiles);
#pragma unroll 1
    for (int t = tid; t < max_tiles; t += blockDim.x) {
        u32 x = 0, st = 0, c = 0;
        if (t < nt) {
            // The expert x with toff[x] ≤ t < toff[x + 1] (the last x with toff[x] ≤ t; toff[0] = 0).
            int a = 0, b = e;
            while (a < b) {
                const int mid = (a + b + 1) >> 1;
                if (toff[mid] <= (u32)t) a = mid;
                else b = mid - 1;
            }
            x = (u32)a;
            const u32 s = ((u32)t - toff[a]) * MOE_TILE;
            st = off[a] + s;
            c = min((u32)MOE_TILE, off[a + 1] - off[a] - s);
        }
        tiles[3 * t] = x;
        tiles[3 * t + 1] = st;
        tiles[3 * t + 2] = c;
    }
    __syncthreads();
#pragma unroll 1
    for (int p = tid; p < n_pairs; p += blockDim.x) {
        const u32 x = ids[p];
        if (x >= (u32)e) continue;
        if (stable) {
            u32 rank = 0;
#pragma unroll 4
            for (int q = 0; q < p; ++q) rank += ids[q] == x;
            perm[off[x] + rank] = (u32)p;
        } else {
            perm[atomicAdd(&off[x], 1u)] = (u32)p;
        }
    }
}
