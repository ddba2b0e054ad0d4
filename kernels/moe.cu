// Routed experts on the device, without the host learning which experts were chosen:
//   moe_sort    groups the (token, choice) pairs by expert and cuts each expert's run into tiles of at
//               most MOE_TILE pairs (one block, counting sort with a block-wide scan over the experts);
//   moe_gemv_*  a grouped GEMV over the tiles: a block multiplies its tile's input rows by a slice of
//               rows of its tile's expert weight, whose address comes from a device table of expert
//               pointers, so only the chosen experts' weights are read (each once per tile);
//   moe_gemv_q* the same grouped GEMV over packed integer experts (words and scales address tables);
//               INT4 with groups of a multiple of 128 on tensor cores (moe_gemv_q4_mma_*, optionally
//               with SwiGLU fused into the down projection's input);
//   moe_combine sums each token's expert outputs times its routing weights, plus the shared expert's
//               output times the sigmoid of its gate when given.
// Pairs are numbered p = token·top_k + choice, as the router writes ids and weights.
#include "packed.cuh"
#include "moe_route.cuh"
#include "add_norm.cuh"

// One block of blockDim threads (a multiple of 32, at most 1024): moe_sort_block (moe_route.cuh) with
// atomic scatter cursors. ids: [n_pairs] expert ids (< e; others are dropped); perm: [n_pairs] pair
// numbers grouped by expert, experts in ascending order (the order within an expert unspecified); tiles:
// [max_tiles, 3] (expert, start in perm, count), expert after expert, the unused tail (0, 0, 0). Dynamic
// shared memory: (2·e + 2) u32.
extern "C" __global__ void moe_sort(const u32* __restrict__ ids, int n_pairs, int e, u32* __restrict__ perm,
                                    u32* __restrict__ tiles, int max_tiles) {
    pdl_prologue();
    extern __shared__ u32 sh[];
    moe_sort_block(ids, n_pairs, e, perm, tiles, max_tiles, sh, false);
}

// ---- The grouped GEMV (bf16 experts, and packed integer experts: INT4 / INT8 pack-quantized, INT6
// gapless) ----
// A bf16 expert weight is W_x = (const bf16*)w_ptrs[x], [n, k] row-major. A packed one is given as
// packed words (w_ptrs[x], [n, words_per_row] u32) and f32 scales (s_ptrs[x], [n, ceil(k / group)]),
// decoded in registers: only the chosen experts' words and scales are read. The packing is quant.cu's:
// value j of a row is the code q + 2^(b-1), LSB first; INT4 8 codes a word, INT8 4, INT6 a 6-bit stream
// over rows padded to 32 values.
//
// Work split: a row is cut into units (8 values for bf16, 32 for packed: 4, 8 or 6 words); a lane group
// of `lanes` lanes (a power of two ≤ 32, chosen by the launcher from the row's unit count so that each
// lane has about D units of a row) shares a row, lane `sub` taking units sub, sub + lanes, ...; each
// lane group owns RPG rows. A lane issues the loads of D units of each of its RPG rows (and their
// scales) before using any, so a short row (k = 512 INT4: 16 units) does not idle half the warp and
// every lane has several 16-byte loads in flight. Per 8-value chunk the rows' codes are decoded and
// dotted with every pair's x chunk (packed: times the chunk's scale), f32 accumulation, then a shuffle
// sum over the lane group. A tile's pairs are taken in passes of at most MMAX (1 or 8); a one-pair pass
// (the common case at decode) runs a body with one accumulator per row, a larger one the MMAX-pair
// body (slots past the pass's pairs repeat its first pair and are not stored). The grid does not
// depend on the routing: every tile slot runs, empty ones return at once.

// bf16 weights (BITS 16), INT4, INT8 and INT6: values per unit, 8-value chunks per unit, u32 words per
// unit, whether the values carry scales, whether the last unit may be partial (INT6: k % 8 == 0, rows
// padded to 32 values).
template <int BITS> struct MoeFmt;
template <> struct MoeFmt<16> {
    static constexpr int VALS = 8, CHUNKS = 1, WORDS = 4;
    static constexpr bool SCALED = false, PARTIAL = false;
    __device__ __forceinline__ static size_t row_words(int k) { return (size_t)(k >> 1); }
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[4]) {
        const uint4 v = __ldg((const uint4*)row + u);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ __forceinline__ static void decode(const u32 w[4], int, float q[8]) {
        unpack8(make_uint4(w[0], w[1], w[2], w[3]), q);
    }
};


