// The hyper-connections' gated residual (spec §4) of a decode step (M ≤ 8 rows) in one launch,
// hc_residual_m{M}, and with it (when given pre) the next sublayer's pre-mix and RMSNorm:
//   s[m, r]  = bf16(silu(down[r]·y[m] + inject[r]·x[m]))                    s: [M, rank]
//   R[m, j]  = bf16(R[m, j] + sigmoid(up[j]·s[m]) · y[m, j % h])              R: [M, S·h]
//   xn[m, i] = bf16(Σ_c softmax(pre)_c · R[m, c·h + i])                       xn: [M, h]
//   hn[m]    = xn[m] · rsqrt(mean(xn[m]²) + eps) · (offset + w)                hn: [M, h]
// down [rank, h] and up [S·h, rank] are packed INT8 with one f32 scale per row (compressed-tensors
// channel strategy: value j of a row is the unsigned code q + 128 at bits 8(j%4) of word j/4), inject
// [rank, h] is bf16. Dot products and the gate are f32; each output is rounded once; the pre-mix is
// hc_premix_bf16's sum and the norm rms_norm_bf16's (the same bits as those launches).
//
// No grid barrier: a block takes a role from a ticket (sync[0]) as it starts. The first rank / 2
// tickets compute s, a half-block (HC_DOWN_THREADS threads) a row r, and count themselves done
// (sync[1]); the others each take HC_UP_ROWS / S columns of every stream, ask for their up rows, and
// wait until every down block is done. Every ticket below a waiting block's was taken by a block that
// is running, and down blocks wait on nothing, so the wait ends whatever the order the blocks are
// scheduled in. The last up block to finish (sync[2]) norms xn and sets the three counters back to 0.
// Requirements (checked on the host): h % 32 == 0, rank % 32 == 0, S ≤ HC_UP_ROWS, 16-byte aligned
// buffers; with pre, h ≤ 8 · NORM_CHUNKS · 2^tpr_log2 and tpr_log2 ≤ 8.
#include "norm.cuh"
#include "packed.cuh"

// Threads of a block, and of the half-block that computes one row r of s.
#define HC_THREADS 256
#define HC_DOWN_THREADS 128
// Threads per output row j of up (a row slot), and the output rows an up block computes.
#define HC_UP_TPR 8
#define HC_UP_ROWS (HC_THREADS / HC_UP_TPR)

// hc_residual_m{M}'s arguments (HcArgs in crates/cuda/src/ops/hc.rs, field for field).
struct HcArgs {
    const u32* down;
    const float* down_s;
    const bf16* inject;
    const u32* up;
    const float* up_s;
    const bf16* x;        // this sublayer's pre-mixed input [M, h]
    const bf16* y;        // its output [M, h]
    bf16* streams;        // [M, S·h], updated in place
    bf16* s;              // [M, rank]
    const float* pre;     // the next sublayer's pre-mix logits [S], or null: no pre-mix or norm
    const bf16* norm_w;   // its norm's weight [h]
    bf16* xn;             // the next pre-mixed input [M, h]
    bf16* hn;             // its norm [M, h]
    u32* sync;            // three counters, 0 before and after
    int h;
    int rank;
    int n;                // S·h
    int tpr_log2;         // the norm's row slot (rms_norm_bf16's for h)
    float eps;
    float offset;
};

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

// s[m, r] for the two rows r = 2·d, 2·d + 1 of down block d, a half-block each. Thread t of a half takes
// the 8-value chunks c = t, t + HC_DOWN_THREADS, ... of its row: 8 INT8 codes of down (one 8-byte load)
// against y and 8 bf16 of inject (one 16-byte load) against x, for all M rows (each weight chunk read
// once). The down sum gets the row's scale once; each half's sums are reduced through shared memory in
// warp order, and its thread m < M writes s[m, r].
template <int M>
__device__ __forceinline__ void hc_down(const HcArgs& a, int d) {
    __shared__ float red[HC_THREADS / 32][M];
    const int half = threadIdx.x / HC_DOWN_THREADS, t = threadIdx.x % HC_DOWN_THREADS;
    const int r = 2 * d + half;
    const uint2* drow = (const uint2*)(a.down + (size_t)r * (a.h / 4));
    const uint4* irow = (const uint4*)(a.inject + (size_t)r * a.h);
    const int chunks = a.h / 8;
    float accd[M], acci[M];
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
            unpack8(__ldg((const uint4*)(a.y + (size_t)m * a.h) + c), yf);
            unpack8(__ldg((const uint4*)(a.x + (size_t)m * a.h) + c), xf);
            accd[m] += hc_dot8(q, yf);
            acci[m] += hc_dot8(wi, xf);
        }
    }
    const float scale = __ldg(a.down_s + r);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float v = warp_sum(fmaf(scale, accd[m], acci[m]));
        if (lane == 0) red[warp][m] = v;
    }
    __syncthreads();
    if (t < M) {
        const int m = t, w0 = half * (HC_DOWN_THREADS / 32);
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < HC_DOWN_THREADS / 32; ++w) v += red[w0 + w][m];
        a.s[(size_t)m * a.rank + r] = f2bf(silu_f(v));
    }
    // The block's barrier orders its writes of s before thread 0's release-add (layer.cuh's barrier).
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.sync + 1) : "memory");
}

