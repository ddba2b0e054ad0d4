// A gated-delta-net mixer's one-token decode step in one persistent launch (gdn_layer_m1_*), where the
// separate launches take three: the input projections (q|k|v and z, packed; the gates b and a, bf16),
// the GDN step (conv, delta rule, gated RMSNorm: gdn_decode_fused_gates) and the output projection
// with the residual add and the next norm (gemv_q*_m1_norm). Every block of one cooperative grid (as
// many as the multiprocessors hold, layer.cuh) works through three phases, separated by grid barriers:
//   1. the projections' rows, a warp a row, several rows' loads in flight a warp (x staged once a
//      block in shared memory), each rounded to bf16 as the projection launches write them; meanwhile
//      nothing of phase 2 waits: its state columns, conv ring entries and conv weights are asked for
//      before the barrier;
//   2. an item is one value head's GL_TC value columns (hv · dv / GL_TC items over the blocks): the conv
//      and SiLU of the head's q and k and of its columns' v against the ring (the ring entry of this
//      position written once: q, k by the first column tile of a key group's first value head, v by its
//      own item), q and k l2-normalised, the delta rule on the item's columns of the f32 state (read
//      and written once, in registers: column c = thread % 16, rows thread / 16 + 16 n), and o = Sᵀq of
//      those columns before the norm; the first out_proj row of each warp is asked for before the
//      barrier;
//   3. every block stages the gated RMSNorm of all heads' o (w · o · rsqrt(mean(o²) + eps) · silu(z),
//      bf16) into shared memory, then a warp an out_proj row; the row rounded to bf16 and added to the
//      residual (add_rms_norm_row's rounding) or written out; with the residual, the norm of the new
//      residual over the grid (ml_norm_rows: a third barrier).
// The arithmetic is each replaced launch's per value; the dots and sums run in another order, so the
// results match theirs to rounding, not bit for bit (deterministically: no float atomics). The parity
// suite checks them against the CPU and against the three launches.
//
// Conv and delta rule as gdn.cu: the ring [K, c] of a slot holds input x_q at entry q mod K; the token at
// position p reads entries (p + 1 + j) mod K (j < K − 1) and writes entry p mod K, which nobody reads
// this step. g = −exp(A_log[h]) · softplus(a + dt_bias[h]), β = sigmoid(b); q, k l2-normalised (eps
// 1e-6), q scaled by dk^-0.5; value head h reads key head h / (hv / hk); S ← S·exp(g); δ = β(v − Sᵀk);
// S ← S + k⊗δ; o = Sᵀq = exp(g)·Sᵀq + δ·(k·q) over the old S.
#include "layer.cuh"

// Value columns of a phase-2 item, and most state rows (dk) and ring taps (K) the kernel takes.
#define GL_TC 16
#define GL_MAX_DK 128
#define GL_NR (GL_MAX_DK / (ML_THREADS / GL_TC))
#define GL_MAX_CONV 4
// Most values of a head (dv) and of all heads (hv · dv) in phase 3.
#define GL_MAX_DV 128
#define GL_MAX_O 6144
// Groups of 4 o values a thread stages (GL_MAX_O / 4 / ML_THREADS).
#define GL_OG (GL_MAX_O / 4 / ML_THREADS)

// The kernel's arguments (`GdnLayerArgs` in crates/cuda/src/ops/gdn_layer.rs, field for field). Packed
// weights are words [n, k / 32 · BITS] u32 and scales [n, ceil(k / group)] f32.
struct GdnLayerArgs {
    const bf16* x;          // [h] the normed input row
    const u32* qkv_w;       // [c, h], c = 2 hk dk + hv dv
    const float* qkv_s;
    const u32* z_w;         // [hv dv, h]
    const float* z_s;
    const bf16* w_b;        // [hv, h]
    const bf16* w_a;        // [hv, h]
    const bf16* conv_w;     // [c, K]
    const float* a_log;     // [hv]
    const float* dt_bias;   // [hv]
    const bf16* gnorm_w;    // [dv]
    bf16* conv_pool;        // [num_slots, K, c]
    float* state_pool;      // [num_slots, hv, dk, dv]
    const u32* slots;       // [1]
    const u32* positions;   // [1]
    const u32* out_w;       // [h, hv dv]
    const float* out_s;
    bf16* qkv;              // [c] scratch
    bf16* z;                // [hv dv] scratch
    float* ab;              // [2 hv] scratch: b then a, rounded to bf16
    float* o;               // [hv dv] scratch: o before the gated norm
    float* partials;        // [gridDim.x] scratch (with acc)
    bf16* y;                // [h] the output row (without acc)
    bf16* acc;              // [h] the residual, or null (no add and norm)
    const bf16* norm_w;     // [h]
    bf16* normed;           // [h]
    u32* sync;              // [2]
    int h, hk, hv, dk, dv, K, num_slots;
    int qkv_group, z_group, out_group;
    float q_scale, geps, eps, offset;
    unsigned long long* trace;  // [16] or null: block 0's phase times (globaltimer, ns)
};

