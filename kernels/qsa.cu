// QSA (spec §2): the lightning indexer and the attention restricted to its selection.
//
// Index-key pool layout (the CPU backend's): idx_pool [num_blocks, bs, dI + 2] bytes; an entry is dI fp8
// e4m3 bytes of kI / s followed by the bf16 scale s little-endian. Position p of a sequence lies in block
// table[p / bs], row p % bs. Everything that decides a byte, a score or a selection is computed with
// the CPU oracle's f32 operations in its order (explicit _rn intrinsics: no FMA contraction), so the
// fp8 bytes, the scores and the selected sets equal the CPU's bit for bit on equal inputs.
#include "common.cuh"

#define QSA_MAX_DI 256
// Selection entries a block of qsa_attn_partial reduces (its span): small for decode rows, so a row's
// topk spreads over many blocks (2048 entries: 64 spans a head group; a 528-token context 17, one
// QSA_CHUNK each); qsa_attn_partial_wide's (the prefill form, whose split workspace grows with its many
// rows) eight times that, which qsa_staged.cu's QSA_SPLIT must equal.
#define QSA_SPLIT_DECODE 32
#define QSA_SPLIT_WIDE 256
#define QSA_MAX_D 256

// fp8 e4m3 ("fn": max 448, 0x7F NaN) of x, nearest even, saturating; the CPU's fp8_e4m3_encode.
__device__ __forceinline__ unsigned char fp8_e4m3_encode(float x) {
    if (isnan(x)) return 0x7f;
    const unsigned char sign = (__float_as_uint(x) & 0x80000000u) ? 0x80 : 0;
    const float a = fabsf(x);
    int e;
    if (a < 0.015625f) {  // 2^-6: the subnormal quantum 2^-9
        e = -6;
    } else {
        e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
        if (e > 8) e = 8;
    }
    const float q = ldexpf(1.0f, e - 3);
    const float r = fminf(__fmul_rn(rintf(__fdiv_rn(a, q)), q), 448.0f);
    if (r == 0.0f) return sign;
    if (r < 0.015625f) return sign | (unsigned char)(int)__fdiv_rn(r, 0.001953125f);
    const int er = (int)((__float_as_uint(r) >> 23) & 0xff) - 127;
    const int m = (int)__fmul_rn(__fdiv_rn(r, ldexpf(1.0f, er)), 8.0f) - 8;
    return sign | (unsigned char)((er + 7) << 3) | (unsigned char)m;
}

// The f32 value of an e4m3 byte (exact).
__device__ __forceinline__ float fp8_e4m3_decode(unsigned char b) {
    const int e = (b >> 3) & 0xf, m = b & 7;
    if (e == 0xf && m == 7) return __int_as_float(0x7fc00000);
    const float v = e == 0 ? (float)m * 0.001953125f : (1.0f + (float)m / 8.0f) * ldexpf(1.0f, e - 7);
    return (b & 0x80) ? -v : v;
}

// Pair (a, b) = (x[j], x[j + half]) of NeoX RoPE at position p with frequency f = inv_freq[j], as the
// CPU's rope_neox: angle (f32) = p·f, cos/sin in f64 rounded to f32; a' = a·c + (−b)·s, b' = b·c + a·s.
__device__ __forceinline__ void rope_pair(float& a, float& b, u32 p, float f) {
    const float ang = __fmul_rn((float)p, f);
    const float c = (float)cos((double)ang), s = (float)sin((double)ang);
    const float a0 = a, b0 = b;
    a = __fadd_rn(__fmul_rn(a0, c), __fmul_rn(-b0, s));
    b = __fadd_rn(__fmul_rn(b0, c), __fmul_rn(a0, s));
}

// Grid (rows); block any multiple of 32 threads (the host: dI rounded up to 32, so a thread a dim).
// Block r writes row r's entry: kI = LayerNorm(ik; w, b, eps) (mean, biased variance, summed in order),
// NeoX RoPE on the first 2·half dims at pos[r], the entry s = bf16(max|kI| / 448) (1 when 0), k8 =
// fp8(kI / s), to pool row dst[r] of idx_pool (a dst at or beyond pool_rows is skipped). Every value
// takes the operations of the CPU's loops in their order: thread 0 alone does the two in-order sums.
extern "C" __global__ void qsa_index_key_write(const bf16* __restrict__ ik, const bf16* __restrict__ w,
                                               const bf16* __restrict__ b, float eps, const u32* __restrict__ pos,
                                               const float* __restrict__ inv_freq, int half,
                                               const u32* __restrict__ dst, u32 pool_rows,
                                               unsigned char* __restrict__ idx_pool, int di, int rows) {
    pdl_prologue();
    __shared__ float k[QSA_MAX_DI];
    __shared__ float stat[2];  // mean, 1 / sqrt(var + eps)
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows || di > QSA_MAX_DI) return;  // both uniform over the block
    const u32 d = dst[r];
    if (d >= pool_rows) return;
    // Each thread stages its dims of the row.
    for (int i = threadIdx.x; i < di; i += blockDim.x) k[i] = bf2f(ik[(size_t)r * di + i]);
    __syncthreads();
    // Thread 0: the mean and the variance, each summed over i = 0..di−1 in order.
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int i = 0; i < di; ++i) sum = __fadd_rn(sum, k[i]);
        const float mean = __fdiv_rn(sum, (float)di);
        float var = 0.0f;
        for (int i = 0; i < di; ++i) {
            const float t = __fsub_rn(k[i], mean);
            var = __fadd_rn(var, __fmul_rn(t, t));
        }
        var = __fdiv_rn(var, (float)di);
        stat[0] = mean;
        stat[1] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
    }
    __syncthreads();
    // Each thread normalises its dims.
    const float mean = stat[0], rs = stat[1];
    for (int i = threadIdx.x; i < di; i += blockDim.x)
        k[i] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(k[i], mean), rs), bf2f(w[i])), bf2f(b[i]));
    __syncthreads();
    // Thread j rotates pair (j, j + half) (the pairs are disjoint: no thread reads another's writes).
    for (int j = threadIdx.x; j < half; j += blockDim.x) rope_pair(k[j], k[j + half], pos[r], inv_freq[j]);
    __syncthreads();
    // max|kI| (from 0, NaN ignored: fmaxf's result does not depend on the order), then the scale.
    float amax = 0.0f;
    for (int i = threadIdx.x; i < di; i += blockDim.x) amax = fmaxf(amax, fabsf(k[i]));
    amax = block_max(amax, scratch);
    bf16 sb = f2bf(__fdiv_rn(amax, 448.0f));
    if (bf2f(sb) == 0.0f) sb = f2bf(1.0f);
    const float sv = bf2f(sb);
    // Each thread encodes its dims; thread 0 also writes the scale.
    unsigned char* e = idx_pool + (size_t)d * (di + 2);
    for (int i = threadIdx.x; i < di; i += blockDim.x) e[i] = fp8_e4m3_encode(__fdiv_rn(k[i], sv));
    if (threadIdx.x == 0) {
        const unsigned short bits = __bfloat16_as_ushort(sb);
        e[di] = (unsigned char)(bits & 0xff);
        e[di + 1] = (unsigned char)(bits >> 8);
    }
}

