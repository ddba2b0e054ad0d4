// The VRAM row cache of a QSA layer whose K/V rows live in pinned host memory (--qsa-kv-offload): the
// device state and the first two of its three phases (the third is the cached form of qsa_attn_partial
// in qsa.cu). The CPU twin, whose state transitions these kernels reproduce exactly, is
// sanmai_cpu::ops::row_cache::RowCache; crates/cuda/src/ops/row_cache.rs documents the whole design.
//
// State of one layer's cache of L lines (all on the device, so a recorded CUDA graph replays without
// host parameters):
//   tags    [L] u64: slot + 1 of the row a line holds, 0 when empty (slot = table[pos / bs]·bs + pos % bs,
//                    the PHYSICAL cache slot; slot s lives in line s % L);
//   hitmark [L] u32: the epoch of the last step that hit the line;
//   claim   [L] u64: (epoch << 32) | slot of the largest miss that claimed the line this step or before;
//   epoch   [1] u32: 0 at first, step n runs under epoch n; at u32::MAX the next step zeroes hitmarks and
//                    claims and restarts at 1;
//   stats   [2] u64: row reads served by the cache (hits) and by host memory (misses);
//   rows k, v [L, hkv·d] bf16 (read and filled by the attention).
// Line indices are 32-bit: the host keeps 1 ≤ L ≤ u32::MAX.
#include "common.cuh"

typedef unsigned long long u64;

// Phase 1, once per layer and step, after every store of the step: empties the line of every slot in
// stored[0 .. n) that holds that slot (the step's K/V write destinations, kv_dst, read on the device;
// a destination past the pool is harmless), then advances the epoch. One block (the host launches
// exactly one): the invalidation loop, then a barrier, then thread 0 bumps the epoch, so no thread
// reads the epoch after it changed. At the wrap (the epoch is u32::MAX) every hitmark and claim is
// zeroed first and the epoch restarts at 1; tags and rows stay valid, as the twin's invalidate.
// Stores of 0 only, each to a line that held the stored slot: concurrent threads agree.
extern "C" __global__ void __launch_bounds__(1024) qsa_rc_invalidate(const u32* __restrict__ stored, int n,
                                                                     u64* __restrict__ tags,
                                                                     u32* __restrict__ hitmark,
                                                                     u64* __restrict__ claim,
                                                                     u32* __restrict__ epoch, long long lines) {
    pdl_prologue();
    const u32 L = (u32)lines;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const u32 s = stored[i];
        const u32 line = s % L;
        if (tags[line] == (u64)s + 1) tags[line] = 0;
    }
    const u32 e = *epoch;
    if (e == 0xffffffffu) {
        for (long long l = threadIdx.x; l < lines; l += blockDim.x) {
            hitmark[l] = 0;
            claim[l] = 0;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *epoch = e == 0xffffffffu ? 1u : e + 1u;
}

// Empties the line of every slot base .. base + n that holds it, WITHOUT advancing the epoch: the
// destination rows of a copy_block (a K/V block reused or forked between steps) change outside the
// step's own K/V write. It runs between steps, before the next step's qsa_rc_invalidate, so it is the
// twin's invalidate of those slots folded into that step's (clearing tags is idempotent and nothing
// reads the cache in between). Grid ceil(n / blockDim), one thread a slot.
extern "C" __global__ void qsa_rc_invalidate_range(u32 base, int n, u64* __restrict__ tags, long long lines) {
    pdl_prologue();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32 s = base + (u32)i;
    const u32 line = s % (u32)lines;
    if (tags[line] == (u64)s + 1) tags[line] = 0;
}

// Phase 2, decode-shaped steps only, after qsa_rc_invalidate and before the cached attention: every row
// the attention will read records a hit or a claim. Grid (ceil(sel_stride / blockDim), rows), one thread
// per (row r, j < min(counts[r], sel_stride)): pos = sel[r·sel_stride + j], slot through the block table
// tables + r·table_stride (the decode form of qsa_attn_partial), line = slot % L. A line holding the slot
// (tag == slot + 1) is hit: hitmark = epoch (every writer stores the same value); otherwise the read
// claims the line: claim = max(claim, (epoch << 32) | slot). Tags are not written, so every thread sees
// the state phase 1 left. Counts every read, duplicates included, into stats (hits, misses), as the
// twin's read does: per warp by ballot, per block in shared memory, one atomic add per block.
extern "C" __global__ void qsa_rc_plan(const u32* __restrict__ tables, long long table_stride,
                                       const u32* __restrict__ sel, int sel_stride, const u32* __restrict__ counts,
                                       int bs, const u64* __restrict__ tags, u32* __restrict__ hitmark,
                                       u64* __restrict__ claim, const u32* __restrict__ epoch,
                                       u64* __restrict__ stats, long long lines) {
    pdl_prologue();
    __shared__ u32 n_hit, n_miss;
    const int r = blockIdx.y;
    const int n = (int)min(counts[r], (u32)sel_stride);
    // Uniform over the block: no thread reaches the barriers below when one returns here.
    if ((long long)blockIdx.x * blockDim.x >= n) return;
    if (threadIdx.x == 0) {
        n_hit = 0;
        n_miss = 0;
    }
    __syncthreads();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const bool reads = j < n;
    bool hit = false;
    if (reads) {
        const u32 p = sel[(size_t)r * sel_stride + j];
        const u32* table = tables + (size_t)r * table_stride;
        const u32 slot = (u32)((size_t)table[p / bs] * bs + p % bs);
        const u32 line = slot % (u32)lines;
        const u32 e = *epoch;
        hit = tags[line] == (u64)slot + 1;
        if (hit)
            hitmark[line] = e;
        else
            atomicMax(&claim[line], ((u64)e << 32) | slot);
    }
    const u32 hits = __ballot_sync(0xffffffffu, reads && hit);
    const u32 misses = __ballot_sync(0xffffffffu, reads && !hit);
    if ((threadIdx.x & 31) == 0) {
        if (hits) atomicAdd(&n_hit, (u32)__popc(hits));
        if (misses) atomicAdd(&n_miss, (u32)__popc(misses));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (n_hit) atomicAdd(&stats[0], (u64)n_hit);
        if (n_miss) atomicAdd(&stats[1], (u64)n_miss);
    }
}
