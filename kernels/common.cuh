// Shared device helpers for every kernel file: bf16 conversion, 16-byte vector unpacking, warp and block
// reductions, and the scalar activations in the form the CPU oracle computes them.
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000u)

// Programmatic dependent launch (sm_90 and later): every kernel opens with this statement. It waits
// until the kernel ahead of it on the stream has finished and its writes are visible (the host launches
// kernels with programmatic stream serialization, so this kernel's blocks may already be resident while
// that one drains), then lets the next kernel's blocks be scheduled the same way. A no-op on older
// architectures and for kernels launched the ordinary way.
__device__ __forceinline__ void pdl_prologue() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Bytes of an L2 prefetch request (one per thread of a block's first warp, as many rounds as needed).
#define PDL_PREFETCH_PIECE 32768

// L2 asked for bytes [p, p + bytes) (whole 16-byte units inside the range; nothing when bytes ≤ 0) by the
// block's first warp, one request of PDL_PREFETCH_PIECE bytes a thread a round. sm_90 and later (a
// no-op before).
__device__ __forceinline__ void l2_prefetch(const void* p, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned long long a0 = ((unsigned long long)p + 15) & ~15ull;
    const unsigned long long a1 = bytes > 0 ? ((unsigned long long)p + bytes) & ~15ull : 0;
    if (threadIdx.x < 32)
#pragma unroll 1
        for (unsigned long long a = a0 + threadIdx.x * (unsigned long long)PDL_PREFETCH_PIECE; a < a1;
             a += 32ull * PDL_PREFETCH_PIECE) {
            const unsigned size = (unsigned)min((unsigned long long)PDL_PREFETCH_PIECE, a1 - a);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(size) : "memory");
        }
#endif
}

// pdl_prologue, first asking L2 for bytes [p, p + bytes) of data no kernel writes (the weight rows a GEMV
// block reads): the fetch overlaps the kernel ahead instead of following it.
__device__ __forceinline__ void pdl_prologue_prefetch(const void* p, long long bytes) {
    l2_prefetch(p, bytes);
    pdl_prologue();
}

// The segment table of a GEMV launch: up to GEMV_SEGS weights that read the same X, each with its own
// output, in one grid. Segment i owns blocks [block0_i, block0_{i+1}) (whole blocks: a block serves one
// weight); an unused segment has block0 = INT_MAX. w: the weight (bf16 or packed u32 words), s: its
// scales (packed only), y: the output [m, n], rps and tpr_log2: the row-slot cut of its rows (unused by
// the tensor-core GEMVs). Matches `GemvSeg` / `GemvSegs` in crates/cuda/src/ops/gemv.rs.
#define GEMV_SEGS 4
struct GemvSeg {
    const void* w;
    const float* s;
    void* y;
    int n;
    int block0;
    int rps;
    int tpr_log2;
};
struct GemvSegs {
    GemvSeg seg[GEMV_SEGS];
};

// The segment this block serves (the last whose first block is at or below blockIdx.x). Unrolled to
// constant indices, so the table stays in the parameter space.
__device__ __forceinline__ GemvSeg gemv_seg(const GemvSegs& t) {
    GemvSeg s = t.seg[0];
#pragma unroll
    for (int j = 1; j < GEMV_SEGS; ++j)
        if ((int)blockIdx.x >= t.seg[j].block0) s = t.seg[j];
    return s;
}
// This block's index inside its segment.
__device__ __forceinline__ int gemv_seg_block(const GemvSeg& s) { return (int)blockIdx.x - s.block0; }

// Bytes [p, p + bytes) of the weight rows one GEMV block reads.
struct RowSpan {
    const void* p;
    long long bytes;
};

// pdl_prologue_prefetch of a block's weight rows.
__device__ __forceinline__ void pdl_prologue_prefetch(RowSpan r) { pdl_prologue_prefetch(r.p, r.bytes); }

// The weight rows of row-slot GEMV block `block` of a segment (256 threads in slots of 2^tpr_log2
// threads, rps rows a slot, row_bytes a row): none for a block past n.
__device__ __forceinline__ RowSpan gemv_slot_span(const GemvSeg& s, long long row_bytes) {
    const long long per = (long long)(256 >> s.tpr_log2) * s.rps;
    const long long r0 = (long long)gemv_seg_block(s) * per;
    const long long rows = r0 < s.n ? min(per, (long long)s.n - r0) : 0;
    return RowSpan{(const char*)s.w + r0 * row_bytes, rows * row_bytes};
}
// The same for a tensor-core GEMV block of 16 rows.
__device__ __forceinline__ RowSpan gemv_tile_span(const GemvSeg& s, long long row_bytes) {
    const long long r0 = (long long)gemv_seg_block(s) * 16;
    const long long rows = r0 < s.n ? min(16LL, (long long)s.n - r0) : 0;
    return RowSpan{(const char*)s.w + r0 * row_bytes, rows * row_bytes};
}

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }
// Two f32 as bf16 (each rounded once) in one word, lo in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    const bf16 l = f2bf(lo), h = f2bf(hi);
    return (u32)__bfloat16_as_ushort(l) | ((u32)__bfloat16_as_ushort(h) << 16);
}

// Eight bf16 values packed in a 16-byte vector, widened to f32.
__device__ __forceinline__ void unpack8(const uint4 v, float out[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// Inclusive scans of two counts across a warp: lane i ends with the sums over lanes 0 … i.
__device__ __forceinline__ void warp_inclusive_scan2(u32& a, u32& b) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int o = 1; o < 32; o <<= 1) {
        const u32 x = __shfl_up_sync(0xffffffffu, a, o), y = __shfl_up_sync(0xffffffffu, b, o);
        if (lane >= o) {
            a += x;
            b += y;
        }
    }
}