// Channels of the conv (the q|k|v projection's width).
__device__ __forceinline__ int gl_conv_dim(const GdnLayerArgs& a) { return 2 * a.hk * a.dk + a.hv * a.dv; }

// A phase-2 item's operands asked for before barrier 1 (none depends on phase 1): this thread's state
// values (column c of rows g + 16 n), its conv channels' ring entries and weights.
struct GlPre {
    float st[GL_NR];
    float ring[2][GL_MAX_CONV];
    float w[2][GL_MAX_CONV];
};

// This thread's channels of item (vh, ct): [0] q (t < dk) or k (dk ≤ t < 2 dk) of key head kh, else −1;
// [1] v column ct·GL_TC + t of value head vh for t < GL_TC, else −1.
__device__ __forceinline__ void gl_channels(const GdnLayerArgs& a, int vh, int ct, int ch[2]) {
    const int t = threadIdx.x, kh = vh / (a.hv / a.hk);
    ch[0] = t < a.dk ? kh * a.dk + t : t < 2 * a.dk ? (a.hk + kh) * a.dk + (t - a.dk) : -1;
    ch[1] = t < GL_TC ? 2 * a.hk * a.dk + vh * a.dv + ct * GL_TC + t : -1;
}

// Channel ch's ring entries (positions p − K + 1 … p − 1, from entry `first` on) and conv weights.
__device__ __forceinline__ void gl_fetch_channel(const GdnLayerArgs& a, const bf16* ring, int ch, int c, u32 first,
                                                 float* rv, float* w) {
    u32 e = first;
#pragma unroll
    for (int j = 0; j < GL_MAX_CONV - 1; ++j) {
        rv[j] = 0.0f;
        if (j < a.K - 1) {
            rv[j] = bf2f(__ldcg(ring + (size_t)e * c + ch));
            e = e + 1u == (u32)a.K ? 0u : e + 1u;
        }
    }
#pragma unroll
    for (int j = 0; j < GL_MAX_CONV; ++j) w[j] = j < a.K ? bf2f(a.conv_w[(size_t)ch * a.K + j]) : 0.0f;
}

// Conv + SiLU of one channel (gdn_conv_channel's order): the K − 1 ring taps, then the token's x.
__device__ __forceinline__ float gl_conv(const float* w, const float* rv, float x, int K) {
    // Taps past K have w = 0 (gl_fetch_channel), which leaves the sum as it is; the taps are selected
    // by value, not by an index that the compiler would turn into a local-memory array.
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < GL_MAX_CONV; ++q) acc += w[q] * (q < K - 1 ? rv[q] : q == K - 1 ? x : 0.0f);
    return silu_f(acc);
}

__device__ __forceinline__ void gl_prefetch(const GdnLayerArgs& a, int item, u32 slot, u32 pos, GlPre& p) {
    const int tiles = a.dv / GL_TC, vh = item / tiles, ct = item - vh * tiles;
    const int c = gl_conv_dim(a), g = threadIdx.x / GL_TC, col = ct * GL_TC + threadIdx.x % GL_TC;
    const float* S = a.state_pool + ((size_t)slot * a.hv + vh) * (size_t)a.dk * a.dv;
#pragma unroll
    for (int n = 0; n < GL_NR; ++n) {
        const int i = g + (ML_THREADS / GL_TC) * n;
        p.st[n] = i < a.dk ? __ldcg(S + (size_t)i * a.dv + col) : 0.0f;
    }
    int ch[2];
    gl_channels(a, vh, ct, ch);
    const bf16* ring = a.conv_pool + (size_t)slot * a.K * c;
    const u32 first = (pos + 1u) % (u32)a.K;
    if (ch[0] >= 0) gl_fetch_channel(a, ring, ch[0], c, first, p.ring[0], p.w[0]);
    if (ch[1] >= 0) gl_fetch_channel(a, ring, ch[1], c, first, p.ring[1], p.w[1]);
}

