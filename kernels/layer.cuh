// The pieces of a persistent layer launch (moe_layer.cu, gdn_layer.cu): one cooperative grid of as many
// blocks as the multiprocessors hold works through a layer's phases, separated by grid-wide barriers
// on a counter (sync[0]: barrier p waits for p · gridDim.x arrivals; sync[1] counts the blocks past
// their last barrier, the last of which sets both back to 0). Data a phase writes is read by other
// blocks only after a barrier and only through L2 (__ldcg). Here: the barrier, the phase trace, x
// staged in shared memory, a warp's packed-row dots, and the residual add and RMSNorm of a row the
// grid computed a warp a value.
#pragma once
#include "packed.cuh"

#define ML_THREADS 256
#define ML_WARPS (ML_THREADS / 32)
// Rows of the output a warp takes at most in a row phase (h ≤ ML_MAXROWS · the grid's warps; the
// launchers check).
#define ML_MAXROWS 4

// Phase time `i` of block 0 into trace (when given: the device's global timer, ns).
__device__ __forceinline__ void ml_mark(unsigned long long* trace, int i) {
    if (trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        trace[i] = t;
    }
}

// A block's entry, before its PDL wait (when given a trace): block 0's time into slot 14, the latest
// block's into slot 15 (each replay's entries are later than the last's, so a max keeps this one's).
__device__ __forceinline__ void ml_entered(unsigned long long* trace) {
    if (trace != nullptr && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (blockIdx.x == 0) trace[14] = t;
        atomicMax(trace + 15, t);
    }
}

// A grid-wide barrier: every block's writes before it are visible to every block after it (through
// L2). `target`: the arrivals that complete this barrier (phase · gridDim.x). The block's barrier
// orders its threads' writes before thread 0's release-add, whose acquire loads see the others'
// (the pattern of CUTLASS's grid barrier: no fence beside the release and acquire). `last`, when
// given: the global time at which the last block arrived (the phase trace).
__device__ __forceinline__ void ml_grid_sync(u32* count, u32 target, unsigned long long* last = nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 old;
        asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
        if (last != nullptr && old == target - 1) {
            unsigned long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            *last = t;
        }
        u32 seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
        } while (seen < target);
    }
    __syncthreads();
}

// Trace slot 10 + p: when the last block arrived at barrier p (0-based), or null without a trace.
__device__ __forceinline__ unsigned long long* ml_last(unsigned long long* trace, int p) {
    return trace != nullptr ? trace + 10 + p : nullptr;
}

// Once every block is past its last barrier, the counters back to 0 (the last block's thread 0; trace
// slot 9 gets its time).
__device__ __forceinline__ void ml_finish(u32* sync, unsigned long long* trace) {
    if (threadIdx.x == 0 && atomicAdd(sync + 1, 1u) == gridDim.x - 1) {
        sync[0] = 0u;
        sync[1] = 0u;
        if (trace != nullptr) {
            unsigned long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            trace[9] = t;
        }
    }
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

// Where 16-byte chunk q (values 8q .. 8q + 7) of the block's copy of x lies: the chunks of each unit
// of 32 values permuted by a XOR with bits 3..4 of q, so that the 8 lanes of a quarter-warp reading
// chunk c of units u .. u + 7 (64 bytes apart) hit 8 distinct 16-byte bank groups.
__device__ __forceinline__ int ml_xs_chunk(int q) { return (q & ~3) | ((q & 3) ^ ((q >> 3) & 3)); }

// n values of x (global, 16-byte aligned, n % 8 == 0) into xs (shared memory) in ml_xs_chunk's order.
__device__ __forceinline__ void ml_stage_x(bf16* xs, const bf16* x, int n) {
    for (int q = threadIdx.x; q < (n >> 3); q += blockDim.x) ((uint4*)xs)[ml_xs_chunk(q)] = ((const uint4*)x)[q];
}

// The lane's part of row · x: per unit the codes' dot with x (f32), times the unit's scale. x: bf16 in
// shared memory, in ml_xs_chunk's order when SWZ.

template <int BITS, int G, int MAXU, bool SWZ>
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
                const int q8 = 4 * u + c;
                unpack8(((const uint4*)x)[SWZ ? ml_xs_chunk(q8) : q8], xf);
#pragma unroll
                for (int j = 0; j < 8; ++j) d = fmaf(q[j], xf[j], d);
            }
            acc = fmaf(d, r.s[i], acc);
        }
    }
    return acc;
}

