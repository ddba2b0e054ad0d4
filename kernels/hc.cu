// The hyper-connections' gated residual (spec §4) of a decode step (M ≤ 8 rows) in two kernels:
//   hc_down_inject_silu: s[m, r] = bf16(silu(down[r]·y[m] + inject[r]·x[m]))          s: [M, rank]
//   hc_up_gate_mix:      R[m, j] = bf16(R[m, j] + sigmoid(up[j]·s[m]) · y[m, j % h])    R: [M, S·h]
// and, for one row, the gated residual with the next sublayer's pre-mix and norm in one persistent
// launch (hc_step_m1, below). down [rank, h] and up [S·h, rank] are packed INT8 with one f32 scale per row (compressed-tensors
// channel strategy: value j of a row is the unsigned code q + 128 at bits 8(j%4) of word j/4), inject
// [rank, h] is bf16. Dot products and the gate are f32; each output is rounded once. Requirements
// (checked on the host): h % 32 == 0, rank % 32 == 0, 16-byte aligned buffers.
#include "layer.cuh"
#include "norm.cuh"

// Threads of a hc_down_inject_silu block (one block per output r).
#define HC_DOWN_THREADS 128
// Threads of a hc_up_gate_mix block, and threads per output row j (a row slot).
#define HC_UP_THREADS 256
#define HC_UP_TPR 8

// The 8 INT8 codes of words a (values 0..3) and b (values 4..7) as signed f32: each code becomes the low
// byte of the float 2^23 + code (one byte permute), then the offset is subtracted; exact.
__device__ __forceinline__ void hc_decode8(u32 a, u32 b, float q[8]) {
    const float base = 8388608.0f + 128.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        q[e] = __uint_as_float(__byte_perm(a, 0x4B000000u, 0x7540u | e)) - base;
        q[4 + e] = __uint_as_float(__byte_perm(b, 0x4B000000u, 0x7540u | e)) - base;
    }
}

// Σ_e a[e] · b[e] over 8 values, in order.
__device__ __forceinline__ float hc_dot8(const float a[8], const float b[8]) {
    float t = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) t = fmaf(a[e], b[e], t);
    return t;
}

// Thread t's part of one row r's two dots for M rows (chunks t, t + HC_DOWN_THREADS, ... of h / 8): the
// 8 INT8 codes of down's row (drow) against y, 8 bf16 of inject's (irow) against x, each summed in
// order; the weights read once for all M rows.
template <int M>
__device__ __forceinline__ void hc_down_part(const uint2* __restrict__ drow, const uint4* __restrict__ irow,
                                             const bf16* __restrict__ x, const bf16* __restrict__ y, int h, int t,
                                             float (&accd)[M], float (&acci)[M]) {
    const int chunks = h / 8;
#pragma unroll
    for (int m = 0; m < M; ++m) accd[m] = acci[m] = 0.0f;
#pragma unroll 1
    for (int c = t; c < chunks; c += HC_DOWN_THREADS) {
        const uint2 dw = __ldcs(drow + c);
        float q[8], wi[8];
        hc_decode8(dw.x, dw.y, q);
        unpack8(__ldcs(irow + c), wi);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float yf[8], xf[8];
            unpack8(__ldg((const uint4*)(y + (size_t)m * h) + c), yf);
            unpack8(__ldg((const uint4*)(x + (size_t)m * h) + c), xf);
            accd[m] += hc_dot8(q, yf);
            acci[m] += hc_dot8(wi, xf);
        }
    }
}

// The sums of one unit u (32 values: 8 words w) of an up row against s[m] for M rows, added to acc[m]
// chunk by chunk; s read through L2 when it was written in the same launch (L2).
template <int M, bool L2>
__device__ __forceinline__ void hc_up_unit(const u32 (&w)[8], const bf16* __restrict__ s, int rank, int u,
                                           float (&acc)[M]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        float q[8];
        hc_decode8(w[2 * c], w[2 * c + 1], q);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4* sp = (const uint4*)(s + (size_t)m * rank + u * 32 + c * 8);
            float sf[8];
            unpack8(L2 ? __ldcg(sp) : __ldg(sp), sf);
            acc[m] += hc_dot8(q, sf);
        }
    }
}