// Phase 2, one item (its operands in p): conv, norms, the delta rule on its columns, o out.
__device__ __forceinline__ void gl_item(const GdnLayerArgs& a, int item, u32 slot, u32 pos, const GlPre& p,
                                        float* xs, float (*part)[ML_WARPS][GL_TC], float (*sums)[ML_WARPS]) {
    const int tiles = a.dv / GL_TC, vh = item / tiles, ct = item - vh * tiles;
    const int ratio = a.hv / a.hk, c = gl_conv_dim(a);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, g = t / GL_TC, col = t % GL_TC;
    const int j = ct * GL_TC + col;  // this thread's value column
    const float b_in = __ldcg(a.ab + vh), a_in = __ldcg(a.ab + a.hv + vh);
    int ch[2];
    gl_channels(a, vh, ct, ch);
    // Conv + SiLU of the thread's channels (gdn_conv_channel's order), the ring entry of this position
    // written by the channel's one writer: q, k by the first column tile of a key group's first value
    // head, v by its item (with K = 1 nothing is stored).
    bf16* ring = a.conv_pool + (size_t)slot * a.K * c;
    const size_t wr = (size_t)(pos % (u32)a.K) * c;
    if (ch[0] >= 0) {
        const bf16 x = __ldcg(a.qkv + ch[0]);
        xs[t] = gl_conv(p.w[0], p.ring[0], bf2f(x), a.K);
        if (a.K > 1 && vh % ratio == 0 && ct == 0) ring[wr + ch[0]] = x;
    }
    if (ch[1] >= 0) {
        const bf16 x = __ldcg(a.qkv + ch[1]);
        xs[2 * a.dk + t] = gl_conv(p.w[1], p.ring[1], bf2f(x), a.K);
        if (a.K > 1) ring[wr + ch[1]] = x;
    }
    __syncthreads();
    // Σq², Σk², Σq·k.
    {
        float sq = 0.0f, sk = 0.0f, sqk = 0.0f;
        if (t < a.dk) {
            const float qv = xs[t], kv = xs[a.dk + t];
            sq = qv * qv;
            sk = kv * kv;
            sqk = qv * kv;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        sqk = warp_sum(sqk);
        if (lane == 0) {
            sums[0][warp] = sq;
            sums[1][warp] = sk;
            sums[2][warp] = sqk;
        }
    }
    __syncthreads();
    float sq = 0.0f, sk = 0.0f, sqk = 0.0f;
#pragma unroll
    for (int w = 0; w < ML_WARPS; ++w) {
        sq += sums[0][w];
        sk += sums[1][w];
        sqk += sums[2][w];
    }
    const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
    const float kq = sqk * rk * rq * a.q_scale;
    const float decay = expf(-expf(a.a_log[vh]) * softplus_f(a_in + a.dt_bias[vh]));
    const float beta = sigmoid_f(b_in);
    // Partial Sᵀk and Sᵀq of column j over the thread's rows, then over the row groups (the two of a
    // warp by a shuffle, the warps' through shared memory, in warp order).
    float mem = 0.0f, sqp = 0.0f;
#pragma unroll
    for (int n = 0; n < GL_NR; ++n) {
        const int i = g + (ML_THREADS / GL_TC) * n;
        if (i < a.dk) {
            mem += p.st[n] * (xs[a.dk + i] * rk);
            sqp += p.st[n] * ((xs[i] * rq) * a.q_scale);
        }
    }
    mem += __shfl_xor_sync(0xffffffffu, mem, 16);
    sqp += __shfl_xor_sync(0xffffffffu, sqp, 16);
    if (lane < GL_TC) {
        part[0][warp][col] = mem;
        part[1][warp][col] = sqp;
    }
    __syncthreads();
    mem = sqp = 0.0f;
#pragma unroll
    for (int w = 0; w < ML_WARPS; ++w) {
        mem += part[0][w][col];
        sqp += part[1][w][col];
    }
    const float delta = (xs[2 * a.dk + col] - decay * mem) * beta;
    if (g == 0) a.o[(size_t)vh * a.dv + j] = decay * sqp + delta * kq;
    float* S = a.state_pool + ((size_t)slot * a.hv + vh) * (size_t)a.dk * a.dv;
#pragma unroll
    for (int n = 0; n < GL_NR; ++n) {
        const int i = g + (ML_THREADS / GL_TC) * n;
        if (i < a.dk) S[(size_t)i * a.dv + j] = p.st[n] * decay + (xs[a.dk + i] * rk) * delta;
    }
    __syncthreads();  // xs, part and sums are read before the next item writes them
}

// Phase 3's input, by groups of 4 values (group q: values 4q .. 4q + 3, all of one head): thread t
// takes groups t + ML_THREADS·i, so that a head's dv / 4 groups are dv / 4 consecutive lanes of one
// warp (dv a power of two, 16 ≤ dv ≤ 128). Its z and norm weights are asked for before barrier 2
// (z was written in phase 1), o after it.
struct GlStage {
    uint2 z[GL_OG];
    uint2 w[GL_OG];
};
__device__ __forceinline__ void gl_stage_prefetch(const GdnLayerArgs& a, GlStage& s) {
    const int groups = (a.hv * a.dv) >> 2;
#pragma unroll
    for (int i = 0; i < GL_OG; ++i) {
        const int q = threadIdx.x + ML_THREADS * i;
        if (q < groups) {
            s.z[i] = __ldcg((const uint2*)a.z + q);
            s.w[i] = __ldg((const uint2*)a.gnorm_w + (q % (a.dv >> 2)));
        }
    }
}

// The gated RMSNorm of every head's o (w · (o · rsqrt(mean(o²) + eps)) · silu(z), rounded once, as
// gdn.cu) into os (shared memory, ml_xs_chunk's order); a head's sum of squares over its lanes.
__device__ __forceinline__ void gl_stage_o(const GdnLayerArgs& a, const GlStage& s, bf16* os) {
    const int groups = (a.hv * a.dv) >> 2, span = a.dv >> 2;
    float4 ov[GL_OG];
#pragma unroll
    for (int i = 0; i < GL_OG; ++i) {
        const int q = threadIdx.x + ML_THREADS * i;
        if (q < groups) ov[i] = __ldcg((const float4*)a.o + q);
    }
#pragma unroll
    for (int i = 0; i < GL_OG; ++i) {
        const int q = threadIdx.x + ML_THREADS * i;
        // Every lane of a warp runs the shuffles (groups is a multiple of 32 groups' heads or the
        // whole warp is past it).
        if (ML_THREADS * i >= groups) break;
        const bool live = q < groups;
        const float o4[4] = {ov[i].x, ov[i].y, ov[i].z, ov[i].w};
        float ss = 0.0f;
        if (live)
#pragma unroll
            for (int e = 0; e < 4; ++e) ss += o4[e] * o4[e];
#pragma unroll
        for (int m = 1; m < 32; m <<= 1)
            if (m < span) ss += __shfl_xor_sync(0xffffffffu, ss, m);
        if (!live) continue;
        const float r = 1.0f / sqrtf(ss / (float)a.dv + a.geps);
        const u32 zw[2] = {s.z[i].x, s.z[i].y}, ww[2] = {s.w[i].x, s.w[i].y};
        u32 out[2];
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const __nv_bfloat162 z2 = *reinterpret_cast<const __nv_bfloat162*>(&zw[p]);
            const __nv_bfloat162 w2 = *reinterpret_cast<const __nv_bfloat162*>(&ww[p]);
            out[p] = pack_bf16x2((bf2f(w2.x) * (o4[2 * p] * r)) * silu_f(bf2f(z2.x)),
                                 (bf2f(w2.y) * (o4[2 * p + 1] * r)) * silu_f(bf2f(z2.y)));
        }
        const int v = 4 * q;
        *reinterpret_cast<uint2*>(os + ml_xs_chunk(v >> 3) * 8 + (v & 7)) = make_uint2(out[0], out[1]);
    }
}