template <> struct MoeFmt<4> {
    static constexpr int VALS = 32, CHUNKS = 4, WORDS = 4;
    static constexpr bool SCALED = true, PARTIAL = false;
    __device__ __forceinline__ static size_t row_words(int k) { return (size_t)((k + 31) >> 5) * WORDS; }
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[4]) {
        const uint4 v = __ldg((const uint4*)row + u);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    // Chunk c is word c: 8 codes, LSB first.
    __device__ __forceinline__ static void decode(const u32 w[4], int c, float q[8]) {
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = qval<4>((w[c] >> (4 * e)) & 15u);
    }
};
template <> struct MoeFmt<8> {
    static constexpr int VALS = 32, CHUNKS = 4, WORDS = 8;
    static constexpr bool SCALED = true, PARTIAL = false;
    __device__ __forceinline__ static size_t row_words(int k) { return (size_t)((k + 31) >> 5) * WORDS; }
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[8]) {
        const uint4 a = __ldg((const uint4*)row + 2 * u), b = __ldg((const uint4*)row + 2 * u + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
    // Chunk c is words 2c, 2c + 1: 4 codes each, LSB first.
    __device__ __forceinline__ static void decode(const u32 w[8], int c, float q[8]) {
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = qval<8>((w[2 * c + (e >> 2)] >> (8 * (e & 3))) & 255u);
    }
};
template <> struct MoeFmt<6> {
    static constexpr int VALS = 32, CHUNKS = 4, WORDS = 6;
    static constexpr bool SCALED = true, PARTIAL = true;
    __device__ __forceinline__ static size_t row_words(int k) { return (size_t)((k + 31) >> 5) * WORDS; }
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[6]) {
        const uint2* p = (const uint2*)(row + 6 * u);
        const uint2 a = __ldg(p), b = __ldg(p + 1), c = __ldg(p + 2);
        w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y; w[4] = c.x; w[5] = c.y;
    }
    // Value j of the unit is bits 6j .. 6j + 5 of the 192-bit unit.
    __device__ __forceinline__ static void decode(const u32 w[6], int c, float q[8]) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int bit = 6 * (c * 8 + e), wi = bit >> 5, sh = bit & 31;
            const u32 v = sh <= 26 ? (w[wi] >> sh) : __funnelshift_r(w[wi], w[wi + 1], sh);
            q[e] = qval<6>(v & 63u);
        }
    }
};