// One thread per (row r, head h, u), u < dI − half, rh = r·ni + h: u < half rotates pair (u, u + half)
// of the indexer query head (bf16 input) at pos[r], u ≥ half copies value u + half (past the rotated
// 2·half), into qi [rows, ni·di] f32; u == 0 also writes the head's weight wts[rh] = iw[rh]·scale.
extern "C" __global__ void qsa_query_prep(const bf16* __restrict__ iq, const bf16* __restrict__ iw,
                                          const u32* __restrict__ pos, const float* __restrict__ inv_freq,
                                          int half, float head_scale, float* __restrict__ qi,
                                          float* __restrict__ wts, int ni, int di, int rows) {
    pdl_prologue();
    const int per = di - half;  // ≥ 1: 1 ≤ dI and 2·half ≤ dI
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * ni * per || di > QSA_MAX_DI) return;
    const long long rh = t / per;
    const int u = (int)(t - rh * per);
    const size_t at = (size_t)rh * di;
    if (u < half) {
        float a = bf2f(iq[at + u]), b = bf2f(iq[at + u + half]);
        rope_pair(a, b, pos[rh / ni], inv_freq[u]);
        qi[at + u] = a;
        qi[at + u + half] = b;
    } else {
        qi[at + u + half] = bf2f(iq[at + u + half]);
    }
    if (u == 0) wts[rh] = __fmul_rn(bf2f(iw[rh]), head_scale);
}

// The index score of one position from its entry e (dI fp8 bytes and the bf16 scale): Σ_h w_h ·
// ReLU(q_h · k̂), k̂ = k8·s dequantised, summed in order as the CPU's index_scores. qs [ni·di], ws [ni].
__device__ __forceinline__ float index_score(const float* qs, const float* ws, const unsigned char* e, int ni,
                                             int di) {
    const float sv = __uint_as_float(((u32)e[di] | ((u32)e[di + 1] << 8)) << 16);
    float k[QSA_MAX_DI];
    for (int i = 0; i < di; ++i) k[i] = __fmul_rn(fp8_e4m3_decode(e[i]), sv);
    float acc = 0.0f;
    for (int h = 0; h < ni; ++h) {
        const float* q = qs + h * di;
        float dot = 0.0f;
        for (int i = 0; i < di; ++i) dot = __fadd_rn(dot, __fmul_rn(q[i], k[i]));
        acc = __fadd_rn(acc, __fmul_rn(ws[h], fmaxf(dot, 0.0f)));
    }
    return acc;
}

// The entry of position s through a block table.
__device__ __forceinline__ const unsigned char* index_entry(const unsigned char* idx_pool, const u32* table,
                                                            long long s, int bs, int di) {
    return idx_pool + ((size_t)table[s / bs] * bs + (size_t)(s % bs)) * (di + 2);
}

// Stages one query row's indexer heads and weights in shared memory (every thread of the block).
__device__ __forceinline__ void stage_query(float* qs, float* ws, const float* qi, const float* wts, int r, int ni,
                                            int di) {
    for (int i = threadIdx.x; i < ni * di; i += blockDim.x) qs[i] = qi[(size_t)r * ni * di + i];
    for (int i = threadIdx.x; i < ni; i += blockDim.x) ws[i] = wts[(size_t)r * ni + i];
    __syncthreads();
}

// Query rows a block of the tiled prefill scores stages at once.
#define QSA_SCORE_ROWS 8

// The f32 value of every e4m3 byte, in shared memory (every thread of the block; a barrier follows
// before it is read).
__device__ __forceinline__ void stage_fp8_table(float* lut) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) lut[i] = fp8_e4m3_decode((unsigned char)i);
}