// A stream value after the gate mix: r + sigmoid(scale · acc) · y, rounded once.
__device__ __forceinline__ bf16 hc_gated(bf16 r, float scale, float acc, bf16 y) {
    const float gate = sigmoid_f(scale * acc);
    return f2bf(bf2f(r) + gate * bf2f(y));
}

// One block per output r of rank. Thread t takes the 8-value chunks c = t, t + HC_DOWN_THREADS, ... of
// the row: 8 INT8 codes of down (one 8-byte load) against y and 8 bf16 of inject (one 16-byte load)
// against x, for all M rows (each weight chunk read once). The down sum gets the row's scale once; the
// block's sums are reduced through shared memory, and thread m < M writes s[m, r].
template <int M>
__device__ __forceinline__ void hc_down_inject_silu_impl(const u32* __restrict__ down,
                                                         const float* __restrict__ down_scales,
                                                         const bf16* __restrict__ inject,
                                                         const bf16* __restrict__ x, const bf16* __restrict__ y,
                                                         bf16* __restrict__ s, int h, int rank) {
    __shared__ float red[HC_DOWN_THREADS / 32][M];
    const int r = blockIdx.x;
    const uint2* drow = (const uint2*)(down + (size_t)r * (h / 4));
    const uint4* irow = (const uint4*)(inject + (size_t)r * h);
    float accd[M], acci[M];
    hc_down_part<M>(drow, irow, x, y, h, threadIdx.x, accd, acci);
    const float scale = __ldg(down_scales + r);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float v = warp_sum(fmaf(scale, accd[m], acci[m]));
        if (lane == 0) red[warp][m] = v;
    }
    __syncthreads();
    if (threadIdx.x < M) {
        const int m = threadIdx.x;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < HC_DOWN_THREADS / 32; ++w) v += red[w][m];
        s[(size_t)m * rank + r] = f2bf(silu_f(v));
    }
}

// Row slots of HC_UP_TPR threads, one output j = blockIdx.x · (HC_UP_THREADS / HC_UP_TPR) + slot each
// (n = S·h outputs). Thread p of a slot takes the 32-value units p, p + HC_UP_TPR, ... of up's row j
// against s[m] for all M rows; the slot's sums are combined with shuffles (every thread of the slot gets
// them), and thread p = m applies the gate to R[m, j]. A slot past n computes nothing but still takes
// part in the shuffles.
template <int M>
__device__ __forceinline__ void hc_up_gate_mix_impl(const u32* __restrict__ up, const float* __restrict__ up_scales,
                                                    const bf16* __restrict__ s, const bf16* __restrict__ y,
                                                    bf16* __restrict__ streams, int n, int h, int rank) {
    const int slot = threadIdx.x / HC_UP_TPR, p = threadIdx.x % HC_UP_TPR;
    const long long j = (long long)blockIdx.x * (HC_UP_THREADS / HC_UP_TPR) + slot;
    const bool valid = j < n;
    const int units = valid ? rank / 32 : 0;
    const u32* wrow = up + (valid ? j : 0) * (long long)(rank / 4);
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
#pragma unroll 1
    for (int u = p; u < units; u += HC_UP_TPR) {
        u32 w[8];
        PackedUnit<8, true>::load(wrow, u, w);
        hc_up_unit<M, false>(w, s, rank, u, acc);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float v = acc[m];
#pragma unroll
        for (int o = HC_UP_TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[m] = v;
    }
    if (!valid) return;
    const float scale = __ldg(up_scales + j);
    const int col = (int)(j % h);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m != p) continue;
        const size_t i = (size_t)m * n + j;
        streams[i] = hc_gated(streams[i], scale, acc[m], y[(size_t)m * h + col]);
    }
}