// One pass over up to M pairs (pp[0 .. mc), mc ≤ M; slots past mc repeat pair 0 and are not stored) of
// the lane group's RPG rows row0, row0 + rstep, ... (rows ≥ n re-read row n - 1, not stored).
template <int BITS, int RPG, int D, int M, typename OUT>
__device__ __forceinline__ void moe_pass(const u32* __restrict__ W, const float* __restrict__ S,
                                         const bf16* __restrict__ X, int x_div, u32 x_tail, const u32* __restrict__ pp,
                                         int mc, OUT* __restrict__ Y, int n, int k, int group, int lanes,
                                         int sub, int row0, int rstep) {
    typedef MoeFmt<BITS> F;
    const int units = (k + F::VALS - 1) / F::VALS;
    const size_t wpr = F::row_words(k);
    const int scols = F::SCALED ? (k + group - 1) / group : 0;
    // One scale per unit when groups are whole units (always for INT4/INT8 with group % 32 == 0).
    const bool unit_scale = F::SCALED && group % F::VALS == 0;
    const u32* wrow[RPG];
    const float* srow[RPG];
#pragma unroll
    for (int r = 0; r < RPG; ++r) {
        const size_t row = (size_t)min(row0 + r * rstep, n - 1);
        wrow[r] = W + row * wpr;
        srow[r] = F::SCALED ? S + row * scols : nullptr;
    }
    u32 p[M];
    const bf16* xr[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        p[m] = pp[m < mc ? m : 0];
        xr[m] = X + (size_t)moe_x_row(p[m], x_div, x_tail) * k;
    }
    float acc[RPG][M];
#pragma unroll
    for (int r = 0; r < RPG; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    const int step = lanes * D;
#pragma unroll 1
    for (int u0 = sub; u0 < units; u0 += step) {
        // Every load of this step first: D units of each row (and their scales).
        u32 w[D][RPG][F::WORDS];
        float su[D][RPG];
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int u = u0 + d * lanes;
#pragma unroll
            for (int r = 0; r < RPG; ++r) {
                if (u < units) {
                    F::load(wrow[r], u, w[d][r]);
                    su[d][r] = F::SCALED ? __ldg(srow[r] + scale_group(u * F::VALS, k, group)) : 1.0f;
                } else {
#pragma unroll
                    for (int i = 0; i < F::WORDS; ++i) w[d][r][i] = 0;
                    su[d][r] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int u = u0 + d * lanes;
            if (u >= units) break;
#pragma unroll
            for (int c = 0; c < F::CHUNKS; ++c) {
                const int j0 = u * F::VALS + c * 8;
                if (F::PARTIAL && j0 >= k) break;
                if constexpr (M <= 2) {
                    float xf[M][8];
#pragma unroll
                    for (int m = 0; m < M; ++m) unpack8(__ldg((const uint4*)(xr[m] + j0)), xf[m]);
#pragma unroll
                    for (int r = 0; r < RPG; ++r) {
                        float q[8];
                        F::decode(w[d][r], c, q);
                        if constexpr (F::SCALED) {
                            const float s = (c == 0 || unit_scale) ? su[d][r] : __ldg(srow[r] + j0 / group);
#pragma unroll
                            for (int m = 0; m < M; ++m) {
                                float dd = 0.0f;
#pragma unroll
                                for (int e = 0; e < 8; ++e) dd = fmaf(q[e], xf[m][e], dd);
                                acc[r][m] = fmaf(dd, s, acc[r][m]);
                            }
                        } else {
#pragma unroll
                            for (int m = 0; m < M; ++m)
#pragma unroll
                                for (int e = 0; e < 8; ++e) acc[r][m] = fmaf(q[e], xf[m][e], acc[r][m]);
                        }
                    }
                } else {
                    // Many pairs: decode every row's chunk once, then one pair's x chunk at a time.
                    float q[RPG][8];
                    float s[RPG];
#pragma unroll
                    for (int r = 0; r < RPG; ++r) {
                        F::decode(w[d][r], c, q[r]);
                        if constexpr (F::SCALED)
                            s[r] = (c == 0 || unit_scale) ? su[d][r] : __ldg(srow[r] + j0 / group);
                    }
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float xf[8];
                        unpack8(__ldg((const uint4*)(xr[m] + j0)), xf);
#pragma unroll
                        for (int r = 0; r < RPG; ++r) {
                            if constexpr (F::SCALED) {
                                float dd = 0.0f;
#pragma unroll
                                for (int e = 0; e < 8; ++e) dd = fmaf(q[r][e], xf[e], dd);
                                acc[r][m] = fmaf(dd, s[r], acc[r][m]);
                            } else {
#pragma unroll
                                for (int e = 0; e < 8; ++e) acc[r][m] = fmaf(q[r][e], xf[e], acc[r][m]);
                            }
                        }
                    }
                }
            }
        }
    }
    // Sum over the lane group (groups are aligned runs of `lanes` lanes, so xor offsets < lanes stay
    // inside the group).
#pragma unroll
    for (int r = 0; r < RPG; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m)
            for (int o = lanes >> 1; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);
    if (sub == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m)
            if (m < mc)
#pragma unroll
                for (int r = 0; r < RPG; ++r) {
                    const int row = row0 + r * rstep;
                    if (row < n) store_out<OUT>(Y, (size_t)p[m] * n + row, acc[r][m]);
                }
    }
}

// The grouped GEMV. Grid (row blocks, max_tiles); block a multiple of 32 threads (the launcher uses
// 256). Tile t = (expert x, start, count): for each of its pairs p = perm[start + m],
// y[p, :] = W_x · X[moe_x_row(p), :]. The block's blockDim / lanes lane groups cover row blocks of
// (blockDim / lanes) · RPG rows, blockIdx.x, blockIdx.x + gridDim.x, ... (any grid.x is correct; the
// launcher uses ceil(n / rows per block)); group g of row block b owns rows b · groups · RPG + g +
// r · groups. Shape rules: bf16 k % 8 == 0, INT4/INT8 k % 32 == 0, INT6 k % 8 == 0, group % 8 == 0
// (group = k for one scale per row); W, X 16-byte aligned.
template <int BITS, int RPG, int D, int MMAX, typename OUT>
__device__ __forceinline__ void moe_gemv_tile(const unsigned long long* __restrict__ w_ptrs,
                                              const unsigned long long* __restrict__ s_ptrs,
                                              const bf16* __restrict__ X, int x_div, u32 x_tail, const u32* __restrict__ perm,
                                              const u32* __restrict__ tiles, OUT* __restrict__ Y, int n, int k,
                                              int group, int lanes) {
    const int cnt = (int)tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;
    const u32 x = tiles[3 * blockIdx.y], start = tiles[3 * blockIdx.y + 1];
    const int groups = blockDim.x / lanes;
    const int g = threadIdx.x / lanes, sub = threadIdx.x & (lanes - 1);
    const u32* W = (const u32*)w_ptrs[x];
    const float* S = MoeFmt<BITS>::SCALED ? (const float*)s_ptrs[x] : nullptr;
    const u32* pp = perm + start;
    for (int rb = blockIdx.x * groups * RPG; rb < n; rb += gridDim.x * groups * RPG) {
        const int row0 = rb + g;
        for (int base = 0; base < cnt; base += MMAX) {
            const int mc = min(MMAX, cnt - base);
            if (MMAX == 1 || mc == 1)
                moe_pass<BITS, RPG, D, 1, OUT>(W, S, X, x_div, x_tail, pp + base, mc, Y, n, k, group, lanes, sub, row0, groups);
            else
                moe_pass<BITS, RPG, D, (MMAX > 1 ? MMAX : 1), OUT>(W, S, X, x_div, x_tail, pp + base, mc, Y, n, k, group, lanes, sub, row0, groups);
        }
    }
}