// The sums of one unit u (32 values: 8 words w) of an up row against s[m] (written in this launch: read
// through L2) for M rows, added to acc[m] chunk by chunk.
template <int M>
__device__ __forceinline__ void hc_up_unit(const u32 (&w)[8], const bf16* __restrict__ s, int rank, int u,
                                           float (&acc)[M]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float qv[8];
        hc_decode8(w[2 * q], w[2 * q + 1], qv);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float sf[8];
            unpack8(__ldcg((const uint4*)(s + (size_t)m * rank + u * 32 + q * 8)), sf);
            acc[m] += hc_dot8(qv, sf);
        }
    }
}

// Up block b: row slots of HC_UP_TPR threads; the block takes columns b·cpb .. b·cpb + cpb − 1 of every
// stream (cpb = HC_UP_ROWS / S): slot k computes output j = c·h + i of stream c = k / cpb, column
// i = b·cpb + k % cpb. Thread p of a slot takes the 32-value units p, p + HC_UP_TPR, ... of up's row j
// against s[m] for all M rows (its first unit, the row's scale, R[p, j] and y[p, i] asked for before the
// wait for s); the slot's sums are combined with shuffles, and thread p = m applies the gate to R[m, j].
// A slot past its stream's h columns (or past S · cpb) computes nothing but still takes part in the
// shuffles. With pre, the block then pre-mixes its columns into xn.
template <int M>
__device__ __forceinline__ void hc_up(const HcArgs& a, int b, u32 downs) {
    __shared__ float mixed[M][HC_UP_ROWS];
    const int slot = threadIdx.x / HC_UP_TPR, p = threadIdx.x % HC_UP_TPR;
    const int h = a.h, ns = a.n / h, cpb = HC_UP_ROWS / ns;
    const int c = slot / cpb, i = b * cpb + slot % cpb;
    const bool valid = c < ns && i < h;
    const int j = c * h + i;
    const int units = valid ? a.rank / 32 : 0;
    const u32* wrow = a.up + (size_t)(valid ? j : 0) * (a.rank / 4);
    u32 w[8];
    if (p < units) PackedUnit<8, true>::load(wrow, p, w);
    const bool mine = valid && p < M;
    const float scale = valid ? __ldg(a.up_s + j) : 0.0f;
    const float r0 = mine ? bf2f(a.streams[(size_t)p * a.n + j]) : 0.0f;
    const float yv = mine ? bf2f(__ldg(a.y + (size_t)p * h + i)) : 0.0f;
    if (threadIdx.x == 0) {
        u32 seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(a.sync + 1) : "memory");
        } while (seen < downs);
    }
    __syncthreads();
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    if (p < units) hc_up_unit<M>(w, a.s, a.rank, p, acc);
#pragma unroll 1
    for (int u = p + HC_UP_TPR; u < units; u += HC_UP_TPR) {
        PackedUnit<8, true>::load(wrow, u, w);
        hc_up_unit<M>(w, a.s, a.rank, u, acc);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float v = acc[m];
#pragma unroll
        for (int o = HC_UP_TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[m] = v;
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m != p || !mine) continue;
        const float gate = sigmoid_f(scale * acc[m]);
        const bf16 r = f2bf(r0 + gate * yv);
        a.streams[(size_t)m * a.n + j] = r;
        mixed[m][slot] = bf2f(r);
    }
    if (a.pre == nullptr) return;
    __syncthreads();
    const int t = threadIdx.x, m = t / cpb, col = t % cpb, ic = b * cpb + col;
    if (m >= M || ic >= h) return;
    float mx = NEG_INF;
    for (int q = 0; q < ns; ++q) mx = fmaxf(mx, a.pre[q]);
    float z = 0.0f;
    for (int q = 0; q < ns; ++q) z += expf(a.pre[q] - mx);
    float v = 0.0f;
    for (int q = 0; q < ns; ++q) v += (expf(a.pre[q] - mx) / z) * mixed[m][q * cpb + col];
    a.xn[(size_t)m * h + ic] = f2bf(v);
}

