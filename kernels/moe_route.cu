// The routing of a one-token MoE decode step in one launch (moe_route_decode_m1), where it takes four
// (router GEMV, a memset, softmax top-k, grouping by expert), each a few microseconds of launch latency
// whatever its size. The body is written for M tokens; only M = 1 has an entry point because that is
// where it wins (an H200 at 512 × 2048, top 10: 9.1 µs against 12.2; at M = 8 it took 27.7 µs against
// the separate launches' 12.6, whose GEMV runs on tensor cores while one block routes the eight tokens):
//   1. every block computes router logits = W · x (bf16 weight [e, h], f32 accumulation) for a slice of
//      expert rows and all M tokens, cut as the row-slot GEMV (gemv.cu) cuts a small n: slots of
//      2^tpr_log2 threads (32..256), one row a slot, the slot's threads striding over the row's 16-byte
//      chunks, so the grid spreads the router (2 MB at 512 experts of 2048) over the whole GPU; the
//      logits go to a global scratch [M, e];
//   2. each block then draws a ticket from a persistent counter; the block that draws the last one
//      (every other block's logits are then visible) runs, alone, the softmax top-k of every token
//      (router_topk_rows: the same keys, tie rule, sums and order as router_topk_sort) and groups the
//      pairs by expert (moe_sort_block, the same perm and tiles contract as moe_sort, each expert's
//      pairs in ascending order), then resets the counter to 0 for the next launch.
// The counter is one u32 per backend: its launches are ordered on the stream, and programmatic
// dependent launch does not let two of them overlap. Every kernel opens with the PDL prologue, whose
// griddepcontrol.wait returns only once the kernel ahead has completed and its writes are visible, and
// does so before touching memory (the weight prefetch below only asks L2 for router rows, which no
// kernel writes); so a launch starts using the counter only after the kernel before it, and by
// transitivity every earlier launch (the previous layer's routing included), has finished, counter
// reset and all. A graph replays the launch with the counter at 0 each time.
#include "moe_route.cuh"

#define ROUTE_THREADS 512
// Tokens times k the shared copy of the ids holds (M ≤ 8, k ≤ ROUTER_SORT_KEEP).
#define ROUTE_MAX_PAIRS (8 * ROUTER_SORT_KEEP)

// The router rows of this block: ROUTE_THREADS / 2^tpr_log2 rows from row blockIdx.x times that (none
// past e).
__device__ __forceinline__ RowSpan route_rows(const bf16* W, int e, int h, int tpr_log2) {
    const long long per = ROUTE_THREADS >> tpr_log2;
    const long long r0 = (long long)blockIdx.x * per;
    const long long rows = r0 < e ? min(per, (long long)e - r0) : 0;
    return RowSpan{W + r0 * h, rows * h * 2};
}

// W: [e, h] bf16; Wg: null, or one more bf16 row [h] (a shared expert's gate, M = 1 only) whose logit
// goes to logits[e], rounded to bf16 as the gate's own GEMV (a bf16 output) rounds it; X: [M, h] bf16 (h % 8 == 0, all 16-byte aligned); logits: [M, e] f32 scratch ([e + 1]
// with Wg); ids,
// weights: [M, k]; perm: [M·k]; tiles: [max_tiles, 3]; ticket: 1 u32, 0 at launch and left 0. Grid
// ceil((e + (Wg ? 1 : 0)) / (ROUTE_THREADS / 2^tpr_log2)) blocks of ROUTE_THREADS threads, 32 ≤ 2^tpr_log2 ≤ 256;
// e ≤ 1024, 1 ≤ k ≤ 16, k ≤ e; dynamic shared memory (2·e + 2) u32 (moe_sort_block's).
template <int M>
__device__ __forceinline__ void moe_route_decode_impl(const bf16* __restrict__ W, const bf16* __restrict__ Wg,
                                                      const bf16* __restrict__ X,
                                                      float* logits, u32* ids, float* weights, u32* perm,
                                                      u32* tiles, u32* ticket, int e, int h, int k, int renorm,
                                                      int max_tiles, int tpr_log2) {
    __shared__ float red[ROUTE_THREADS / 32][1][M];
    __shared__ RouterSortSmem sm;
    __shared__ u32 pair_ids[ROUTE_MAX_PAIRS];
    extern __shared__ u32 sort_sh[];

    // Router logits of this thread's slot's row, for every token.
    const int tpr = 1 << tpr_log2, slot = threadIdx.x >> tpr_log2, p = threadIdx.x & (tpr - 1);
    const long long row = (long long)blockIdx.x * (ROUTE_THREADS >> tpr_log2) + slot;
    const int nrows = row < e + (Wg ? 1 : 0) ? 1 : 0;
    const int kv = h >> 3;
    const int kend = nrows ? kv : 0;
    const uint4* w4 = row < e ? (const uint4*)W + row * kv : (const uint4*)(nrows ? Wg : W);
    const uint4* x4 = (const uint4*)X;
    float acc[1][M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[0][m] = 0.0f;
#pragma unroll 4
    for (int c = p; c < kend; c += tpr) {
        float wf[8];
        unpack8(__ldcs(w4 + c), wf);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xf[8];
            unpack8(__ldg(x4 + (size_t)m * kv + c), xf);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[0][m] = fmaf(wf[j], xf[j], acc[0][m]);
        }
    }
    gemv_slot_sum<1, M, float>(acc, red, logits, e, row, nrows, 1, tpr_log2, p);

    // The last block to finish (every block's logits then visible to it) routes every token.
    if (!last_block_to_arrive(ticket, gridDim.x)) return;
    if (Wg != nullptr && threadIdx.x == 0) logits[e] = bf2f(f2bf(__ldcg(logits + e)));  // M = 1
    router_topk_rows(logits, M, e, k, renorm, ids, weights, pair_ids, sm);
    moe_sort_block(pair_ids, M * k, e, perm, tiles, max_tiles, sort_sh, true);
    if (threadIdx.x == 0) *ticket = 0u;
}

#define ROUTE_ARGS const bf16* W, const bf16* Wg, const bf16* X, float* logits, u32* ids, float* weights, u32* perm, u32* tiles, u32* ticket, int e, int h, int k, int renorm, int max_tiles, int tpr_log2
#define ROUTE_PASS W, Wg, X, logits, ids, weights, perm, tiles, ticket, e, h, k, renorm, max_tiles, tpr_log2
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS, 2) moe_route_decode_m1(ROUTE_ARGS) {
    pdl_prologue_prefetch(route_rows(W, e, h, tpr_log2));
    moe_route_decode_impl<1>(ROUTE_PASS);
}
#undef ROUTE_ARGS
#undef ROUTE_PASS
