// The pieces of a persistent layer launch (moe_layer.cu, gdn_layer.cu): one cooperative grid of as many
// blocks as the multiprocessors hold works through a layer's phases, separated by grid-wide barriers
// on a counter (sync[0]: barrier p waits for p · gridDim.x arrivals; sync[1] counts the blocks past
// their last barrier, the last of which sets both back to 0). Data a phase writes is read by other
// blocks only after a barrier and only through L2 (__ldcg). Here: the barrier, the phase trace, x
// staged in shared memory (or normed while staged: MlNormIn), a warp's packed-row dots, and the
// residual add and RMSNorm of a row the grid computed a warp a value (or its blocks' sums of squares
// left to the next launch).
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

// The RMSNorm of a row that the launch before left to this one, which norms the row while it stages
// it: a layer launch's residual (its grid's last phase wrote the residual `acc` and each block's sum
// of squares, partials[0 .. blocks), and no normed row), or (`partials` null) a row `acc` written
// whole, whose sum of squares this launch takes as rms_norm_bf16 (norm.cu) does for one row of its
// width, `blocks` being that launch's threads a row (a power of two ≤ 256). `acc` null: the input
// row is ready (x). `MlNormIn` in crates/cuda/src/ops/layer.rs, field for field.
struct MlNormIn {
    const bf16* acc;        // [h] the residual, or the row to norm
    const float* partials;  // [blocks] or null
    const bf16* w;          // [h] the norm's weight
    int blocks;
    float eps, offset;
};

// rsqrt(mean + eps) of the row whose `blocks` blocks' sums of squares are in partials: summed in block
// order, a thread the blocks t, t + blockDim.x, ..., then over the block (the same sums in the same
// order wherever it runs, so every launch that norms a row gets the same bits). Every thread calls it.
__device__ __forceinline__ float ml_rnorm(const float* partials, int blocks, int h, float eps) {
    __shared__ float scratch[32];
    float ss = 0.0f;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) ss += __ldcg(partials + b);
    ss = block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)h + eps);
}