// index_score of R query rows at one position, the key decoded once for all of them (into registers:
// DI is a compile-time head size): qs [R, ni·DI] and ws [R, ni] in shared memory, e the position's
// entry, lut the e4m3 table. acc[j] = row j's score, each with index_score's operations in its order.
template <int DI, int R>
__device__ __forceinline__ void index_score_rows(const float* lut, const float* qs, const float* ws,
                                                 const unsigned char* e, int ni, float* acc) {
    const float sv = __uint_as_float(((u32)e[DI] | ((u32)e[DI + 1] << 8)) << 16);
    float k[DI];
#pragma unroll
    for (int i = 0; i < DI; ++i) k[i] = __fmul_rn(lut[e[i]], sv);
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0.0f;
    for (int h = 0; h < ni; ++h) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const float4* q = reinterpret_cast<const float4*>(qs + ((size_t)j * ni + h) * DI);
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < DI / 4; ++i) {
                const float4 v = q[i];
                dot = __fadd_rn(dot, __fmul_rn(v.x, k[4 * i]));
                dot = __fadd_rn(dot, __fmul_rn(v.y, k[4 * i + 1]));
                dot = __fadd_rn(dot, __fmul_rn(v.z, k[4 * i + 2]));
                dot = __fadd_rn(dot, __fmul_rn(v.w, k[4 * i + 3]));
            }
            acc[j] = __fadd_rn(acc[j], __fmul_rn(ws[j * ni + h], fmaxf(dot, 0.0f)));
        }
    }
}

// Grid (ceil(ctx_max / blockDim), n_rows); dynamic shared memory (ni·di + ni) floats. Row r (query
// pos0 + r of one sequence) scores every position s ≤ pos0 + r: scores[r·ld + s] = index_score. The
// form for any dI; qsa_scores_di* below are the same scores for the usual head sizes.
extern "C" __global__ void qsa_scores(const float* __restrict__ qi, const float* __restrict__ wts,
                                      const unsigned char* __restrict__ idx_pool, const u32* __restrict__ table,
                                      int pos0, int ni, int di, int bs, int n_rows, float* __restrict__ scores,
                                      long long ld) {
    pdl_prologue();
    extern __shared__ float sm[];
    const int r = blockIdx.y;
    if (r >= n_rows) return;
    stage_query(sm, sm + ni * di, qi, wts, r, ni, di);
    const long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long ctx = (long long)pos0 + r + 1;
    if (s >= ctx || di > QSA_MAX_DI) return;
    scores[(size_t)r * ld + s] = index_score(sm, sm + ni * di, index_entry(idx_pool, table, s, bs, di), ni, di);
}

// qsa_scores for dI = DI, QSA_SCORE_ROWS query rows a block: grid (ceil(ctx_max / blockDim),
// ceil(n_rows / QSA_SCORE_ROWS)); dynamic shared memory 256 + QSA_SCORE_ROWS·(ni·DI + ni) floats.
// Each thread decodes its position's key once for the block's rows.
template <int DI>
__device__ __forceinline__ void scores_tiled(const float* __restrict__ qi, const float* __restrict__ wts,
                                             const unsigned char* __restrict__ idx_pool,
                                             const u32* __restrict__ table, int pos0, int ni, int bs, int n_rows,
                                             float* __restrict__ scores, long long ld) {
    constexpr int R = QSA_SCORE_ROWS;
    extern __shared__ float sm[];
    float* lut = sm;
    float* qs = sm + 256;
    float* ws = qs + R * ni * DI;
    const int r0 = blockIdx.y * R;
    const int nr = min(R, n_rows - r0);
    // The widest context of the block's rows; blocks past it exit at once (uniform over the block).
    const long long ctx = (long long)pos0 + r0 + nr;
    const long long s0 = (long long)blockIdx.x * blockDim.x;
    if (nr <= 0 || s0 >= ctx) return;
    stage_fp8_table(lut);
    const size_t q0 = (size_t)r0 * ni * DI, w0 = (size_t)r0 * ni;
    for (int i = threadIdx.x; i < R * ni * DI; i += blockDim.x) qs[i] = i < nr * ni * DI ? qi[q0 + i] : 0.0f;
    for (int i = threadIdx.x; i < R * ni; i += blockDim.x) ws[i] = i < nr * ni ? wts[w0 + i] : 0.0f;
    __syncthreads();
    const long long s = s0 + threadIdx.x;
    if (s >= ctx) return;
    float acc[R];
    index_score_rows<DI, R>(lut, qs, ws, index_entry(idx_pool, table, s, bs, DI), ni, acc);
#pragma unroll
    for (int j = 0; j < R; ++j)
        if (j < nr && s <= (long long)pos0 + r0 + j) scores[(size_t)(r0 + j) * ld + s] = acc[j];
}

extern "C" __global__ void qsa_scores_di16(const float* __restrict__ qi, const float* __restrict__ wts,
                                            const unsigned char* __restrict__ idx_pool, const u32* __restrict__ table,
                                            int pos0, int ni, int di, int bs, int n_rows, float* __restrict__ scores,
                                            long long ld) {
    pdl_prologue();
    if (di == 16) scores_tiled<16>(qi, wts, idx_pool, table, pos0, ni, bs, n_rows, scores, ld);
}

extern "C" __global__ void qsa_scores_di32(const float* __restrict__ qi, const float* __restrict__ wts,
                                            const unsigned char* __restrict__ idx_pool, const u32* __restrict__ table,
                                            int pos0, int ni, int di, int bs, int n_rows, float* __restrict__ scores,
                                            long long ld) {
    pdl_prologue();
    if (di == 32) scores_tiled<32>(qi, wts, idx_pool, table, pos0, ni, bs, n_rows, scores, ld);
}

extern "C" __global__ void qsa_scores_di64(const float* __restrict__ qi, const float* __restrict__ wts,
                                            const unsigned char* __restrict__ idx_pool, const u32* __restrict__ table,
                                            int pos0, int ni, int di, int bs, int n_rows, float* __restrict__ scores,
                                            long long ld) {
    pdl_prologue();
    if (di == 64) scores_tiled<64>(qi, wts, idx_pool, table, pos0, ni, bs, n_rows, scores, ld);
}

