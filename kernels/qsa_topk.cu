// QSA selection (spec §2): each query row keeps the topk positions of largest index score (what
// qsa_scores / qsa_scores_decode in qsa.cu wrote), NaN below every number, ties to the larger
// position, written in increasing position order. Every form selects the same set as the CPU's
// topk_positions: the set of the topk largest rank keys is unique, however it is found.
//
// - qsa_topk / qsa_topk_decode: one block of 1024 threads a row (a radix select over the row).
// - The wide decode form, for long contexts at small batches, where one block a row leaves the GPU
//   idle: qsa_topk_wide_hist (twice: two 12-bit digits of the score), qsa_topk_wide_collect and
//   qsa_topk_wide_finish. Many blocks a row narrow the threshold to the positions whose score shares
//   its top 24 bits; one block a row finishes among those few and sorts the selection.
#include "common.cuh"

// The score in total order as an unsigned key (NaN as −inf): larger scores give larger keys.
__device__ __forceinline__ u32 score_key(float x) {
    if (isnan(x)) x = NEG_INF;
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The rank key of position s: the score key above the position, so that larger keys rank first and
// equal scores prefer the larger position; keys are unique.
__device__ __forceinline__ unsigned long long rank_key(float x, long long s) {
    return ((unsigned long long)score_key(x) << 32) | (unsigned long long)s;
}

// The digit whose bin holds the need-th largest of the counted keys, by warp 0 (every lane calls it;
// hist holds BINS = 32·PER counts, lane l the digits BINS − 1 − PER·l down to BINS − PER·(l + 1),
// largest first; the digits are scanned from the top down, as a serial scan by one thread would, and
// digit 0 takes what is left). Returns true on the one lane that found it, with the digit in *digit,
// the keys still needed from its bin in *rest and the bin's count in *count.
template <int PER>
__device__ __forceinline__ bool warp_pick(const u32* hist, u32 need, u32* digit, u32* rest, u32* count) {
    constexpr int BINS = 32 * PER;
    const int lane = threadIdx.x & 31;
    const u32* mine = hist + BINS - 1 - PER * lane;  // mine[-j]: the lane's j-th digit from the top
    u32 tot = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) tot += mine[-j];
    u32 incl = tot;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    const u32 excl = incl - tot;
    if (!(excl < need && need <= incl)) return false;
    u32 above = excl;
    int j = 0;
    for (; j < PER - 1; ++j) {
        if (above + mine[-j] >= need) break;
        above += mine[-j];
    }
    *digit = BINS - 1 - PER * lane - j;
    *rest = need - above;
    *count = mine[-j];
    return true;
}

// A radix pass's digit (warp_pick over 256 bins): *prefix = prefix with the digit at shift, *need =
// the keys still needed from its bin, *done = whether its bin holds exactly those (every key of it is
// taken, so the later digits need no pass).
__device__ __forceinline__ void pick_digit(const u32* hist, u32 need, unsigned long long prefix, int shift,
                                           unsigned long long* out_prefix, u32* out_need, bool* done) {
    u32 dgt, rest, count;
    if (warp_pick<8>(hist, need, &dgt, &rest, &count)) {
        *out_prefix = prefix | ((unsigned long long)dgt << shift);
        *out_need = rest;
        *done = count == rest;
    }
}