// ---- INT4 grouped GEMV on tensor cores (groups of a multiple of 128 values, k % 128 == 0) ----
// A warp multiplies 16 rows of its tile's expert (a row group) by the tile's ≤ 8 pairs with
// mma.m16n8k16 (bf16 in, f32 accumulate): the INT4 codes decode exactly to bf16 integers -8..7 (code
// pairs (c_i, c_(i+4)) of a word masked into 0x4300|c bf16 halves = 128 + c, minus 136 by one bf16x2
// fma: about 1.4 instructions a value instead of a shift, mask, or and subtract each plus an FMA), the
// pairs' x rows are the B operand (column n = pair slot n), the products are exact and summed in f32.
// The k order inside an mma is free (a dot product), so lane (g, q) (g = lane / 4, q = lane % 4) loads
// one 16-byte run of rows g and g + 8 per 128-value span, values 32q .. 32q + 31, and word j of it
// feeds two mmas with x values 32q + 8j .. 32q + 8j + 7 of the same span, permuted to the code pairs by
// byte permutes. Each span's f32 partial sums are scaled by the rows' group scales (one per span, as
// group % 128 == 0) and added to the lane's accumulators. The block's MOE_MMA_WARPS warps split the
// spans (warp w: spans w, w + MOE_MMA_WARPS, ...), each loading MOE_MMA_SPW spans of both rows (and
// their scales) before use, and the x rows of the tile's pairs are staged in shared memory once per
// block (the weight loads already in flight); the warps' sums are added in warp order in shared memory.
// A block takes R = MOE_MMA_SPW / ceil(spans / MOE_MMA_WARPS) row groups (at least one) of 16 rows:
// where a warp's spans of a row group are fewer than its load slots (short rows: the down projection,
// k = 512, one span a warp), its slots hold the spans of R row groups, so a block reads R times the
// weights for one x staging and one wait on the tile table (a block of 4 KB spent most of its life
// there). Grid (ceil(n / (16 · R)), max_tiles); block 32 · MOE_MMA_WARPS threads; dynamic shared memory
// MOE_TILE · (k / 8 + 4) · 16 bytes (each pair's x row, padded by 64 bytes, its chunks in
// moe_mma_x_slot's order: against bank conflicts).
// Shape rules: k % 128 == 0, group % 128 == 0, words and x 16-byte aligned. Lanes of pair slots past
// the tile's count feed zeros; rows ≥ n re-read row n - 1 and are not stored. SWIGLU (the down
// projection of decode steps): X holds the pairs' gate|up rows [., 2k] and the staged x is
// bf16(silu(gate) · up), computed as swiglu_bf16 computes it, so no separate activation launch.
#define MOE_MMA_WARPS 4
#define MOE_MMA_SPW 4

// Codes 0..7 of word w (LSB first) as four bf16x2 values (c0, c4), (c1, c5), (c2, c6), (c3, c7), each
// code c as the exact bf16 c - 8.
__device__ __forceinline__ void moe_q4_bf16x2(u32 w, u32 out[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 h = ((w >> (4 * i)) & 0x000f000fu) | 0x43004300u;
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out[i]) : "r"(h), "r"(0x3f803f80u), "r"(0xc308c308u));
    }
}