// Phase 1, bf16 row i of the gates (b rows, then a rows): its dot with x, rounded to bf16 as the
// gates' GEMV writes them.
template <int GU>
__device__ __forceinline__ void gl_gate_row(const GdnLayerArgs& a, const bf16* xs, int i, int lane) {
    const uint4* wr = (const uint4*)((i < a.hv ? a.w_b : a.w_a) + (size_t)(i < a.hv ? i : i - a.hv) * a.h);
    const uint4* x4 = (const uint4*)xs;
    const int chunks = a.h >> 3;
    uint4 wv[4 * GU];
#pragma unroll
    for (int q = 0; q < 4 * GU; ++q) {
        const int c = lane + 32 * q;
        if (c < chunks) wv[q] = __ldcs(wr + c);
    }
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < 4 * GU; ++q) {
        const int c = lane + 32 * q;
        if (c < chunks) {
            float wf[8], xf[8];
            unpack8(wv[q], wf);
            unpack8(x4[ml_xs_chunk(c)], xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) s = fmaf(wf[e], xf[e], s);
        }
    }
    s = warp_sum(s);
    if (lane == 0) a.ab[i] = bf2f(f2bf(s));
}

template <int BITS, int GU, int OU>
__device__ __forceinline__ void gdn_layer_m1(const GdnLayerArgs& a) {
    __shared__ __align__(16) bf16 s_buf[GL_MAX_O];  // x (phase 1), then the normed o (phase 3)
    __shared__ float xs[2 * GL_MAX_DK + GL_TC];    // an item's conv outputs q | k | v
    __shared__ float part[2][ML_WARPS][GL_TC];
    __shared__ float sums[3][ML_WARPS];
    __shared__ float s_res[ML_WARPS][ML_MAXROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * ML_WARPS + warp, nw = gridDim.x * ML_WARPS;
    const bool norm = a.acc != nullptr;
    const int c = gl_conv_dim(a), zn = a.hv * a.dv;
    const u32 slot = a.slots[0], pos = a.positions[0];
    const bool live = slot < (u32)a.num_slots;
    const int items2 = live ? a.hv * (a.dv / GL_TC) : 0;
    ml_mark(a.trace, 0);
    ml_stage_x(s_buf, a.x, a.h);
    __syncthreads();

    // 1. The projections' rows: packed q|k|v then z rows in batches of B a warp, the bf16 gate rows
    // by the last warps of the grid.
    {
        constexpr int B = GU == 2 ? 3 : 2;
        const size_t wpr = (size_t)(a.h >> 5) * BITS;
        const int qcols = (a.h + a.qkv_group - 1) / a.qkv_group, zcols = (a.h + a.z_group - 1) / a.z_group;
        const int rows1 = c + zn;
#pragma unroll 1
        for (int i0 = gw; i0 < rows1; i0 += B * nw) {
            MlRow<BITS, GU> rows[B];
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < c)
                    ml_load<BITS, 32, GU>(rows[b], a.qkv_w + i * wpr, a.qkv_s + (size_t)i * qcols, a.h, a.qkv_group, lane);
                else if (i < rows1)
                    ml_load<BITS, 32, GU>(rows[b], a.z_w + (i - c) * wpr, a.z_s + (size_t)(i - c) * zcols, a.h, a.z_group,
                                          lane);
            }
            float d[B];
            ml_dots<BITS, 32, GU, true, B>(rows, s_buf, a.h, lane, d);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int i = i0 + b * nw;
                if (i < rows1) {
                    const float s = warp_sum(d[b]);
                    if (lane == 0) {
                        if (i < c)
                            a.qkv[i] = f2bf(s);
                        else
                            a.z[i - c] = f2bf(s);
                    }
                }
            }
        }