extern "C" __global__ void qsa_scores_di128(const float* __restrict__ qi, const float* __restrict__ wts,
                                            const unsigned char* __restrict__ idx_pool, const u32* __restrict__ table,
                                            int pos0, int ni, int di, int bs, int n_rows, float* __restrict__ scores,
                                            long long ld) {
    pdl_prologue();
    if (di == 128) scores_tiled<128>(qi, wts, idx_pool, table, pos0, ni, bs, n_rows, scores, ld);
}

// The decode form: grid (ceil(ld / blockDim), rows); dynamic shared memory (ni·di + ni) floats. Row r
// is the one query of sequence r: context ctx = min(lens[r], max_ctx), block table row r of tables
// (table_stride ids a row), all read on the device. A row with ctx ≤ topk selects every position and
// is not scored; otherwise scores[r·ld + s] = index_score for every s < ctx. Blocks past a row's
// context exit at once, so one launch shape serves every context up to ld. The form for any dI;
// qsa_scores_decode_di* below are the same scores for the usual head sizes.
extern "C" __global__ void qsa_scores_decode(const float* __restrict__ qi, const float* __restrict__ wts,
                                             const unsigned char* __restrict__ idx_pool,
                                             const u32* __restrict__ tables, long long table_stride,
                                             const u32* __restrict__ lens, long long max_ctx, int topk, int ni,
                                             int di, int bs, float* __restrict__ scores, long long ld) {
    pdl_prologue();
    extern __shared__ float sm[];
    const int r = blockIdx.y;
    const long long ctx = min((long long)lens[r], max_ctx);
    const long long s0 = (long long)blockIdx.x * blockDim.x;
    // Uniform over the block: no thread reaches the barrier below when one returns here.
    if (ctx <= topk || s0 >= ctx || di > QSA_MAX_DI) return;
    stage_query(sm, sm + ni * di, qi, wts, r, ni, di);
    const long long s = s0 + threadIdx.x;
    if (s >= ctx) return;
    const u32* table = tables + (size_t)r * table_stride;
    scores[(size_t)r * ld + s] = index_score(sm, sm + ni * di, index_entry(idx_pool, table, s, bs, di), ni, di);
}

// qsa_scores_decode for dI = DI: dynamic shared memory 256 + ni·DI + ni floats (the e4m3 table, the
// row's heads and weights); the key decoded into registers.
template <int DI>
__device__ __forceinline__ void scores_decode_tiled(const float* __restrict__ qi, const float* __restrict__ wts,
                                                    const unsigned char* __restrict__ idx_pool,
                                                    const u32* __restrict__ tables, long long table_stride,
                                                    const u32* __restrict__ lens, long long max_ctx, int topk,
                                                    int ni, int bs, float* __restrict__ scores, long long ld) {
    extern __shared__ float sm[];
    float* lut = sm;
    float* qs = sm + 256;
    float* ws = qs + ni * DI;
    const int r = blockIdx.y;
    const long long ctx = min((long long)lens[r], max_ctx);
    const long long s0 = (long long)blockIdx.x * blockDim.x;
    if (ctx <= topk || s0 >= ctx) return;  // uniform over the block
    stage_fp8_table(lut);
    stage_query(qs, ws, qi, wts, r, ni, DI);
    const long long s = s0 + threadIdx.x;
    if (s >= ctx) return;
    const u32* table = tables + (size_t)r * table_stride;
    float acc[1];
    index_score_rows<DI, 1>(lut, qs, ws, index_entry(idx_pool, table, s, bs, DI), ni, acc);
    scores[(size_t)r * ld + s] = acc[0];
}

extern "C" __global__ void qsa_scores_decode_di16(const float* __restrict__ qi, const float* __restrict__ wts,
                                                   const unsigned char* __restrict__ idx_pool,
                                                   const u32* __restrict__ tables, long long table_stride,
                                                   const u32* __restrict__ lens, long long max_ctx, int topk,
                                                   int ni, int di, int bs, float* __restrict__ scores,
                                                   long long ld) {
    pdl_prologue();
    if (di == 16)
        scores_decode_tiled<16>(qi, wts, idx_pool, tables, table_stride, lens, max_ctx, topk, ni, bs, scores, ld);
}
extern "C" __global__ void qsa_scores_decode_di32(const float* __restrict__ qi, const float* __restrict__ wts,
                                                   const unsigned char* __restrict__ idx_pool,
                                                   const u32* __restrict__ tables, long long table_stride,
                                                   const u32* __restrict__ lens, long long max_ctx, int topk,
                                                   int ni, int di, int bs, float* __restrict__ scores,
                                                   long long ld) {
    pdl_prologue();
    if (di == 32)
        scores_decode_tiled<32>(qi, wts, idx_pool, tables, table_stride, lens, max_ctx, topk, ni, bs, scores, ld);
}
extern "C" __global__ void qsa_scores_decode_di64(const float* __restrict__ qi, const float* __restrict__ wts,
                                                   const unsigned char* __restrict__ idx_pool,
                                                   const u32* __restrict__ tables, long long table_stride,
                                                   const u32* __restrict__ lens, long long max_ctx, int topk,
                                                   int ni, int di, int bs, float* __restrict__ scores,
                                                   long long ld) {
    pdl_prologue();
    if (di == 64)
        scores_decode_tiled<64>(qi, wts, idx_pool, tables, table_stride, lens, max_ctx, topk, ni, bs, scores, ld);
}
extern "C" __global__ void qsa_scores_decode_di128(const float* __restrict__ qi, const float* __restrict__ wts,
                                                   const unsigned char* __restrict__ idx_pool,
                                                   const u32* __restrict__ tables, long long table_stride,
                                                   const u32* __restrict__ lens, long long max_ctx, int topk,
                                                   int ni, int di, int bs, float* __restrict__ scores,
                                                   long long ld) {
    pdl_prologue();
    if (di == 128)
        scores_decode_tiled<128>(qi, wts, idx_pool, tables, table_stride, lens, max_ctx, topk, ni, bs, scores, ld);
}