// The need-th largest of the n keys key_at(0 .. n) by a block of threads (a multiple of 32, every
// thread calls it with the same arguments; need ≤ n): radix passes of 8 bits from bits shift0 + 7 ..
// shift0 down (the keys must agree on every bit above them), stopping once the digit's bin holds
// exactly the keys still needed. The result holds bits shift0 + 7 .. 0 only: a key whose bits
// shift0 + 7 .. 0 are ≥ it is among the need largest, and there are exactly need of them. Counts a warp's lanes of one digit with one shared-memory add (most keys
// share the leading digits).
template <class KeyAt>
__device__ __forceinline__ unsigned long long radix_threshold(long long n, u32 need, int shift0, KeyAt key_at) {
    __shared__ u32 hist[256];
    __shared__ unsigned long long sh_prefix;
    __shared__ u32 sh_need;
    __shared__ bool sh_done;
    const u32 lane = threadIdx.x & 31;
    const long long span = (n + blockDim.x - 1) / blockDim.x * blockDim.x;
    unsigned long long prefix = 0, mask = 0;
    for (int shift = shift0; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        // Every lane runs the same number of iterations (span), so the warp votes below see all 32.
        for (long long i = threadIdx.x; i < span; i += blockDim.x) {
            bool in = false;
            u32 d = 0;
            if (i < n) {
                const unsigned long long k = key_at(i);
                in = (k & mask) == prefix;
                d = (u32)(k >> shift) & 255u;
            }
            if (__ballot_sync(0xffffffffu, in) == 0) continue;
            // Lanes out of play get a value no other lane has, so they group with nobody.
            const u32 peers = __match_any_sync(0xffffffffu, in ? d : 256u + lane);
            if (in && (__ffs(peers) - 1) == (int)lane) atomicAdd(&hist[d], (u32)__popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) pick_digit(hist, need, prefix, shift, &sh_prefix, &sh_need, &sh_done);
        __syncthreads();
        prefix = sh_prefix;
        need = sh_need;
        mask |= 255ull << shift;
        const bool done = sh_done;
        __syncthreads();
        if (done) break;
    }
    return prefix;
}

// One row's selection by a block of 1024 threads: n = min(topk, ctx) positions of sc[0 .. ctx), all
// of them when ctx ≤ topk (sc not read), else the topk largest rank keys (radix_threshold, then an
// in-order compaction). Writes out[0 .. n) in increasing position order and *count = n. Every thread
// of the block calls it with the same ctx.
__device__ __forceinline__ void topk_row(const float* __restrict__ sc, long long ctx, int topk, u32* __restrict__ out,
                                         u32* __restrict__ count) {
    __shared__ u32 warp_n[32];
    if (ctx <= topk) {
        for (long long s = threadIdx.x; s < ctx; s += blockDim.x) out[s] = (u32)s;
        if (threadIdx.x == 0) *count = (u32)ctx;
        return;
    }
    const unsigned long long prefix =
        radix_threshold(ctx, (u32)topk, 56, [&](long long s) { return rank_key(sc[s], s); });
    // prefix is the topk-th largest key: select every key ≥ it, in position order.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 base = 0;
    for (long long c0 = 0; c0 < ctx; c0 += blockDim.x) {
        const long long s = c0 + threadIdx.x;
        const bool take = s < ctx && rank_key(sc[s], s) >= prefix;
        const u32 ball = __ballot_sync(0xffffffffu, take);
        if (lane == 0) warp_n[warp] = __popc(ball);
        __syncthreads();
        u32 before = 0, total = 0;
        for (int i = 0; i < nw; ++i) {
            if (i < warp) before += warp_n[i];
            total += warp_n[i];
        }
        if (take) {
            const u32 at = base + before + __popc(ball & ((1u << lane) - 1u));
            if (at < (u32)topk) out[at] = (u32)s;
        }
        base += total;
        __syncthreads();
    }
    if (threadIdx.x == 0) *count = (u32)topk;
}

// Grid (n_rows); block 1024 threads. Row r (query pos0 + r, ctx = pos0 + r + 1 positions): topk_row
// of scores[r·ld ..] to sel[r·topk ..] and counts[r].
extern "C" __global__ void __launch_bounds__(1024) qsa_topk(const float* __restrict__ scores, long long ld,
                                                            int pos0, int topk, u32* __restrict__ sel,
                                                            u32* __restrict__ counts) {
    pdl_prologue();
    const int r = blockIdx.x;
    topk_row(scores + (size_t)r * ld, (long long)pos0 + r + 1, topk, sel + (size_t)r * topk, counts + r);
}

// The decode form: grid (rows); block 1024 threads. Row r is the one query of sequence r, context
// min(lens[r], max_ctx) read on the device: topk_row of scores[r·ld ..] (what qsa_scores_decode wrote)
// to sel[r·topk ..] and counts[r].
extern "C" __global__ void __launch_bounds__(1024) qsa_topk_decode(const float* __restrict__ scores, long long ld,
                                                                   const u32* __restrict__ lens, long long max_ctx,
                                                                   int topk, u32* __restrict__ sel,
                                                                   u32* __restrict__ counts) {
    pdl_prologue();
    const int r = blockIdx.x;
    const long long ctx = min((long long)lens[r], max_ctx);
    topk_row(scores + (size_t)r * ld, ctx, topk, sel + (size_t)r * topk, counts + r);
}

// ---------------------------------------------------------------------------------------------
// The wide decode form. Work per row, aux [rows, WIDE_AUX] u32, zeroed before the first kernel:
// a 4,096-bin histogram, then the state below; cand [rows, ld] u32 holds candidate positions.
// ---------------------------------------------------------------------------------------------

// Positions a block of the wide passes covers, and its threads.
#define WIDE_CHUNK 2048
#define WIDE_THREADS 256
// Bins of a 12-bit digit.
#define WIDE_BINS 4096
// The state after the histogram (its indices in a row's aux): blocks done with pass 1 and 2, the first digit, the keys needed
// from its bin, the second digit, the keys needed from its bin, positions above the threshold so
// far, candidates so far.
#define WS_DONE1 (WIDE_BINS + 0)
#define WS_DONE2 (WIDE_BINS + 1)
#define WS_D1 (WIDE_BINS + 2)
#define WS_NEED1 (WIDE_BINS + 3)
#define WS_D2 (WIDE_BINS + 4)
#define WS_NEED2 (WIDE_BINS + 5)
#define WS_ABOVE (WIDE_BINS + 6)
#define WS_CAND (WIDE_BINS + 7)
#define WIDE_AUX (WIDE_BINS + 8)
// The largest topk of the wide form (the finishing block sorts the selection in shared memory).
#define WIDE_MAX_TOPK 4096

// Grid (ceil(ld / WIDE_CHUNK), rows), WIDE_THREADS threads; pass 1 or 2. Pass 1 counts the score keys'
// top 12 bits over the row's context, pass 2 the next 12 bits of the keys whose top 12 are the first
// digit. The last block of a row to finish (a counter in the state) picks the digit whose bin holds
// the need-th largest key (need = topk, then the first pass's remainder) and empties the histogram for
// the next pass. Rows with a context of at most topk are left to qsa_topk_wide_finish.
extern "C" __global__ void __launch_bounds__(WIDE_THREADS) qsa_topk_wide_hist(
    const float* __restrict__ scores, long long ld, const u32* __restrict__ lens, long long max_ctx, int topk, int pass,
    u32* __restrict__ aux) {
    pdl_prologue();
    __shared__ u32 h[WIDE_BINS];
    __shared__ bool last;
    const int r = blockIdx.y;
    const long long ctx = min((long long)lens[r], max_ctx);
    if (ctx <= topk) return;  // uniform over the row's blocks
    u32* a = aux + (size_t)r * WIDE_AUX;
    const float* sc = scores + (size_t)r * ld;
    for (int i = threadIdx.x; i < WIDE_BINS; i += blockDim.x) h[i] = 0;
    __syncthreads();
    const u32 d1 = pass == 2 ? a[WS_D1] : 0;
    const u32 lane = threadIdx.x & 31;
    const long long s0 = (long long)blockIdx.x * WIDE_CHUNK;
    for (int i = 0; i < WIDE_CHUNK / WIDE_THREADS; ++i) {
        const long long s = s0 + i * WIDE_THREADS + threadIdx.x;
        bool in = false;
        u32 d = 0;
        if (s < ctx) {
            const u32 k = score_key(sc[s]);
            in = pass == 1 || (k >> 20) == d1;
            d = pass == 1 ? k >> 20 : (k >> 8) & (WIDE_BINS - 1);
        }
        if (__ballot_sync(0xffffffffu, in) == 0) continue;
        const u32 peers = __match_any_sync(0xffffffffu, in ? d : WIDE_BINS + lane);
        if (in && (__ffs(peers) - 1) == (int)lane) atomicAdd(&h[d], (u32)__popc(peers));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < WIDE_BINS; i += blockDim.x)
        if (h[i]) atomicAdd(&a[i], h[i]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&a[pass == 1 ? WS_DONE1 : WS_DONE2], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    // The last block: every other block's counts are in (their fences precede their counter adds).
    __threadfence();
    for (int i = threadIdx.x; i < WIDE_BINS; i += blockDim.x) {
        h[i] = __ldcg(&a[i]);
        a[i] = 0;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const u32 need = pass == 1 ? (u32)topk : a[WS_NEED1];
        u32 dgt, rest, count;
        if (warp_pick<WIDE_BINS / 32>(h, need, &dgt, &rest, &count)) {
            a[pass == 1 ? WS_D1 : WS_D2] = dgt;
            a[pass == 1 ? WS_NEED1 : WS_NEED2] = rest;
        }
    }
}

// Grid (ceil(ld / WIDE_CHUNK), rows), WIDE_THREADS threads, after both passes. With p the two digits
// (the threshold's top 24 bits of score key): a position whose key's top 24 bits exceed p is selected
// (appended to sel[r·topk ..], topk − need2 of them in all), one equal to p is a candidate (appended
// to cand[r·ld ..]). Appends are unordered; qsa_topk_wide_finish orders the selection.
extern "C" __global__ void __launch_bounds__(WIDE_THREADS) qsa_topk_wide_collect(
    const float* __restrict__ scores, long long ld, const u32* __restrict__ lens, long long max_ctx, int topk,
    u32* __restrict__ aux, u32* __restrict__ sel, u32* __restrict__ cand) {
    pdl_prologue();
    const int r = blockIdx.y;
    const long long ctx = min((long long)lens[r], max_ctx);
    if (ctx <= topk) return;
    u32* a = aux + (size_t)r * WIDE_AUX;
    const float* sc = scores + (size_t)r * ld;
    const u32 p = (a[WS_D1] << 12) | a[WS_D2];
    const u32 lane = threadIdx.x & 31, below = (1u << lane) - 1u;
    const long long s0 = (long long)blockIdx.x * WIDE_CHUNK;
    for (int i = 0; i < WIDE_CHUNK / WIDE_THREADS; ++i) {
        const long long s = s0 + i * WIDE_THREADS + threadIdx.x;
        const u32 k = s < ctx ? score_key(sc[s]) >> 8 : 0;
        const bool up = s < ctx && k > p, eq = s < ctx && k == p;
        const u32 bu = __ballot_sync(0xffffffffu, up), be = __ballot_sync(0xffffffffu, eq);
        if (bu) {
            u32 at = 0;
            if (lane == (u32)(__ffs(bu) - 1)) at = atomicAdd(&a[WS_ABOVE], (u32)__popc(bu));
            at = __shfl_sync(0xffffffffu, at, __ffs(bu) - 1);
            if (up) sel[(size_t)r * topk + at + __popc(bu & below)] = (u32)s;
        }
        if (be) {
            u32 at = 0;
            if (lane == (u32)(__ffs(be) - 1)) at = atomicAdd(&a[WS_CAND], (u32)__popc(be));
            at = __shfl_sync(0xffffffffu, at, __ffs(be) - 1);
            if (eq) cand[(size_t)r * ld + at + __popc(be & below)] = (u32)s;
        }
    }
}

// Grid (rows), 1024 threads, after the collect. Row r: every position when its context is at most
// topk; else the need2 largest rank keys among its candidates (all of them when that is all there
// are; else radix_threshold over their low score bits and positions) join the positions above the
// threshold, and the topk positions are sorted (a bitonic sort in shared memory) into sel[r·topk ..];
// counts[r] = how many.
extern "C" __global__ void __launch_bounds__(1024) qsa_topk_wide_finish(
    const float* __restrict__ scores, long long ld, const u32* __restrict__ lens, long long max_ctx, int topk,
    const u32* __restrict__ aux, u32* __restrict__ sel, const u32* __restrict__ cand, u32* __restrict__ counts) {
    pdl_prologue();
    __shared__ u32 pos[WIDE_MAX_TOPK];
    __shared__ u32 n_taken;
    const int r = blockIdx.x;
    const long long ctx = min((long long)lens[r], max_ctx);
    u32* out = sel + (size_t)r * topk;
    if (ctx <= topk) {
        for (long long s = threadIdx.x; s < ctx; s += blockDim.x) out[s] = (u32)s;
        if (threadIdx.x == 0) counts[r] = (u32)ctx;
        return;
    }
    const u32* a = aux + (size_t)r * WIDE_AUX;
    const float* sc = scores + (size_t)r * ld;
    const u32* cd = cand + (size_t)r * ld;
    const u32 n_above = a[WS_ABOVE], n_cand = a[WS_CAND], need = (u32)topk - n_above;
    for (u32 i = threadIdx.x; i < n_above; i += blockDim.x) pos[i] = out[i];
    if (threadIdx.x == 0) n_taken = 0;
    __syncthreads();
    auto key_at = [&](long long i) { return rank_key(sc[cd[i]], cd[i]); };
    // Every candidate when they are exactly what is needed; else the need largest (their keys agree
    // on bits 63 .. 40, the score keys' top 24 bits, so the threshold and the comparison take bits
    // 39 .. 0).
    const unsigned long long low = (1ull << 40) - 1;
    const unsigned long long t = n_cand == need ? 0ull : radix_threshold(n_cand, need, 32, key_at);
    for (u32 i = threadIdx.x; i < n_cand; i += blockDim.x)
        if ((key_at(i) & low) >= t) {
            const u32 at = n_above + atomicAdd(&n_taken, 1u);
            if (at < (u32)topk) pos[at] = cd[i];
        }
    // Pad to a power of two and sort ascending.
    u32 n2 = 1;
    while (n2 < (u32)topk) n2 <<= 1;
    for (u32 i = (u32)topk + threadIdx.x; i < n2; i += blockDim.x) pos[i] = 0xffffffffu;
    __syncthreads();
    for (u32 k = 2; k <= n2; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < n2; i += blockDim.x) {
                const u32 o = i ^ j;
                if (o > i) {
                    const u32 x = pos[i], y = pos[o];
                    if (((i & k) == 0) == (x > y)) {
                        pos[i] = y;
                        pos[o] = x;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (u32 i = threadIdx.x; i < (u32)topk; i += blockDim.x) out[i] = pos[i];
    if (threadIdx.x == 0) counts[r] = (u32)topk;
}