#pragma unroll 1
        for (int i = nw - 1 - gw; i < 2 * a.hv; i += nw) gl_gate_row<GU>(a, s_buf, i, lane);
    }
    GlPre pre = {};
    if ((int)blockIdx.x < items2) gl_prefetch(a, blockIdx.x, slot, pos, pre);
    ml_mark(a.trace, 1);
    ml_grid_sync(a.sync, gridDim.x, ml_last(a.trace, 0));
    ml_mark(a.trace, 2);

    // 2. The GDN step, an item a block (a bad slot: o = 0, nothing touched).
    if (!live) {
        for (int v = blockIdx.x * ML_THREADS + threadIdx.x; v < zn; v += gridDim.x * ML_THREADS) a.o[v] = 0.0f;
    }
#pragma unroll 1
    for (int it = blockIdx.x; it < items2; it += gridDim.x) {
        gl_item(a, it, slot, pos, pre, xs, part, sums);
        if (it + (int)gridDim.x < items2) gl_prefetch(a, it + gridDim.x, slot, pos, pre);
    }
    // The warp's first out_proj row is asked for before the barrier.
    const int kout = zn;
    const size_t owpr = (size_t)(kout >> 5) * BITS;
    const int ocols = (kout + a.out_group - 1) / a.out_group;
    MlRow<BITS, OU> orow;
    if (gw < a.h) ml_load<BITS, 32, OU>(orow, a.out_w + gw * owpr, a.out_s + (size_t)gw * ocols, kout, a.out_group, lane);
    GlStage stage;
    gl_stage_prefetch(a, stage);
    ml_mark(a.trace, 3);
    ml_grid_sync(a.sync, 2 * gridDim.x, ml_last(a.trace, 1));
    ml_mark(a.trace, 4);

    // 3. The gated norm of o into shared memory, then a warp an out_proj row.
    gl_stage_o(a, stage, s_buf);
    __syncthreads();
    ml_mark(a.trace, 5);
    float sq = 0.0f;