// Where a selected row of the cached attention comes from (qsa_attn_partial, rc_st): host memory (a
// miss, or the uncached kernel), the row cache's line (a hit), or host memory with the row copied into
// the line its slot claimed (a miss that fills).
#define RC_HOST 0
#define RC_HIT 1
#define RC_FILL 2

// Query heads one block of qsa_attn_partial serves (all of one KV head's, in groups of at most this).
#define QSA_GROUP 8
// Selection entries whose K or V rows a block stages in shared memory at a time.
#define QSA_CHUNK 32
// The block size qsa_attn_partial (and qsa_staged.cu) are launched with: the order of the block
// reductions depends on it.
#define QSA_THREADS 128

// The query heads of KV head kh that block x of qsa_attn_partial's grid serves: the g = hq / hkv heads of
// a KV head split into ceil(g / QSA_GROUP) groups of ceil(g / groups) heads (the last may be smaller).
struct QsaHeads {
    int kh;
    int h0;
    int n;
};
__device__ __forceinline__ QsaHeads qsa_heads(int x, int hq, int hkv) {
    const int g = hq / hkv;
    const int groups = (g + QSA_GROUP - 1) / QSA_GROUP;
    const int per = (g + groups - 1) / groups;
    const int kh = x / groups, grp = x % groups;
    return QsaHeads{kh, kh * g + grp * per, min(per, g - grp * per)};
}

// 16 bytes global → shared without a register round trip (cp.async, as attention.cu's att_cp16).
__device__ __forceinline__ void qsa_cp16(void* dst, const void* src) {
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}