// ml_dot of N rows with one x (the same sums, in the same order, for each row), each 16-byte chunk of
// x unpacked once for all N rows: out[n] is row n's part.
template <int BITS, int G, int MAXU, bool SWZ, int N>
__device__ __forceinline__ void ml_dots(const MlRow<BITS, MAXU> (&r)[N], const bf16* x, int k, int sub, float (&out)[N]) {
    const int units = k >> 5;
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = 0.0f;
#pragma unroll
    for (int i = 0; i < MAXU; ++i) {
        const int u = sub + i * G;
        if (u < units) {
            float d[N];
#pragma unroll
            for (int n = 0; n < N; ++n) d[n] = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float xf[8];
                const int q8 = 4 * u + c;
                unpack8(((const uint4*)x)[SWZ ? ml_xs_chunk(q8) : q8], xf);
#pragma unroll
                for (int n = 0; n < N; ++n) {
                    float q[8];
                    decode8<BITS>(r[n].w[i], c, q);
#pragma unroll
                    for (int j = 0; j < 8; ++j) d[n] = fmaf(q[j], xf[j], d[n]);
                }
            }
#pragma unroll
            for (int n = 0; n < N; ++n) out[n] = fmaf(d[n], r[n].s[i], out[n]);
        }
    }
}

// The residual add of output row r's sum v (lane 0 of the row's warp; res = acc[r], loaded early),
// rounded as add_rms_norm_row: acc[r] = bf16(res + v), kept in `kept` for ml_norm_rows; returns its
// square.
__device__ __forceinline__ float ml_add_row(bf16* acc, int r, float res, bf16 v, float& kept) {
    const bf16 t = f2bf(res + bf2f(v));
    acc[r] = t;
    kept = bf2f(t);
    return kept * kept;
}

// The RMSNorm of the h-value row the grid's warps added (ml_add_row: warp gw of nw holds rows gw + j·nw
// in s_res[warp][j], lane 0's sq their squares): each block's sum into partials[blockIdx.x], the grid
// barrier `target`, then every block sums the partials in block order (deterministic) and writes
// normed[r] = bf16(res · rsqrt(mean + eps) · (offset + w[r])) for its rows. Every thread calls it.
__device__ __forceinline__ void ml_norm_rows(float sq, const float (*s_res)[ML_MAXROWS], float* partials, u32* sync,
                                             u32 target, int h, float eps, float offset, const bf16* norm_w,
                                             bf16* normed, int gw, int nw, unsigned long long* last) {
    __shared__ float s_sq[ML_WARPS];
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The norm weights of the warp's rows, asked for before the barrier (no kernel writes them).
    float wv[ML_MAXROWS];
#pragma unroll
    for (int j = 0; j < ML_MAXROWS; ++j) {
        const int r = gw + j * nw;
        wv[j] = lane == 0 && r < h ? bf2f(norm_w[r]) : 0.0f;
    }
    if (lane == 0) s_sq[warp] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < ML_WARPS; ++w) t += s_sq[w];
        partials[blockIdx.x] = t;
    }
    ml_grid_sync(sync, target, last);
    float ss = 0.0f;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) ss += __ldcg(partials + b);
    ss = block_sum(ss, scratch);
    const float rn = 1.0f / sqrtf(ss / (float)h + eps);
    if (lane == 0) {
#pragma unroll 1
        for (int j = 0; j < ML_MAXROWS; ++j) {
            const int r = gw + j * nw;
            if (r >= h) break;
            normed[r] = f2bf((s_res[warp][j] * rn) * (offset + wv[j]));
        }
    }
}