// Entry points per row count M (the host picks hc_down_inject_silu_m{M} / hc_up_gate_mix_m{M}). Grids:
// rank blocks of HC_DOWN_THREADS; ceil(n / (HC_UP_THREADS / HC_UP_TPR)) blocks of HC_UP_THREADS. Each
// block first asks L2 for the weight rows it reads (inject's row: two thirds of the down kernel's bytes).
#define HC_DOWN_ARGS                                                                                        \
    const u32 *down, const float *down_scales, const bf16 *inject, const bf16 *x, const bf16 *y, bf16 *s, \
        int h, int rank
#define HC_DOWN_PREFETCH inject + (size_t)blockIdx.x * h, 2LL * h
#define HC_DOWN_CALL down, down_scales, inject, x, y, s, h, rank

extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m1(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<1>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m2(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<2>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m3(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<3>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m4(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<4>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m5(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<5>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m6(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<6>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m7(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<7>(HC_DOWN_CALL); }
extern "C" __global__ void __launch_bounds__(HC_DOWN_THREADS) hc_down_inject_silu_m8(HC_DOWN_ARGS) { pdl_prologue_prefetch(HC_DOWN_PREFETCH); hc_down_inject_silu_impl<8>(HC_DOWN_CALL); }

#define HC_UP_ARGS \
    const u32 *up, const float *up_scales, const bf16 *s, const bf16 *y, bf16 *streams, int n, int h, int rank
#define HC_UP_ROWS (HC_UP_THREADS / HC_UP_TPR)
#define HC_UP_PREFETCH \
    up + (size_t)blockIdx.x * HC_UP_ROWS * (rank / 4), \
        (long long)min(HC_UP_ROWS, n - (int)blockIdx.x * HC_UP_ROWS) * rank
#define HC_UP_CALL up, up_scales, s, y, streams, n, h, rank

extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m1(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<1>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m2(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<2>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m3(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<3>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m4(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<4>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m5(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<5>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m6(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<6>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m7(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<7>(HC_UP_CALL); }
extern "C" __global__ void __launch_bounds__(HC_UP_THREADS) hc_up_gate_mix_m8(HC_UP_ARGS) { pdl_prologue_prefetch(HC_UP_PREFETCH); hc_up_gate_mix_impl<8>(HC_UP_CALL); }

// ---------------------------------------------------------------------------------------------------
// hc_step_m1: one decode row's gated residual, then the next sublayer's pre-mix and RMSNorm, in one
// cooperative grid of ML_THREADS-thread blocks (as many as the multiprocessors hold; layer.cuh's grid
// barrier), each value computed with the operations of the launches it replaces, in their order:
//   1. s = silu(down·y + inject·x): a half-block a row r (hc_down_inject_silu_m1's sums);
//   2. (barrier) a warp a column i: its slot c of HC_UP_TPR lanes takes up's row c·h + i
//      (hc_up_gate_mix_m1's sums) and R_c[i] += sigmoid(·) · y[i]; lane 0 then pre-mixes the new
//      R_c[i] into xn[i] = Σ_c softmax(pre)_c · R_c[i] (hc_premix_bf16's sum);
//   3. (barrier) every block sums the squares of xn as rms_norm_bf16 does for one row (a slot of
//      2^tpr_log2 threads) and writes its share of hn = xn · rsqrt(mean + eps) · (offset + w).
// Up's rows, their scales and R, y of phase 2 are asked for before barrier 1. Needs S ≤ 4
// (= 32 / HC_UP_TPR slots a warp), rank ≤ 32 · HC_UP_TPR · HC_STEP_MAXU, h ≤ HC_STEP_MAXC · the grid's
// warps, h % 8 == 0 and h ≤ 8 · NORM_CHUNKS · 2^tpr_log2 (the host checks).
#define HC_STEP_MAXC 2
#define HC_STEP_MAXU 2

// hc_step_m1's arguments (HcStepArgs in crates/cuda/src/ops/hc.rs, field for field).
struct HcStepArgs {
    const u32* down;
    const float* down_s;
    const bf16* inject;
    const u32* up;
    const float* up_s;
    const float* pre;     // the next sublayer's pre-mix logits [S]
    const bf16* norm_w;   // its norm's weight [h]
    const bf16* x;        // this sublayer's pre-mixed input [h]
    const bf16* y;        // its output [h]
    bf16* streams;        // [S · h], updated in place
    bf16* s;              // [rank]
    bf16* xn;             // the next pre-mixed input [h]
    bf16* hn;             // its norm [h]
    u32* sync;            // two counters, 0 before and after
    unsigned long long* trace;  // [16] or null: block 0's phase times (layer.cuh)
    int h;
    int rank;
    int ns;
    int tpr_log2;
    float eps;
    float offset;
};

// A warp's phase-2 operands for one column, asked for before barrier 1: its slot's units of up's row,
// and (the slot's lane 0) the row's scale, R_c[i] and y[i].
struct HcCol {
    u32 w[HC_STEP_MAXU][8];
    float scale;
    bf16 r, y;
};

__device__ __forceinline__ void hc_col_load(const HcStepArgs& a, int i, int c, int p, HcCol& col) {
    if (c >= a.ns) return;
    const long long j = (long long)c * a.h + i;
    const u32* wrow = a.up + j * (a.rank / 4);
#pragma unroll
    for (int k = 0; k < HC_STEP_MAXU; ++k) {
        const int u = p + k * HC_UP_TPR;
        if (u < a.rank / 32) PackedUnit<8, true>::load(wrow, u, col.w[k]);
    }
    if (p == 0) {
        col.scale = __ldg(a.up_s + j);
        col.r = a.streams[j];
        col.y = __ldg(a.y + i);
    }
}

__device__ __forceinline__ void hc_step(const HcStepArgs& a) {
    __shared__ float red[ML_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * ML_WARPS + warp, nw = gridDim.x * ML_WARPS;
    ml_mark(a.trace, 0);

    // 1. s[r], a half-block (HC_DOWN_THREADS threads) a row; the loop's trip count is the block's.
    {
        constexpr int HALVES = ML_THREADS / HC_DOWN_THREADS;
        const int half = threadIdx.x / HC_DOWN_THREADS, t = threadIdx.x % HC_DOWN_THREADS;
#pragma unroll 1
        for (int r0 = blockIdx.x * HALVES; r0 < a.rank; r0 += gridDim.x * HALVES) {
            const int r = r0 + half;
            float accd[1] = {0.0f}, acci[1] = {0.0f};
            if (r < a.rank)
                hc_down_part<1>((const uint2*)(a.down + (size_t)r * (a.h / 4)), (const uint4*)(a.inject + (size_t)r * a.h),
                                a.x, a.y, a.h, t, accd, acci);
            const float scale = r < a.rank ? __ldg(a.down_s + r) : 0.0f;
            const float v = warp_sum(fmaf(scale, accd[0], acci[0]));
            if (lane == 0) red[warp] = v;
            __syncthreads();
            if (t == 0 && r < a.rank) {
                float sum = 0.0f;
#pragma unroll
                for (int w = 0; w < HC_DOWN_THREADS / 32; ++w) sum += red[half * (HC_DOWN_THREADS / 32) + w];
                a.s[r] = f2bf(silu_f(sum));
            }
            __syncthreads();
        }
    }
    const int c = lane / HC_UP_TPR, p = lane % HC_UP_TPR;
    HcCol cols[HC_STEP_MAXC];
#pragma unroll
    for (int k = 0; k < HC_STEP_MAXC; ++k) {
        const int i = gw + k * nw;
        if (i < a.h) hc_col_load(a, i, c, p, cols[k]);
    }
    ml_mark(a.trace, 1);
    ml_grid_sync(a.sync, gridDim.x, ml_last(a.trace, 0));
    ml_mark(a.trace, 2);

    // 2. The gate mix of column i's S rows, then its pre-mix.
    float m = NEG_INF;
    for (int q = 0; q < a.ns; ++q) m = fmaxf(m, a.pre[q]);
    float z = 0.0f;
    for (int q = 0; q < a.ns; ++q) z += expf(a.pre[q] - m);
#pragma unroll
    for (int k = 0; k < HC_STEP_MAXC; ++k) {
        const int i = gw + k * nw;
        if (i >= a.h) break;
        float acc[1] = {0.0f};
        if (c < a.ns) {
#pragma unroll
            for (int kk = 0; kk < HC_STEP_MAXU; ++kk) {
                const int u = p + kk * HC_UP_TPR;
                if (u < a.rank / 32) hc_up_unit<1, true>(cols[k].w[kk], a.s, a.rank, u, acc);
            }
        }
        float v = acc[0];
#pragma unroll
        for (int o = HC_UP_TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        float nr = 0.0f;
        if (p == 0 && c < a.ns) {
            const bf16 r = hc_gated(cols[k].r, cols[k].scale, v, cols[k].y);
            a.streams[(size_t)c * a.h + i] = r;
            nr = bf2f(r);
        }
        float mix = 0.0f;
        for (int q = 0; q < a.ns; ++q) {
            const float rq = __shfl_sync(0xffffffffu, nr, q * HC_UP_TPR);
            mix += (expf(a.pre[q] - m) / z) * rq;
        }
        if (lane == 0) a.xn[i] = f2bf(mix);
    }
    ml_mark(a.trace, 3);
    ml_grid_sync(a.sync, 2 * gridDim.x, ml_last(a.trace, 1));
    ml_mark(a.trace, 4);

    // 3. The norm of xn: every block its sum of squares, block b the chunks q ≡ b (mod the grid).
    {
        const int tpr = 1 << a.tpr_log2, pp = threadIdx.x & (tpr - 1), dv = a.h >> 3;
        const uint4* x4 = (const uint4*)a.xn;
        uint4 xv[NORM_CHUNKS];
#pragma unroll
        for (int j = 0; j < NORM_CHUNKS; ++j) {
            const int q = pp + j * tpr;
            xv[j] = q < dv ? __ldcg(x4 + q) : make_uint4(0, 0, 0, 0);
        }
        const float ss = norm_sumsq(xv, tpr, red);
        const float rn = 1.0f / sqrtf(ss / (float)a.h + a.eps);
        if ((int)threadIdx.x < tpr) {
#pragma unroll
            for (int j = 0; j < NORM_CHUNKS; ++j) {
                const int q = pp + j * tpr;
                if (q < dv && q % (int)gridDim.x == (int)blockIdx.x)
                    ((uint4*)a.hn)[q] = norm_chunk<false>(xv[j], __ldg((const uint4*)a.norm_w + q), make_uint4(0, 0, 0, 0), rn, a.offset);
            }
        }
    }
    ml_mark(a.trace, 5);
    ml_finish(a.sync, a.trace);
}

// The inject rows of this block's first round of phase 1 (for the prologue's L2 prefetch); the
// block's entry marked (ml_entered).
__device__ __forceinline__ RowSpan hc_first_rows(const HcStepArgs& a) {
    ml_entered(a.trace);
    const int halves = ML_THREADS / HC_DOWN_THREADS, r0 = blockIdx.x * halves;
    const long long rows = r0 < a.rank ? min(halves, a.rank - r0) : 0;
    return RowSpan{a.inject + (size_t)r0 * a.h, rows * a.h * 2};
}

// Entry point. Grid: blocks_per_sm · multiprocessors blocks of ML_THREADS threads, launched
// cooperatively.
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) hc_step_m1(const HcStepArgs a) { pdl_prologue_prefetch(hc_first_rows(a)); hc_step(a); }