__device__ __forceinline__ void moe_mma_bf16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Row groups a block of the tensor-core grouped GEMV takes for rows of `spans` 128-value spans (the
// launcher mirrors this).
__device__ __forceinline__ int moe_mma_groups(int spans) {
    const int c = (spans + MOE_MMA_WARPS - 1) / MOE_MMA_WARPS;
    return c >= MOE_MMA_SPW ? 1 : MOE_MMA_SPW / c;
}

// Where chunk u (values 8u .. 8u + 7) of a staged x row lies: u = 16 s + 4 q + j (span s, lane q of a
// quad, word j of the lane's 16 bytes) at 16 s + 4 j + q. A quarter-warp's lanes (g, g + 1; q = 0..3)
// then read four neighbouring chunks of two rows 64 bytes apart (the padding): eight bank groups.
// In chunk order, with 16 bytes of padding, the lanes q and q + 2 met in one bank group (two-way).
__device__ __forceinline__ int moe_mma_x_slot(int u) { return (u & ~15) | ((u & 3) << 2) | ((u >> 2) & 3); }

template <bool SWIGLU, typename OUT>
__device__ __forceinline__ void moe_gemv_q4_mma_tile(const unsigned long long* __restrict__ w_ptrs,
                                                     const unsigned long long* __restrict__ s_ptrs,
                                                     const bf16* __restrict__ X, int x_div, u32 x_tail,
                                                     const u32* __restrict__ perm, const u32* __restrict__ tiles,
                                                     OUT* __restrict__ Y, int n, int k, int group) {
    extern __shared__ uint4 sx[];
    __shared__ float red[MOE_MMA_SPW][MOE_MMA_WARPS - 1][4][32];
    const int cnt = (int)tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;
    const u32 ex = tiles[3 * blockIdx.y], start = tiles[3 * blockIdx.y + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const size_t wpr = (size_t)(k >> 3);
    const int scols = (k + group - 1) / group;
    const int spans = k >> 7;
    // A warp's spans of a row group (at most), the block's row groups: with R > 1 a warp's load
    // slot i holds span warp + MOE_MMA_WARPS · (i % C) of row group i / C, in one round; with R = 1
    // slot i of round r holds span warp + MOE_MMA_WARPS · (r · MOE_MMA_SPW + i).
    const int C = (spans + MOE_MMA_WARPS - 1) / MOE_MMA_WARPS;
    const int R = moe_mma_groups(spans);
    const int rb0 = blockIdx.x * 16 * R;
    const u32* W = (const u32*)w_ptrs[ex];
    const float* S = (const float*)s_ptrs[ex];
    const int xrow = (k >> 3) + 4; // uint4 per staged x row
    const bool has_x = g < cnt;
    const uint4* xs = sx + g * xrow + q;

    float acc[MOE_MMA_SPW][4];
#pragma unroll
    for (int j = 0; j < MOE_MMA_SPW; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    uint4 la[MOE_MMA_SPW], lb[MOE_MMA_SPW];
    float sa[MOE_MMA_SPW], sb[MOE_MMA_SPW];
    // Slot i of round r: its row group and span (spans past the row's are none).
    auto slot = [&](int r, int i, int& j, int& sp) {
        if (R == 1) {
            j = 0;
            sp = warp + MOE_MMA_WARPS * (r * MOE_MMA_SPW + i);
        } else {
            j = i / C;
            sp = j < R ? warp + MOE_MMA_WARPS * (i - j * C) : spans;
        }
    };
    // Every load of a round first: its slots' spans of both rows and their scales.
    auto load = [&](int r) {
#pragma unroll
        for (int i = 0; i < MOE_MMA_SPW; ++i) {
            int j, sp;
            slot(r, i, j, sp);
            if (sp < spans) {
                const int rb = rb0 + 16 * j;
                const int ra = min(rb + g, n - 1), rbb = min(rb + g + 8, n - 1);
                la[i] = __ldg((const uint4*)(W + (size_t)ra * wpr) + q + 4 * sp);
                lb[i] = __ldg((const uint4*)(W + (size_t)rbb * wpr) + q + 4 * sp);
                const int sg = scale_group(sp << 7, k, group);
                sa[i] = __ldg(S + (size_t)ra * scols + sg);
                sb[i] = __ldg(S + (size_t)rbb * scols + sg);
            } else {
                la[i] = lb[i] = make_uint4(0u, 0u, 0u, 0u);
                sa[i] = sb[i] = 0.0f;
            }
        }
    };
    load(0);
    {
        // The tile's x rows into shared memory while the first weight loads are in flight.
        const int per = k >> 3;
        for (int idx = threadIdx.x; idx < cnt * per; idx += blockDim.x) {
            const int m = idx / per, u = idx - m * per;
            const u32 p = perm[start + m];
            if constexpr (SWIGLU) {
                // X is the pairs' gate|up rows [., 2k]: x = bf16(silu(gate) · up), as swiglu_bf16.
                const uint4* gu = (const uint4*)(X + (size_t)moe_x_row(p, x_div, x_tail) * 2 * k);
                sx[m * xrow + moe_mma_x_slot(u)] = swiglu8(gu, per, u);
            } else {
                sx[m * xrow + moe_mma_x_slot(u)] = __ldg((const uint4*)(X + (size_t)moe_x_row(p, x_div, x_tail) * k) + u);
            }
        }
    }
    __syncthreads();
    const int rounds = R == 1 ? (C + MOE_MMA_SPW - 1) / MOE_MMA_SPW : 1;
    for (int r = 0; r < rounds; ++r) {
        if (r > 0) load(r);
#pragma unroll
        for (int i = 0; i < MOE_MMA_SPW; ++i) {
            int j, sp;
            slot(r, i, j, sp);
            if (sp >= spans) continue;
            float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const u32 wA[4] = {la[i].x, la[i].y, la[i].z, la[i].w};
            const u32 wB[4] = {lb[i].x, lb[i].y, lb[i].z, lb[i].w};
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const uint4 xv = has_x ? xs[16 * sp + 4 * jj] : make_uint4(0u, 0u, 0u, 0u);
                // x pairs matching the code pairs (c0, c4), (c1, c5), (c2, c6), (c3, c7).
                const u32 b0 = __byte_perm(xv.x, xv.z, 0x5410), b1 = __byte_perm(xv.x, xv.z, 0x7632);
                const u32 b2 = __byte_perm(xv.y, xv.w, 0x5410), b3 = __byte_perm(xv.y, xv.w, 0x7632);
                u32 pa[4], pb[4];
                moe_q4_bf16x2(wA[jj], pa);
                moe_q4_bf16x2(wB[jj], pb);
                moe_mma_bf16(t, pa[0], pb[0], pa[1], pb[1], b0, b1);
                moe_mma_bf16(t, pa[2], pb[2], pa[3], pb[3], b2, b3);
            }
            // Into row group j's accumulators (selected without indexing registers).
#pragma unroll
            for (int jj = 0; jj < MOE_MMA_SPW; ++jj) {
                if (jj == j) {
                    acc[jj][0] = fmaf(sa[i], t[0], acc[jj][0]);
                    acc[jj][1] = fmaf(sa[i], t[1], acc[jj][1]);
                    acc[jj][2] = fmaf(sb[i], t[2], acc[jj][2]);
                    acc[jj][3] = fmaf(sb[i], t[3], acc[jj][3]);
                }
            }
        }
    }
    if (warp > 0) {
#pragma unroll
        for (int j = 0; j < MOE_MMA_SPW; ++j)
            if (j < R)
#pragma unroll
                for (int c = 0; c < 4; ++c) red[j][warp - 1][c][lane] = acc[j][c];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < MOE_MMA_SPW; ++j) {
        if (j >= R) break;
#pragma unroll
        for (int w = 1; w < MOE_MMA_WARPS; ++w)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[j][c] += red[j][w - 1][c][lane];
        // acc[j][0], [1]: row rb + g, pair slots 2q, 2q + 1; acc[j][2], [3]: row rb + g + 8.
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int m = 2 * q + (c & 1);
            const int row = rb0 + 16 * j + g + (c >> 1) * 8;
            if (m < cnt && row < n) store_out<OUT>(Y, (size_t)perm[start + m] * n + row, acc[j][c]);
        }
    }
}

// Entry points. moe_gemv_{bf16 | f32}: bf16 experts (W_x = (const bf16*)w_ptrs[x]; s_ptrs and group
// unused); moe_gemv_q{bits}_{bf16 | f32}: packed experts. Y: [n_pairs, n], bf16 (the experts' fused
// gate|up rows) or f32 (the experts' down projections, combined by moe_combine). The plain forms take
// a tile's pairs up to eight at a time (RPG 4; D 2 for bf16, 1 packed); the *_m1 forms (for decode,
// where a tile holds one pair or few) one at a time with fewer registers (RPG 4, D 2 for bf16; RPG 2
// and D 2 for INT4/INT6, D 1 for INT8), re-reading the rows from cache for a tile's further pairs.
// The launcher mirrors these (RPG, D) to size the grid and pick `lanes`.
#define MOE_ARGS const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const bf16* X, int x_div, unsigned x_tail, const u32* perm, const u32* tiles
#define MOE_PASS w_ptrs, s_ptrs, X, x_div, x_tail, perm, tiles, Y, n, k, group, lanes
extern "C" __global__ void __launch_bounds__(256) moe_gemv_bf16(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<16, 4, 2, 8, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_f32(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<16, 4, 2, 8, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q4_bf16(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<4, 4, 1, 8, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q4_f32(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<4, 4, 1, 8, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q8_bf16(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<8, 4, 1, 8, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q8_f32(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<8, 4, 1, 8, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q6_bf16(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<6, 4, 1, 8, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256) moe_gemv_q6_f32(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<6, 4, 1, 8, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_bf16_m1(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<16, 4, 2, 1, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_f32_m1(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<16, 4, 2, 1, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_q4_bf16_m1(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<4, 2, 2, 1, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_q4_f32_m1(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<4, 2, 2, 1, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_q8_bf16_m1(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<8, 2, 1, 1, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_q8_f32_m1(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<8, 2, 1, 1, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_q6_bf16_m1(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<6, 2, 2, 1, bf16>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) moe_gemv_q6_f32_m1(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_tile<6, 2, 2, 1, float>(MOE_PASS); }
extern "C" __global__ void __launch_bounds__(32 * MOE_MMA_WARPS) moe_gemv_q4_mma_bf16(MOE_ARGS, bf16* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_q4_mma_tile<false, bf16>(w_ptrs, s_ptrs, X, x_div, x_tail, perm, tiles, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(32 * MOE_MMA_WARPS) moe_gemv_q4_mma_f32(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_q4_mma_tile<false, float>(w_ptrs, s_ptrs, X, x_div, x_tail, perm, tiles, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(32 * MOE_MMA_WARPS) moe_gemv_q4_mma_swiglu_f32(MOE_ARGS, float* Y, int n, int k, int group, int lanes) { pdl_prologue(); moe_gemv_q4_mma_tile<true, float>(w_ptrs, s_ptrs, X, x_div, x_tail, perm, tiles, Y, n, k, group); }
#undef MOE_ARGS
#undef MOE_PASS

// out[t, j] = Σ_c weights[t, c] · y[t·top_k + c, j], in choice order. Grid (tokens, ceil(h / (4 ·
// blockDim))); each thread sums 4 consecutive columns (16-byte loads when h % 4 == 0 and y is 16-byte
// aligned), the loads of all choices independent of the kept flags, so they are in flight together
// rather than one dependent round trip per choice. y: [tokens·top_k, h] f32; weights: [tokens, top_k] f32;
// out: [tokens, h] bf16. Pairs whose expert id was dropped by moe_sort (id ≥ e) count as zero (their
// y rows, never written, are loaded but not added). shared_gate [tokens] (bf16) with the shared expert's
// output, either shared_y [tokens, h] bf16 (computed apart) or shared_y32 [tokens, h] f32 (the rows the
// grouped GEMV wrote after the routed pairs'), or none of them: the shared expert's output times
// sigmoid(gate), added before the one rounding. shared_gate32 [tokens] f32 (the gate logits the decode
// routing computed with the router's) stands in for shared_gate when given.
// Dynamic shared memory: 8·top_k bytes (the token's weights and kept flags).
//
// moe_combine_cols is one thread's 4 columns j .. j + 3 (fewer at the row's end) of token t's sum,
// rounded once to bf16 into o[0..4]: every kernel that combines (moe_combine, and
// moe_combine_add_rms_norm below) goes through it, so that they give the same bits. yt: the token's
// first pair row; cw, keep: its weights and kept flags; sw, sy, sy32: the shared expert's weight and
// the token's row at column j (null when absent); vec: h % 4 == 0 and y 16-byte aligned.
__device__ __forceinline__ void moe_combine_cols(const float* __restrict__ yt, const float* cw, const int* keep,
                                                 float sw, const bf16* sy, const float* sy32, bf16* o,
                                                 int top_k, int h, int j, bool vec) {
    if (vec) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
        for (int c = 0; c < top_k; ++c) {
            const float4 v = __ldg((const float4*)(yt + (size_t)c * h + j));
            const float w = cw[c];
            if (keep[c]) {
                acc.x += w * v.x;
                acc.y += w * v.y;
                acc.z += w * v.z;
                acc.w += w * v.w;
            }
        }
        if (sy) {
#pragma unroll
            for (int q = 0; q < 4; ++q) (&acc.x)[q] += sw * bf2f(sy[q]);
        }
        if (sy32) {
#pragma unroll
            for (int q = 0; q < 4; ++q) (&acc.x)[q] += sw * sy32[q];
        }
        __nv_bfloat162 lo, hi;
        lo.x = f2bf(acc.x);
        lo.y = f2bf(acc.y);
        hi.x = f2bf(acc.z);
        hi.y = f2bf(acc.w);
        if (((size_t)o & 7) == 0) {
            __nv_bfloat162* o2 = (__nv_bfloat162*)o;
            o2[0] = lo;
            o2[1] = hi;
        } else {
            o[0] = lo.x;
            o[1] = lo.y;
            o[2] = hi.x;
            o[3] = hi.y;
        }
    } else {
        const int cols = min(4, h - j);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int c = 0; c < top_k; ++c) {
            const float w = cw[c];
            const bool kc = keep[c];
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (q < cols) {
                    const float v = __ldg(yt + (size_t)c * h + j + q);
                    if (kc) acc[q] += w * v;
                }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (q < cols) o[q] = f2bf(sy ? acc[q] + sw * bf2f(sy[q]) : sy32 ? acc[q] + sw * sy32[q] : acc[q]);
    }
}

// Loads token t's routing weights and kept flags into cw and keep (shared memory) and returns the
// shared expert's weight: sigmoid of its gate logit (f32 from the routing or bf16), 0 without one.
__device__ __forceinline__ float moe_combine_weights(const float* __restrict__ weights, const u32* __restrict__ ids,
                                                     int e, const bf16* shared_gate, const float* shared_gate32,
                                                     float* cw, int* keep, int t, int top_k) {
    for (int c = threadIdx.x; c < top_k; c += blockDim.x) {
        const size_t p = (size_t)t * top_k + c;
        keep[c] = ids[p] < (u32)e;
        cw[c] = weights[p];
    }
    return shared_gate32 ? sigmoid_f(shared_gate32[t]) : shared_gate ? sigmoid_f(bf2f(shared_gate[t])) : 0.0f;
}

extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                       const u32* __restrict__ ids, int e, const bf16* __restrict__ shared_y,
                                       const float* __restrict__ shared_y32, const bf16* __restrict__ shared_gate,
                                       const float* __restrict__ shared_gate32, bf16* __restrict__ out, int top_k,
                                       int h) {
    pdl_prologue();
    extern __shared__ float cw[];
    int* keep = (int*)(cw + top_k);
    const int t = blockIdx.x;
    const float sw = moe_combine_weights(weights, ids, e, shared_gate, shared_gate32, cw, keep, t, top_k);
    __syncthreads();
    const int j = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (j >= h) return;
    const size_t at = (size_t)t * h + j;
    moe_combine_cols(y + (size_t)t * top_k * h, cw, keep, sw, shared_y ? shared_y + at : nullptr,
                     shared_y32 ? shared_y32 + at : nullptr, out + at, top_k, h, j,
                     (h & 3) == 0 && ((size_t)y & 15) == 0);
}

// The combine of the MoE sublayer fused with the residual add and the next sublayer's RMSNorm: one
// launch where moe_combine and add_rms_norm_bf16 took two. Token t's
// combined row (moe_combine_cols, the same columns a thread as in moe_combine, so the same bits) goes
// to shared memory, then add_rms_norm_row (add_norm.cuh, as add_rms_norm_bf16 with the same block
// size) adds it to acc[t, :] and writes normed[t, :] = rms_norm(acc[t, :]) · (offset + w). The
// combined row itself is not written. Arguments as moe_combine, plus acc, normed: [tokens, h] bf16; w:
// [h] bf16. Grid (tokens); block row_threads(h) threads (32 to 256, a multiple of 32); dynamic shared
// memory 16·ceil(top_k / 2) bytes of weights and flags, then h bf16.
extern "C" __global__ void moe_combine_add_rms_norm(const float* __restrict__ y, const float* __restrict__ weights,
                                                    const u32* __restrict__ ids, int e,
                                                    const bf16* __restrict__ shared_y,
                                                    const float* __restrict__ shared_y32,
                                                    const bf16* __restrict__ shared_gate,
                                                    const float* __restrict__ shared_gate32, bf16* __restrict__ acc,
                                                    const bf16* __restrict__ w, bf16* __restrict__ normed, int top_k,
                                                    int h, float eps, float offset) {
    pdl_prologue();
    extern __shared__ float cw[];
    __shared__ float scratch[32];
    int* keep = (int*)(cw + top_k);
    bf16* row = (bf16*)(cw + 4 * ((2 * top_k + 3) / 4));  // 16-byte aligned
    const int t = blockIdx.x;
    const float sw = moe_combine_weights(weights, ids, e, shared_gate, shared_gate32, cw, keep, t, top_k);
    __syncthreads();
    const float* yt = y + (size_t)t * top_k * h;
    const bool vec = (h & 3) == 0 && ((size_t)y & 15) == 0;
    for (int j = threadIdx.x * 4; j < h; j += blockDim.x * 4) {
        const size_t at = (size_t)t * h + j;
        moe_combine_cols(yt, cw, keep, sw, shared_y ? shared_y + at : nullptr, shared_y32 ? shared_y32 + at : nullptr,
                         row + j, top_k, h, j, vec);
    }
    __syncthreads();
    add_rms_norm_row(acc + (size_t)t * h, row, w, normed + (size_t)t * h, h, eps, offset, scratch);
}