#pragma unroll 1
    for (int j = 0; j < ML_MAXROWS; ++j) {
        const int r = gw + j * nw;
        if (r >= a.h) break;
        const float res = norm && lane == 0 ? bf2f(a.acc[r]) : 0.0f;
        if (j > 0) ml_load<BITS, 32, OU>(orow, a.out_w + r * owpr, a.out_s + (size_t)r * ocols, kout, a.out_group, lane);
        const float s = warp_sum(ml_dot<BITS, 32, OU, true>(orow, s_buf, kout, lane));
        if (lane == 0) {
            const bf16 v = f2bf(s);
            if (norm)
                sq += ml_add_row(a.acc, r, res, v, s_res[warp][j]);
            else
                a.y[r] = v;
        }
    }
    ml_mark(a.trace, 6);
    if (norm) ml_norm_rows(sq, s_res, a.partials, a.sync, 3 * gridDim.x, a.h, a.eps, a.offset, a.norm_w, a.normed, gw, nw, ml_last(a.trace, 2));
    ml_mark(a.trace, 7);
    ml_finish(a.sync, a.trace);
}

// The q|k|v rows of this block's warps' first item (for the prologue's L2 prefetch); the block's
// entry marked (ml_entered).
template <int BITS>
__device__ __forceinline__ RowSpan gl_first_rows(const GdnLayerArgs& a) {
    ml_entered(a.trace);
    const long long row_bytes = (long long)(a.h >> 5) * BITS * 4;
    const long long r0 = (long long)blockIdx.x * ML_WARPS, c = gl_conv_dim(a);
    return RowSpan{(const char*)a.qkv_w + r0 * row_bytes, r0 < c ? min((long long)ML_WARPS, c - r0) * row_bytes : 0};
}

// Entry points: projections of BITS bits (q|k|v, z and out_proj of one width), GU units of 32 values a
// lane in the h-wide dots (h ≤ 1024 · GU), OU in the out_proj dots (hv · dv ≤ 1024 · OU). Grid:
// blocks_per_sm · multiprocessors blocks of ML_THREADS threads, launched cooperatively.
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p8_u2_o4(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<8>(a)); gdn_layer_m1<8, 2, 4>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p8_u3_o6(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<8>(a)); gdn_layer_m1<8, 3, 6>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p6_u2_o4(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<6>(a)); gdn_layer_m1<6, 2, 4>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p6_u3_o6(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<6>(a)); gdn_layer_m1<6, 3, 6>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p4_u2_o4(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<4>(a)); gdn_layer_m1<4, 2, 4>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p4_u3_o6(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<4>(a)); gdn_layer_m1<4, 3, 6>(a); }