// hn = rms_norm(xn) for M rows, by one block: slots of tpr threads as rms_norm_bf16 cuts a row (the same
// sums in the same order), HC_THREADS / tpr rows a round; xn was written in this launch (read through L2).
template <int M>
__device__ __forceinline__ void hc_norm(const HcArgs& a) {
    __shared__ float red[8];
    const int tpr = 1 << a.tpr_log2, p = threadIdx.x & (tpr - 1), dv = a.h >> 3;
    const int per = HC_THREADS >> a.tpr_log2;
#pragma unroll 1
    for (int r0 = 0; r0 < M; r0 += per) {
        const int row = r0 + (threadIdx.x >> a.tpr_log2);
        const bool live = row < M;
        const uint4* xr = (const uint4*)(a.xn + (size_t)(live ? row : 0) * a.h);
        uint4 xv[NORM_CHUNKS], wv[NORM_CHUNKS];
#pragma unroll
        for (int q = 0; q < NORM_CHUNKS; ++q) {
            const int c = p + q * tpr;
            const bool ok = live && c < dv;
            xv[q] = ok ? __ldcg(xr + c) : make_uint4(0, 0, 0, 0);
            wv[q] = ok ? __ldg((const uint4*)a.norm_w + c) : make_uint4(0, 0, 0, 0);
        }
        const float ss = norm_sumsq(xv, tpr, red);
        const float rn = 1.0f / sqrtf(ss / (float)a.h + a.eps);
        if (live) {
            uint4* yr = (uint4*)(a.hn + (size_t)row * a.h);
#pragma unroll
            for (int q = 0; q < NORM_CHUNKS; ++q) {
                const int c = p + q * tpr;
                if (c < dv) yr[c] = norm_chunk<false>(xv[q], wv[q], make_uint4(0, 0, 0, 0), rn, a.offset);
            }
        }
        __syncthreads();
    }
}

// The block's role from its ticket, then its part; the last up block norms and resets the counters.
template <int M>
__device__ __forceinline__ void hc_residual(const HcArgs& a) {
    __shared__ u32 ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(a.sync, 1u);
    __syncthreads();
    const u32 downs = a.rank / 2;
    if (ticket < downs) {
        hc_down<M>(a, ticket);
        return;
    }
    hc_up<M>(a, ticket - downs, downs);
    if (!last_block_to_arrive(a.sync + 2, gridDim.x - downs)) return;
    if (a.pre != nullptr) hc_norm<M>(a);
    if (threadIdx.x == 0) a.sync[0] = a.sync[1] = a.sync[2] = 0u;
}

// pdl_prologue, first asking L2 for the weight rows of the role the block will likely take (tickets
// mostly follow the block index): a down block's two inject rows (two thirds of its bytes), an up
// block's run of cpb rows of each stream.
__device__ __forceinline__ void pdl_prologue_prefetch(const HcArgs& a) {
    const int downs = a.rank / 2, b = (int)blockIdx.x - downs;
    if (b < 0) {
        l2_prefetch(a.inject + (size_t)blockIdx.x * 2 * a.h, 4LL * a.h);
    } else {
        const int ns = a.n / a.h, cpb = HC_UP_ROWS / ns, i0 = b * cpb;
        const long long cols = min(cpb, a.h - i0);
        for (int c = 0; c < ns; ++c) l2_prefetch(a.up + ((size_t)c * a.h + i0) * (a.rank / 4), cols * a.rank);
    }
    pdl_prologue();
}

// Entry points per row count M (the host picks hc_residual_m{M}). Grid: rank / 2 + ceil(h / cpb) blocks
// of HC_THREADS.
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m1(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<1>(a); }
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m2(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<2>(a); }
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m3(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<3>(a); }
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m4(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<4>(a); }
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m5(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<5>(a); }
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m6(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<6>(a); }
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m7(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<7>(a); }
extern "C" __global__ void __launch_bounds__(HC_THREADS) hc_residual_m8(const HcArgs a) { pdl_prologue_prefetch(a); hc_residual<8>(a); }