// Copies the d bf16 values at src[j] (j < cn ≤ QSA_CHUNK; a null src[j] is skipped) into rows[j·d ..]
// and, where fill[j] is not null, into fill[j] too; every thread of the block (QSA_THREADS of them).
// With `vec` (d a multiple of 8, every pointer 16-byte aligned) each thread first issues all its
// 16-byte copies into rows (cp.async: no registers held), waits for them, then writes the fills from
// its own copies in shared memory: a whole chunk's loads are in flight at once. (A load into a
// register followed by its fill store in one loop would serialise them: the compiler cannot move the
// next load above a global store, one memory latency per load.) The bytes are the same either way.
__device__ __forceinline__ void qsa_stage_chunk(bf16* rows, const bf16* const* src, bf16* const* fill, int cn,
                                                int d, bool vec) {
    if (vec) {
        constexpr int LOADS = QSA_CHUNK * QSA_MAX_D / 8 / QSA_THREADS;
        const int per = d >> 3, total = cn * per;
        if (total <= 0) return;
        // Thread t's k-th 16 bytes: unit u = t + k·QSA_THREADS of rows ([cn, d] contiguous), row j =
        // u / per, column c = u % per, stepped without a division.
        const int dj = QSA_THREADS / per, dc = QSA_THREADS - dj * per;
        const int j0 = (int)threadIdx.x / per, c0 = (int)threadIdx.x - j0 * per;
        uint4* const rows16 = reinterpret_cast<uint4*>(rows) + threadIdx.x;
        unsigned got = 0;  // bit k: unit k was copied
        int j = j0, c = c0;
#pragma unroll
        for (int k = 0; k < LOADS; ++k) {
            if ((int)threadIdx.x + k * QSA_THREADS < total) {
                const bf16* s = src[j];
                if (s) {
                    qsa_cp16(rows16 + k * QSA_THREADS, reinterpret_cast<const uint4*>(s) + c);
                    got |= 1u << k;
                }
            }
            j += dj;
            c += dc;
            if (c >= per) {
                c -= per;
                ++j;
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        j = j0;
        c = c0;
#pragma unroll
        for (int k = 0; k < LOADS; ++k) {
            if (got & (1u << k)) {
                bf16* f = fill[j];
                if (f) reinterpret_cast<uint4*>(f)[c] = rows16[k * QSA_THREADS];
            }
            j += dj;
            c += dc;
            if (c >= per) {
                c -= per;
                ++j;
            }
        }
    } else {
        for (int t = threadIdx.x; t < cn * d; t += blockDim.x) {
            const int j = t / d, c = t - j * d;
            if (!src[j]) continue;
            const bf16 x = src[j][c];
            rows[(size_t)j * d + c] = x;
            if (fill[j]) fill[j][c] = x;
        }
    }
}

// Grid (hkv·groups, splits, rows) (qsa_heads); block QSA_THREADS threads. Row r (q normed and roped)
// attends to its counts[r] (at most sel_stride) selected positions sel[r·sel_stride ..], span sp of
// SPLIT of them; K/V rows are gathered through block table table + r·table_stride (stride 0: the
// rows of one sequence share its table; the decode form passes one table row per sequence). A block
// serves a group of the query heads of one KV head, so each selected row crosses the bus once for the
// group (not once a query head), QSA_CHUNK rows at a time staged in shared memory with every load of
// the chunk in flight together. Writes part_o [rows, hq, splits, d] (unnormalised Σ e·v) and part_ml
// [.., 2] (max, Σ e), as attn_paged_partial.
//
// Each head's arithmetic is that of a block of QSA_THREADS threads serving it alone (qsa_staged.cu
// splits it at its phases and must stay equal): (1) an entry's score by a warp, lanes striding over d,
// acc += q·k, warp_sum, × scale; (2) m = block_max of the span's scores, e = exp(sc − m) (0 for −inf),
// l = block_sum(e), the loops striding by the block size; (3) thread i: acc += e·v[i] over the span's
// entries in ascending order, skipping e == 0.
//
// The row cache (qsa_cache.cu; rc_tags null: none, and the kernel reads every row from the pools as it
// always did). With the cache, phase 3 of a decode-shaped step, after qsa_rc_invalidate and qsa_rc_plan
// of the layer: before the score loop the block decides once for each selected position of its span,
// one thread a position, all at once, from the state plan left (epoch e, slot, line = slot % rc_lines):
// a hit when hitmark[line] == e and then tags[line] == slot + 1 (the tag is not read otherwise); else a
// fill when claim[line] == (e << 32) | slot; else a plain miss. The decisions stay in rc_st (shared
// memory). A hit reads the line's row (rc_k, rc_v [rc_lines, hkv·d]), anything else the pool's row: the
// same bytes, so the output is bit for bit the uncached kernel's. A fill also writes the bytes it read
// (its KV head's d values of K, then of V, V loaded whatever its weights) into the line and sets the
// tag; every KV head's blocks do so for their part, so the whole row is in the line when the step
// ends. Blocks that fill one line write the same bytes (its claim names one slot), and no reader of
// this step trusts that line (its hitmark is not e), while lines that can hit are never written: the
// decisions do not depend on the order of the blocks.
template <int SPLIT>
__device__ __forceinline__ void qsa_attn_partial_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
                     const u32* __restrict__ tables, long long table_stride, const u32* __restrict__ sel,
                     int sel_stride, const u32* __restrict__ counts, float* __restrict__ part_o,
                     float* __restrict__ part_ml, int hq, int hkv, int d, int bs, int splits, float scale,
                     unsigned long long* rc_tags, const u32* __restrict__ rc_hitmark,
                     const unsigned long long* __restrict__ rc_claim, const u32* __restrict__ rc_epoch, bf16* rc_k,
                     bf16* rc_v, long long rc_lines) {
    __shared__ float qs[QSA_GROUP][QSA_MAX_D];
    __shared__ float sc[QSA_GROUP][SPLIT];
    __shared__ __align__(16) bf16 rows[QSA_CHUNK * QSA_MAX_D];
    __shared__ const bf16* src[QSA_CHUNK];
    __shared__ bf16* fill[QSA_CHUNK];
    __shared__ float scratch[32];
    __shared__ unsigned char rc_st[SPLIT];
    __shared__ size_t span_at[SPLIT];
    const QsaHeads hd = qsa_heads(blockIdx.x, hq, hkv);
    const int sp = blockIdx.y, r = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (d > QSA_MAX_D || blockDim.x != QSA_THREADS) return;
    const int kh = hd.kh, ng = hd.n;
    const int n = (int)min(counts[r], (u32)sel_stride);
    const u32* ps = sel + (size_t)r * sel_stride;
    const u32* table = tables + (size_t)r * table_stride;
    const int i0 = sp * SPLIT;
    const int i1 = min(i0 + SPLIT, n);
    const size_t slot0 = ((size_t)r * hq + hd.h0) * splits + sp;  // head h0 + hh: slot0 + hh·splits
    if (i0 >= i1) {
        for (int hh = 0; hh < ng; ++hh) {
            const size_t slot = slot0 + (size_t)hh * splits;
            for (int i = threadIdx.x; i < d; i += blockDim.x) part_o[slot * d + i] = 0.0f;
            if (threadIdx.x == 0) {
                part_ml[2 * slot] = NEG_INF;
                part_ml[2 * slot + 1] = 0.0f;
            }
        }
        return;
    }
    const bool cached = rc_tags != nullptr;
    const u32 rc_e = cached ? *rc_epoch : 0u;
    const u32 rc_l = (u32)rc_lines;
    const size_t row = (size_t)hkv * d;
    const bool vec = (d & 7) == 0 &&
                     ((reinterpret_cast<size_t>(k_pool) | reinterpret_cast<size_t>(v_pool) |
                       reinterpret_cast<size_t>(rc_k) | reinterpret_cast<size_t>(rc_v)) &
                      15) == 0;
    // The span's entries, PER a thread (entry i0 + t + k·QSA_THREADS): each entry's position is asked
    // for first, its latency overlapping the query's loads; its slot (through the block table) is
    // kept for the span, so every chunk's row addresses come from shared memory rather than from two
    // dependent global loads a chunk.
    constexpr int PER = (SPLIT + QSA_THREADS - 1) / QSA_THREADS;
    u32 pe[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int je = i0 + (int)threadIdx.x + k * QSA_THREADS;
        pe[k] = je < i1 ? ps[je] : 0u;
    }
    // The group's query heads (ng·d contiguous values), every load issued before the first store;
    // the register array is indexed only by unrolled loop counters.
    const bf16* qr = q + ((size_t)r * hq + hd.h0) * d;
    const int qn = ng * d;
    constexpr int QLOADS = QSA_GROUP * QSA_MAX_D / QSA_THREADS;
    bf16 qv[QLOADS];
#pragma unroll
    for (int k = 0; k < QLOADS; ++k)
        if ((int)threadIdx.x + k * QSA_THREADS < qn) qv[k] = qr[threadIdx.x + k * QSA_THREADS];
    // Value t = threadIdx.x + k·QSA_THREADS is head t / d, index t % d: stepped without a division.
    const int dh = QSA_THREADS / d, dt = QSA_THREADS - dh * d;
    int qh = (int)threadIdx.x / d, qc = (int)threadIdx.x - qh * d;
#pragma unroll
    for (int k = 0; k < QLOADS; ++k) {
        if ((int)threadIdx.x + k * QSA_THREADS < qn) qs[qh][qc] = bf2f(qv[k]);
        qh += dh;
        qc += dt;
        if (qc >= d) {
            qc -= d;
            ++qh;
        }
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int je = i0 + (int)threadIdx.x + k * QSA_THREADS;
        if (je >= i1) break;
        const size_t at = (size_t)table[pe[k] / bs] * bs + pe[k] % bs;
        span_at[je - i0] = at;
        if (cached) {
            const u32 s = (u32)at;
            const u32 line = s % rc_l;
            // The claim is loaded beside the hitmark (no kernel of this step writes either); the tag
            // only when the line was hit this step (a fill may be writing it otherwise).
            const u32 hm = rc_hitmark[line];
            const unsigned long long cl = rc_claim[line];
            int st = RC_HOST;
            if (hm == rc_e) {
                if (rc_tags[line] == (unsigned long long)s + 1) st = RC_HIT;
            } else if (cl == (((unsigned long long)rc_e << 32) | s)) {
                st = RC_FILL;
            }
            rc_st[je - i0] = (unsigned char)st;
        }
    }
    __syncthreads();
    // Where entry j's KV-head part of K (or V) comes from, and the line it fills (null: none).
    auto source = [&](int j, const bf16* pool, bf16* line_rows, bool want, const bf16** from, bf16** to) {
        const size_t at = span_at[j - i0];
        const int st = cached ? rc_st[j - i0] : RC_HOST;
        const size_t at_line = st == RC_HOST ? 0 : (size_t)((u32)at % rc_l) * row + (size_t)kh * d;
        *to = st == RC_FILL ? line_rows + at_line : nullptr;
        *from = !(want || st == RC_FILL) ? nullptr
                : st == RC_HIT           ? line_rows + at_line
                                         : pool + at * row + (size_t)kh * d;
        return st == RC_FILL ? (long long)(u32)at : -1ll;
    };
    // Phase 1: the scores, a chunk of K rows at a time.
    for (int c0 = i0; c0 < i1; c0 += QSA_CHUNK) {
        const int cn = min(QSA_CHUNK, i1 - c0);
        if (threadIdx.x < cn) {
            const long long filled = source(c0 + threadIdx.x, k_pool, rc_k, true, &src[threadIdx.x], &fill[threadIdx.x]);
            if (filled >= 0) rc_tags[(u32)filled % rc_l] = (unsigned long long)filled + 1;
        }
        __syncthreads();
        qsa_stage_chunk(rows, src, fill, cn, d, vec);
        __syncthreads();
        for (int jj = warp; jj < cn; jj += nw) {
            float acc[QSA_GROUP];
#pragma unroll
            for (int hh = 0; hh < QSA_GROUP; ++hh) acc[hh] = 0.0f;
            for (int i = lane; i < d; i += 32) {
                const float x = bf2f(rows[(size_t)jj * d + i]);
#pragma unroll
                for (int hh = 0; hh < QSA_GROUP; ++hh)
                    if (hh < ng) acc[hh] += qs[hh][i] * x;
            }
#pragma unroll
            for (int hh = 0; hh < QSA_GROUP; ++hh) {
                if (hh < ng) {
                    const float v = warp_sum(acc[hh]) * scale;
                    if (lane == 0) sc[hh][c0 - i0 + jj] = v;
                }
            }
        }
        __syncthreads();
    }
    // Phase 2: each head's softmax weights over the span.
    const int cnt = i1 - i0;
    for (int hh = 0; hh < ng; ++hh) {
        float m = NEG_INF;
        for (int i = threadIdx.x; i < cnt; i += blockDim.x) m = fmaxf(m, sc[hh][i]);
        m = block_max(m, scratch);
        float l = 0.0f;
        for (int i = threadIdx.x; i < cnt; i += blockDim.x) {
            const float e = (m == NEG_INF || sc[hh][i] == NEG_INF) ? 0.0f : expf(sc[hh][i] - m);
            sc[hh][i] = e;
            l += e;
        }
        l = block_sum(l, scratch);
        if (threadIdx.x == 0) {
            const size_t slot = slot0 + (size_t)hh * splits;
            part_ml[2 * slot] = m;
            part_ml[2 * slot + 1] = l;
        }
    }
    __syncthreads();
    // Phase 3: Σ e·v, a chunk of V rows at a time (a row no head weighs is not read unless it fills).
    constexpr int PER_T = QSA_MAX_D / QSA_THREADS;
    float acc[PER_T][QSA_GROUP];
#pragma unroll
    for (int k = 0; k < PER_T; ++k)
#pragma unroll
        for (int hh = 0; hh < QSA_GROUP; ++hh) acc[k][hh] = 0.0f;
    for (int c0 = i0; c0 < i1; c0 += QSA_CHUNK) {
        const int cn = min(QSA_CHUNK, i1 - c0);
        if (threadIdx.x < cn) {
            bool want = false;
            for (int hh = 0; hh < ng; ++hh) want |= sc[hh][c0 - i0 + threadIdx.x] != 0.0f;
            source(c0 + threadIdx.x, v_pool, rc_v, want, &src[threadIdx.x], &fill[threadIdx.x]);
        }
        __syncthreads();
        qsa_stage_chunk(rows, src, fill, cn, d, vec);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < PER_T; ++k) {
            const int i = threadIdx.x + k * QSA_THREADS;
            if (i >= d) break;
            for (int jj = 0; jj < cn; ++jj) {
                if (!src[jj]) continue;
                const float x = bf2f(rows[(size_t)jj * d + i]);
#pragma unroll
                for (int hh = 0; hh < QSA_GROUP; ++hh) {
                    if (hh >= ng) break;
                    const float e = sc[hh][c0 - i0 + jj];
                    if (e == 0.0f) continue;
                    acc[k][hh] += e * x;
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < PER_T; ++k) {
        const int i = threadIdx.x + k * QSA_THREADS;
        if (i >= d) break;
#pragma unroll
        for (int hh = 0; hh < QSA_GROUP; ++hh)
            if (hh < ng) part_o[(slot0 + (size_t)hh * splits) * d + i] = acc[k][hh];
    }
}

// The entry points: decode rows (spans of QSA_SPLIT_DECODE entries) and the prefill form
// (QSA_SPLIT_WIDE).
#define QSA_PARTIAL_PARAMS                                                                                        \
    const bf16 *__restrict__ q, const bf16 *__restrict__ k_pool, const bf16 *__restrict__ v_pool,                \
        const u32 *__restrict__ tables, long long table_stride, const u32 *__restrict__ sel, int sel_stride,     \
        const u32 *__restrict__ counts, float *__restrict__ part_o, float *__restrict__ part_ml, int hq, int hkv, \
        int d, int bs, int splits, float scale, unsigned long long *rc_tags, const u32 *__restrict__ rc_hitmark, \
        const unsigned long long *__restrict__ rc_claim, const u32 *__restrict__ rc_epoch, bf16 *rc_k, bf16 *rc_v, \
        long long rc_lines
#define QSA_PARTIAL_ARGS                                                                                          \
    q, k_pool, v_pool, tables, table_stride, sel, sel_stride, counts, part_o, part_ml, hq, hkv, d, bs, splits,    \
        scale, rc_tags, rc_hitmark, rc_claim, rc_epoch, rc_k, rc_v, rc_lines
extern "C" __global__ void __launch_bounds__(QSA_THREADS) qsa_attn_partial(QSA_PARTIAL_PARAMS) {
    pdl_prologue();
    qsa_attn_partial_impl<QSA_SPLIT_DECODE>(QSA_PARTIAL_ARGS);
}
extern "C" __global__ void __launch_bounds__(QSA_THREADS) qsa_attn_partial_wide(QSA_PARTIAL_PARAMS) {
    pdl_prologue();
    qsa_attn_partial_impl<QSA_SPLIT_WIDE>(QSA_PARTIAL_ARGS);
}

// Splits whose maxima and weights a block of qsa_attn_reduce holds in shared memory at a time.
#define QSA_REDUCE_STAGE 128

// Grid (hq, rows), blockDim.x ≥ d / 2 (the host: 128 for d ≤ 256). Merges the splits of
// qsa_attn_partial and multiplies by sigmoid(gate) (gate, out: [rows, hq·d]), one bf16 rounding:
// M = max_s m_s, den = Σ_s e^(m_s − M)·l_s and num_i = Σ_s e^(m_s − M)·o_s,i over the splits that
// saw an entry (m_s > −inf), each sum in split order. The splits' maxima and weights are read by the
// whole block at once, a stage at a time, so only the sums run in order (thread 0 the denominator from
// shared memory, each thread its values' numerators, their loads unrolled).
extern "C" __global__ void qsa_attn_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                           const bf16* __restrict__ gate, bf16* __restrict__ out, int hq, int d,
                                           int splits) {
    pdl_prologue();
    __shared__ float m_s[QSA_REDUCE_STAGE], w_s[QSA_REDUCE_STAGE], l_s[QSA_REDUCE_STAGE], scratch[32];
    __shared__ float den_s;
    const int h = blockIdx.x, r = blockIdx.y;
    const size_t slot0 = ((size_t)r * hq + h) * splits;
    float M = NEG_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) M = fmaxf(M, part_ml[2 * (slot0 + s)]);
    M = block_max(M, scratch);
    const int i0 = threadIdx.x, i1 = threadIdx.x + blockDim.x;
    float num0 = 0.0f, num1 = 0.0f, den = 0.0f;
#pragma unroll 1
    for (int s0 = 0; s0 < splits; s0 += QSA_REDUCE_STAGE) {
        const int n = min(QSA_REDUCE_STAGE, splits - s0);
        for (int s = threadIdx.x; s < n; s += blockDim.x) {
            const float m = part_ml[2 * (slot0 + s0 + s)];
            m_s[s] = m;
            w_s[s] = m != NEG_INF ? expf(m - M) : 0.0f;
            l_s[s] = part_ml[2 * (slot0 + s0 + s) + 1];
        }
        __syncthreads();
        if (threadIdx.x == 0)
#pragma unroll 8
            for (int s = 0; s < n; ++s)
                if (m_s[s] != NEG_INF) den += w_s[s] * l_s[s];
        const float* po = part_o + (slot0 + s0) * d;
#pragma unroll 16
        for (int s = 0; s < n; ++s) {
            if (m_s[s] != NEG_INF) {
                if (i0 < d) num0 += w_s[s] * po[(size_t)s * d + i0];
                if (i1 < d) num1 += w_s[s] * po[(size_t)s * d + i1];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) den_s = den;
    __syncthreads();
    den = den_s;
    const size_t at = ((size_t)r * hq + h) * d;
    if (i0 < d) out[at + i0] = f2bf((den > 0.0f ? num0 / den : 0.0f) * sigmoid_f(bf2f(gate[at + i0])));
    if (i1 < d) out[at + i1] = f2bf((den > 0.0f ? num1 / den : 0.0f) * sigmoid_f(bf2f(gate[at + i1])));
}