// Warp and block reductions of any value the shuffles carry (float, double, u32) under a combine Op
// (SumOp, MaxOp). block_reduce: blockDim.x a multiple of 32, at most 1024; every thread gets the result;
// `scratch` is 32 values of shared memory, `idle` the value of the lanes past the block's warps; the call
// ends with a barrier, so the scratch can be reused.
struct SumOp {
    template <typename T>
    __device__ __forceinline__ static T apply(T a, T b) { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ static float apply(float a, float b) { return fmaxf(a, b); }
};

template <typename Op, typename T>
__device__ __forceinline__ T warp_reduce(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <typename Op, typename T>
__device__ __forceinline__ T block_reduce(T v, T* scratch, T idle) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce<Op>(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    T t = lane < nwarps ? scratch[lane] : idle;
    t = warp_reduce<Op>(t);
    __syncthreads();
    return t;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce<SumOp>(v); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce<MaxOp>(v); }
// Sum and max over the block (see block_reduce); `scratch` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<SumOp>(v, scratch, 0.0f); }

// The last-block pattern: `blocks` blocks that count themselves in on one counter, the last of them to
// arrive doing the final part. Every thread's writes are published (its fence, then thread 0's after
// the barrier), then thread 0 draws a ticket; its fence after the draw orders every block's writes
// before the last block's reads (which must go through L2, __ldcg, never a stale L1 line). True in the
// block that drew the last ticket, which must reset the counter to 0 when done. counter: 0 at launch;
// the launch ahead of the next user of the counter has finished by then (programmatic dependent launch
// waits for it before any block touches memory), so one counter serves every such launch of a stream.
// The whole block calls it.
__device__ __forceinline__ bool last_block_to_arrive(u32* counter, u32 blocks) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter, 1u) == blocks - 1;
        __threadfence();
    }
    __syncthreads();
    return last;
}
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<MaxOp>(v, scratch, NEG_INF); }

// x · sigmoid(x) as torch computes it: x / (1 + exp(-x)).
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
// log(1 + exp(x)), x itself above 20 (torch's threshold).
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Stores v to y[i] as OUT (bf16: rounded once to nearest even).
template <typename OUT>
__device__ __forceinline__ void store_out(OUT* y, size_t i, float v);
template <>
__device__ __forceinline__ void store_out<bf16>(bf16* y, size_t i, float v) { y[i] = f2bf(v); }
template <>
__device__ __forceinline__ void store_out<float>(float* y, size_t i, float v) { y[i] = v; }

// Sums a slot's partial dot products and stores rows row0 .. row0 + nrows of Y (R rows by M columns of
// acc; only the first rps rows are live). Shuffles over the lanes of one slot (offsets below tpr), then,
// for a slot wider than a warp, through shared memory `red` ([8][R][M]): one thread per (row, column) of
// the slot's first warp sums the warps' values, so the cross-warp step costs 8 shared loads whatever M
// is (not R·M·8 in one thread).
template <int R, int M, typename OUT>
__device__ __forceinline__ void gemv_slot_sum(float (&acc)[R][M], float (*red)[R][M], OUT* __restrict__ Y,
                                              int n, long long row0, int nrows, int rps, int tpr_log2, int p) {
    const int tpr = 1 << tpr_log2;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= rps) continue;  // uniform over the block
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                if (o < tpr) v += __shfl_xor_sync(0xffffffffu, v, o);
            acc[r][m] = v;
        }
    }
    if (tpr <= 32) {
        if (p == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r < nrows)
#pragma unroll
                    for (int m = 0; m < M; ++m) store_out<OUT>(Y, (size_t)m * n + row0 + r, acc[r][m]);
        }
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r < rps)
#pragma unroll
                for (int m = 0; m < M; ++m) red[warp][r][m] = acc[r][m];
    __syncthreads();
    // p < rps · M ≤ 32: a thread of the slot's first warp (its warp index is the slot's first).
    if (p < rps * M) {
        const int r = p / M, m = p - r * M, nw = tpr >> 5;
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < nw) v += red[warp + i][r][m];
        if (r < nrows) store_out<OUT>(Y, (size_t)m * n + row0 + r, v);
    }
}

// The input row of pair p of a grouped expert launch: p / x_div (pair p = token·top_k + choice reads
// its token's row when x_div is top_k, its own row when 1), or p - x_tail for the pairs at or past
// x_tail (the shared expert's pairs, one a token after the routed ones, when the launch reads token
// rows; x_tail is u32 max otherwise).
__device__ __forceinline__ u32 moe_x_row(u32 p, int x_div, u32 x_tail) {
    return p >= x_tail ? p - x_tail : p / (u32)x_div;
}

// Values 8u .. 8u + 7 of bf16(silu(gate) · up) for a gate|up row gu (gate then up, k values each, as
// uint4 chunks of 8 bf16; per = k / 8), computed as swiglu_bf16 computes them: the down projections
// that stage their own SwiGLU input.
__device__ __forceinline__ uint4 swiglu8(const uint4* __restrict__ gu, int per, int u) {
    float gf[8], uf[8];
    unpack8(__ldg(gu + u), gf);
    unpack8(__ldg(gu + per + u), uf);
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        o[i] = pack_bf16x2(silu_f(gf[2 * i]) * uf[2 * i], silu_f(gf[2 * i + 1]) * uf[2 * i + 1]);
    return make_uint4(o[0], o[1], o[2], o[3]);
}