// rsqrt(mean + eps) of the h-value row `acc` as rms_norm_bf16 takes it for one row with tpr threads
// (norm.cu: rms_norm_rows and slot_sum): thread t < tpr sums the squares of chunks t, t + tpr, ...
// (8 values each, in order), the sums go through the same shuffles, and over the slot's warps in
// order. The same bits as that launch. Every thread calls it (tpr ≤ blockDim.x).
__device__ __forceinline__ float ml_rnorm_row(const bf16* acc, int tpr, int h, float eps) {
    __shared__ float red[8];
    const int t = threadIdx.x, n8 = h >> 3;
    float ss = 0.0f;
    if (t < tpr) {
#pragma unroll 1
        for (int c = t; c < n8; c += tpr) {
            float f[8];
            unpack8(__ldcg((const uint4*)acc + c), f);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < tpr) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (tpr > 32) {
        if ((t & 31) == 0 && t < tpr) red[t >> 5] = ss;
        __syncthreads();
        ss = 0.0f;
        for (int i = 0; i < (tpr >> 5); ++i) ss += red[i];
    } else {
        // Only the slot's lanes hold the sum (every one of them the same bits): thread 0's to all.
        if (t == 0) red[0] = ss;
        __syncthreads();
        ss = red[0];
    }
    __syncthreads();
    return 1.0f / sqrtf(ss / (float)h + eps);
}

// rsqrt(mean + eps) of the row an MlNormIn describes (acc not null). Every thread calls it.
__device__ __forceinline__ float ml_in_rnorm(const MlNormIn& in, int h) {
    return in.partials != nullptr ? ml_rnorm(in.partials, in.blocks, h, in.eps)
                                  : ml_rnorm_row(in.acc, in.blocks, h, in.eps);
}

// Eight normed values of the residual (acc chunk a, weight chunk w) as bf16: bf16(res · rn · (offset
// + w)), ml_norm_rows' rounding.
__device__ __forceinline__ uint4 ml_norm8(uint4 a, uint4 w, float rn, float offset) {
    float af[8], wf[8];
    unpack8(a, af);
    unpack8(w, wf);
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        o[i] = pack_bf16x2((af[2 * i] * rn) * (offset + wf[2 * i]), (af[2 * i + 1] * rn) * (offset + wf[2 * i + 1]));
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// Most 16-byte chunks of the row a thread loads before the norm's sum (h ≤ 8 · ML_NORM_CHUNKS ·
// ML_THREADS values ahead; the rest after it).
#define ML_NORM_CHUNKS 2

// The input row into xs (ml_stage_x's order): x, or (in.acc) the norm of in.acc, which block 0 also
// writes to x (global) for any later reader of the row. The row's and weight's chunks are asked for
// before the norm's sum. Every thread calls it.
__device__ __forceinline__ void ml_stage_in(bf16* xs, const bf16* x, const MlNormIn& in, int h) {
    if (in.acc == nullptr) {
        ml_stage_x(xs, x, h);
        return;
    }
    const int n8 = h >> 3;
    uint4 av[ML_NORM_CHUNKS], wv[ML_NORM_CHUNKS];
#pragma unroll
    for (int i = 0; i < ML_NORM_CHUNKS; ++i) {
        const int q = threadIdx.x + i * blockDim.x;
        if (q < n8) {
            av[i] = __ldcg((const uint4*)in.acc + q);
            wv[i] = __ldg((const uint4*)in.w + q);
        }
    }
    const float rn = ml_in_rnorm(in, h);
#pragma unroll
    for (int i = 0; i < ML_NORM_CHUNKS; ++i) {
        const int q = threadIdx.x + i * blockDim.x;
        if (q < n8) {
            const uint4 v = ml_norm8(av[i], wv[i], rn, in.offset);
            ((uint4*)xs)[ml_xs_chunk(q)] = v;
            if (blockIdx.x == 0) ((uint4*)x)[q] = v;
        }
    }
    for (int q = threadIdx.x + ML_NORM_CHUNKS * blockDim.x; q < n8; q += blockDim.x) {
        const uint4 v = ml_norm8(__ldcg((const uint4*)in.acc + q), __ldg((const uint4*)in.w + q), rn, in.offset);
        ((uint4*)xs)[ml_xs_chunk(q)] = v;
        if (blockIdx.x == 0) ((uint4*)x)[q] = v;
    }
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

// The block's sum of the squares its warps' lane 0 hold (sq) into partials[blockIdx.x]. Every thread
// calls it.
__device__ __forceinline__ void ml_block_sq(float sq, float* partials) {
    __shared__ float s_sq[ML_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s_sq[warp] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < ML_WARPS; ++w) t += s_sq[w];
        partials[blockIdx.x] = t;
    }
}

// The RMSNorm of the h-value row the grid's warps added (ml_add_row: warp gw of nw holds rows gw + j·nw
// in s_res[warp][j], lane 0's sq their squares): each block's sum into partials[blockIdx.x]; then,
// with `normed`, the grid barrier `target` and every block sums the partials in block order
// (ml_rnorm) and writes normed[r] = bf16(res · rsqrt(mean + eps) · (offset + w[r])) for its rows.
// Without `normed` the norm is the next launch's (MlNormIn: the partials are its input, no barrier
// here). Every thread calls it.
__device__ __forceinline__ void ml_norm_rows(float sq, const float (*s_res)[ML_MAXROWS], float* partials, u32* sync,
                                             u32 target, int h, float eps, float offset, const bf16* norm_w,
                                             bf16* normed, int gw, int nw, unsigned long long* last) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The norm weights of the warp's rows, asked for before the barrier (no kernel writes them).
    float wv[ML_MAXROWS];
#pragma unroll
    for (int j = 0; j < ML_MAXROWS; ++j) {
        const int r = gw + j * nw;
        wv[j] = normed != nullptr && lane == 0 && r < h ? bf2f(norm_w[r]) : 0.0f;
    }
    ml_block_sq(sq, partials);
    if (normed == nullptr) return;
    ml_grid_sync(sync, target, last);
    const float rn = ml_rnorm(partials, gridDim.x, h, eps);
    if (lane == 0) {
#pragma unroll 1
        for (int j = 0; j < ML_MAXROWS; ++j) {
            const int r = gw + j * nw;
            if (r >= h) break;
            normed[r] = f2bf((s_res[warp][j] * rn) * (offset + wv[j]));
        }
    }
}
