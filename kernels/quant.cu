// Packed-integer weights (compressed-tensors pack-quantized INT4 / INT8, and INT6 gapless), consumed in
// their packed form: the decode GEMV `Y[m, :] = dequant(W) · X[m, :]` for M ≤ 8 rows of X, and the
// tile dequantiser the prefill GEMM feeds to cuBLAS (into a caller-owned bf16 workspace).
//
// W is [n, words_per_row] u32, row-major; value j of a row is the unsigned code q + 2^(b-1), LSB first:
//   INT4: 8 codes per word (value j at bits 4(j%8) of word j/8)       32 values = 4 words
//   INT8: 4 codes per word (value j at bits 8(j%4) of word j/4)       32 values = 8 words
//   INT6: rows padded to 32 values, value j at bits [6j, 6j+6) of the row's bit stream: 32 values = 6 words
// S is [n, ceil(k / group)] f32 (group = k for per-channel scales); w[r, j] = q[r, j] · S[r, j / group].
// A "unit" is 32 consecutive values of a row; each thread decodes whole units. Requirements (checked on
// the host): k % 32 == 0 for INT4/INT8, k % 8 == 0 for INT6 (its last unit is partial when k % 32 != 0),
// group % 8 == 0, 16-byte aligned W, X.
#include "add_norm.cuh"
#include "packed.cuh"

#define QROWS 2

// u32 words of a packed row of k values (rows hold whole 32-value units of BITS words each).
template <int BITS>
__device__ __forceinline__ long long q_row_words(int k) { return (long long)((k + 31) / 32) * BITS; }

// Words of one unit, streamed (the weights are read once).
template <int BITS> using Unit = PackedUnit<BITS, true>;

// Loads unit u of each of a slot's first `nrows` rows: its words and the scale of each 8-value chunk (the
// chunk index is clamped to k - 1 so the INT6 tail past k reads a valid scale; that chunk is skipped), or
// with UNIT_SCALE (group % 32 == 0: a unit lies inside one group) the unit's one scale in sc[r][0].
// Rows past nrows are not read (zero words; their sums are never stored).
template <int BITS, bool UNIT_SCALE>
__device__ __forceinline__ void fetch_unit(const u32* const wrow[QROWS], const float* const srow[QROWS],
                                           int nrows, int u, int k, int group,
                                           u32 w[QROWS][Unit<BITS>::WORDS], float sc[QROWS][4]) {
#pragma unroll
    for (int r = 0; r < QROWS; ++r) {
        if (r < nrows) {
            Unit<BITS>::load(wrow[r], u, w[r]);
            if (UNIT_SCALE) {
                sc[r][0] = __ldg(srow[r] + scale_group(u * 32, k, group));
            } else {
#pragma unroll
                for (int c = 0; c < 4; ++c) sc[r][c] = __ldg(srow[r] + min(u * 32 + c * 8, k - 1) / group);
            }
        } else {
#pragma unroll
            for (int i = 0; i < Unit<BITS>::WORDS; ++i) w[r][i] = 0u;
#pragma unroll
            for (int c = 0; c < 4; ++c) sc[r][c] = 0.0f;
        }
    }
}

// acc[r][m] += unit u of row r · x[m, 32u .. 32u + 32) for the slot's rows (words cw, scales cs as
// fetch_unit leaves them). Per 8-value chunk: decode the chunk of every row once, then for each m one x
// chunk (read-only cache, shared by the block) and the dot, times the chunk's scale (with UNIT_SCALE the
// unit's one scale, and for M ≤ 4 the unit's 32-value dot is summed before the one multiply). With SW,
// X is a gate|up buffer [M, 2k] and x = bf16(silu(gate) · up), computed as swiglu_bf16 computes it.
template <int BITS, int M, bool UNIT_SCALE, bool SW>
__device__ __forceinline__ void unit_dot(const u32 cw[QROWS][Unit<BITS>::WORDS], const float cs[QROWS][4],
                                         const bf16* __restrict__ X, int k, int u, float acc[QROWS][M]) {
    // Up to M = 4 the unit's dot is summed first (one scale multiply per unit); past that the extra
    // accumulators would cost more registers than the per-chunk multiplies cost time.
    constexpr bool SUM_UNIT = UNIT_SCALE && M <= 4;
    float d[QROWS][M];
#pragma unroll
    for (int r = 0; r < QROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) d[r][m] = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int j0 = u * 32 + c * 8;
        // Only INT6 has a partial last unit (k % 8 == 0); INT4/INT8 need k % 32 == 0.
        if (BITS == 6 && j0 >= k) continue;
        float q[QROWS][8];
#pragma unroll
        for (int r = 0; r < QROWS; ++r)
            decode8<BITS>(cw[r], c, q[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xf[8];
            unpack8(SW ? swiglu8((const uint4*)(X + (size_t)m * 2 * k), k >> 3, j0 >> 3)
                       : __ldg((const uint4*)(X + (size_t)m * k + j0)),
                    xf);
#pragma unroll
            for (int r = 0; r < QROWS; ++r) {
                if (SUM_UNIT) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[r][m] = fmaf(q[r][e], xf[e], d[r][m]);
                } else {
                    float t = 0.0f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) t = fmaf(q[r][e], xf[e], t);
                    acc[r][m] = fmaf(t, cs[r][UNIT_SCALE ? 0 : c], acc[r][m]);
                }
            }
        }
    }
    if (SUM_UNIT)
#pragma unroll
        for (int r = 0; r < QROWS; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] = fmaf(d[r][m], cs[r][0], acc[r][m]);
}

// A block of 256 threads is split into row slots of tpr = 2^tpr_log2 threads (1..256); a slot owns rps
// (1..QROWS) consecutive rows and its threads take units p, p + tpr, ... (p the thread's place in the
// slot). With UNIT_SCALE (group % 32 == 0: groups of 32, 64, 128, or per-row scales with k % 32 == 0) a
// thread loads unit u + tpr (words and scale) before computing unit u, so two units per row are in
// flight, and needs one scale load and one integer division per unit and row. The slot's sums are reduced with shuffles within a warp and through
// shared memory across the warps of a slot wider than 32. The host picks rps and tpr per shape so that
// small n still fills the GPU (see the launcher). The two variants are separate functions so that the
// rare one's registers do not weigh on the common one.
template <int BITS, int M, typename OUT, bool UNIT_SCALE, bool SW>
__device__ __noinline__ void gemv_q_body(const u32* __restrict__ W, const float* __restrict__ S,
                                         const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                         int group, int rps, int tpr_log2, int block, float (*red)[QROWS][M]) {
    typedef Unit<BITS> U;
    const int tpr = 1 << tpr_log2;
    const int slot = threadIdx.x >> tpr_log2, p = threadIdx.x & (tpr - 1);
    const long long row0 = ((long long)block * (256 >> tpr_log2) + slot) * rps;
    const int nrows = (int)max(0LL, min((long long)rps, (long long)n - row0));
    const int units = (k + 31) >> 5;
    const int uend = nrows > 0 ? units : 0;
    const size_t wpr = (size_t)units * U::WORDS;
    const int scols = (k + group - 1) / group;
    const u32* wrow[QROWS];
    const float* srow[QROWS];
#pragma unroll
    for (int r = 0; r < QROWS; ++r) {
        const long long row = max(0LL, min(row0 + r, (long long)n - 1));
        wrow[r] = W + row * wpr;
        srow[r] = S + row * scols;
    }
    float acc[QROWS][M];
#pragma unroll
    for (int r = 0; r < QROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

    if (UNIT_SCALE) {
        // Two units per row in flight: unit u + tpr is loaded before unit u is computed.
        u32 w[QROWS][U::WORDS];
        float sc[QROWS][4];
        int u = p;
        if (u < uend) fetch_unit<BITS, true>(wrow, srow, nrows, u, k, group, w, sc);
#pragma unroll 1
        while (u < uend) {
            u32 cw[QROWS][U::WORDS];
            float cs[QROWS][4];
#pragma unroll
            for (int r = 0; r < QROWS; ++r) {
#pragma unroll
                for (int i = 0; i < U::WORDS; ++i) cw[r][i] = w[r][i];
                cs[r][0] = sc[r][0];
            }
            const int un = u + tpr;
            if (un < uend) fetch_unit<BITS, true>(wrow, srow, nrows, un, k, group, w, sc);
            unit_dot<BITS, M, true, SW>(cw, cs, X, k, u, acc);
            u = un;
        }
    } else {
        // Rare shapes (groups of 8 or 16 values, INT6 rows of k % 32 != 0 per channel): one unit at a
        // time, which keeps this path's registers below the common one's.
#pragma unroll 1
        for (int u = p; u < uend; u += tpr) {
            u32 w[QROWS][U::WORDS];
            float sc[QROWS][4];
            fetch_unit<BITS, false>(wrow, srow, nrows, u, k, group, w, sc);
            unit_dot<BITS, M, false, SW>(w, sc, X, k, u, acc);
        }
    }
    gemv_slot_sum<QROWS, M, OUT>(acc, red, Y, n, row0, nrows, rps, tpr_log2, p);
}

template <int BITS, int M, typename OUT, bool SW = false>
__device__ __forceinline__ void gemv_q_impl(const u32* __restrict__ W, const float* __restrict__ S,
                                            const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                            int group, int rps, int tpr_log2, int block) {
    __shared__ float red[8][QROWS][M];
    if (group % 32 == 0)
        gemv_q_body<BITS, M, OUT, true, SW>(W, S, X, Y, n, k, group, rps, tpr_log2, block, red);
    else
        gemv_q_body<BITS, M, OUT, false, SW>(W, S, X, Y, n, k, group, rps, tpr_log2, block, red);
}

// ---- One row of X (M = 1), INT8 and INT4, on 16-byte chunks ----
// The row-slot GEMV above works in 32-value units with two in flight a row; at M = 1 its per-thread work
// is short and its loads are few. Here a thread streams 16-byte chunks (INT8: 16 values, INT4: 32) of up
// to R rows of its slot, U chunks a row per round, so R·U = 8 loads of 16 bytes are in flight per
// thread before the first FMA; X's matching values come through the read-only cache once a chunk for all
// R rows. Per-row scales multiply the row's sum once at the end; group scales (group % chunk == 0: a
// chunk lies inside one group) multiply each chunk's dot. The cut is the row-slot one (gemv_plan over
// chunks: rps ≤ R rows a slot of 2^tpr_log2 threads), so gemv_slot_sum and gemv_slot_span apply as they
// are. Requires k % (128 / BITS) == 0 and 16-byte aligned W and X.
template <int BITS, int R, typename OUT>
__device__ __forceinline__ void gemv_qv_impl(const u32* __restrict__ W, const float* __restrict__ S,
                                             const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                             int group, int rps, int tpr_log2, int block) {
    constexpr int CV = 128 / BITS;  // values of a chunk
    constexpr int U = 8 / R;        // chunks a row per round
    __shared__ float red[8][R][1];
    const int tpr = 1 << tpr_log2;
    const int slot = threadIdx.x >> tpr_log2, p = threadIdx.x & (tpr - 1);
    const long long row0 = ((long long)block * (256 >> tpr_log2) + slot) * rps;
    const int nrows = (int)max(0LL, min((long long)rps, (long long)n - row0));
    const int chunks = k / CV;
    const int cend = nrows > 0 ? chunks : 0;
    const bool per_row = group >= k;
    const int scols = (k + group - 1) / group;
    const uint4* wrow[R];
    const float* srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long row = max(0LL, min(row0 + r, (long long)n - 1));
        wrow[r] = (const uint4*)(W + row * (long long)(k / (32 / BITS)));
        srow[r] = S + row * scols;
    }
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
    const uint4* xv = (const uint4*)X;
#pragma unroll 1
    for (int c0 = p; c0 < cend; c0 += U * tpr) {
        uint4 w[R][U];
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int c = c0 + i * tpr;
#pragma unroll
            for (int r = 0; r < R; ++r)
                w[r][i] = (r < nrows && c < chunks) ? __ldcs(wrow[r] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int c = c0 + i * tpr;
            if (c >= chunks) break;
            float d[R];
#pragma unroll
            for (int r = 0; r < R; ++r) d[r] = 0.0f;
#pragma unroll
            for (int h = 0; h < CV / 8; ++h) {
                float xf[8];
                unpack8(__ldg(xv + (size_t)c * (CV / 8) + h), xf);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const u32 ww[4] = {w[r][i].x, w[r][i].y, w[r][i].z, w[r][i].w};
                    float q[8];
                    decode8<BITS>(ww, h, q);
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[r] = fmaf(q[e], xf[e], d[r]);
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r)
                acc[r][0] = per_row ? acc[r][0] + d[r] : fmaf(d[r], __ldg(srow[r] + (c * CV) / group), acc[r][0]);
        }
    }
    if (per_row)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][0] *= nrows > r ? __ldg(srow[r]) : 0.0f;
    gemv_slot_sum<R, 1, OUT>(acc, red, Y, n, row0, nrows, rps, tpr_log2, p);
}

// ---- Batched decode (M = 2..8) on the tensor cores: INT8, INT4 and INT6 ----
// The FMA GEMV above spends ~2 instructions per weight and row of X (the multiply and the x widening) on
// top of the decode, so at M = 8 it is bound by issue, not by HBM. Here every weight is decoded once to a
// bf16 pair (integer codes: exact) and multiplied with all rows of X at once by mma.sync m16n8k16 (bf16
// in, f32 accumulation): W's 16-row tile is A, X^T (k x 8, rows of X past m are zero) is B.
//
// A block of 256 threads (8 warps) owns 16 rows of W; warp w takes the k-blocks w, w + 8, ... of KB
// values (INT8: 64, INT4 and INT6: 128), so each lane streams one piece of KB/4 values of its two rows
// (g and g + 8, g = lane / 4, t = lane % 4) per k-block: piece 4b + t of the row, codes
// KB·b + (KB/4)·t + .. (INT8 and INT4: 16 bytes; INT6: one 24-byte unit). The reduction runs over k, so
// the mma's k order is free: each lane's A and B pairs are its own codes and the matching x values in
// memory order (lane t of B, column g, reads x[g, KB·b + (KB/4)·t ..]); only the pairing of A and B must
// agree, not the positions inside the 16. Scales: per row (group ≥ k) once at the end; per group
// (group % KB == 0) on each k-block's partial product, which lies inside one group. The 8 warps'
// fragments are summed in shared memory. Requires 16-byte aligned W and X and k % KB == 0 for INT8 and
// INT4; INT6 takes any k % 8 == 0 (pieces past the row's units are skipped and x past k reads as zero,
// so the padding codes of a partial last unit multiply zeros).

// a · b + c on two bf16 lanes (exact here: every operand and result is a small integer).
__device__ __forceinline__ u32 tc_fma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#define TC_ONE2 0x3F803F80u  // bf16x2 (1, 1)

// c += A (16x16 fragment a) · B (16x8 fragment b0 b1).
__device__ __forceinline__ void tc_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Codes 2h, 2h + 1 of an INT8 word as a bf16 pair of q = code - 128 (low half first). bf16 holds 128 + c
// exactly only for c < 128, so the low 7 bits go to the mantissa of 128 and the top bit picks the
// subtrahend: (128 + c_lo) - (c_top ? 128 : 256) = c - 128.
__device__ __forceinline__ u32 tc_pair8(u32 w, int h) {
    const u32 b = 2 * h;
    const u32 x = __byte_perm(w, 0x43u, b | 0x40u | ((b + 1) << 8) | 0x4000u);  // [c0, 0x43, c1, 0x43]
    return tc_fma2(x & 0x437F437Fu, TC_ONE2, (x & 0x00800080u) ^ 0xC380C380u);
}
// Codes 2i, 2i + 1 of an INT4 word (the nibbles of byte i) as a bf16 pair of q = code - 8: 128 + code,
// minus 136.
__device__ __forceinline__ u32 tc_pair4(u32 w, int i) {
    const u32 x = __byte_perm(w, w >> 4, (u32)i | ((u32)(i + 4) << 8));
    return tc_fma2((x & 0x000F000Fu) | 0x43004300u, TC_ONE2, 0xC308C308u);
}
// Codes 2h, 2h + 1 (h = 0..15) of an INT6 unit (6 words, a 192-bit stream) as a bf16 pair of
// q = code - 32: the 12 bits at 12h (across a word boundary when they start past bit 20), each 6-bit code
// in the mantissa of 128, minus 160. h is a compile-time constant after unrolling, so the word index and
// the shift fold away.
__device__ __forceinline__ u32 tc_pair6(const u32 w[6], int h) {
    const int bit = 12 * h, wi = bit >> 5, sh = bit & 31;
    const u32 v = sh <= 20 ? (w[wi] >> sh) : __funnelshift_r(w[wi], w[wi + 1], sh);
    const u32 x = (v & 0x3Fu) | ((v << 10) & 0x003F0000u) | 0x43004300u;
    return tc_fma2(x, TC_ONE2, 0xC320C320u);
}

// The unit decode of the tensor-core GEMV: a lane's piece of one row per k-block (WORDS words, KB / 4
// values) and its codes as bf16 pairs. KB: values of a k-block; U: k-blocks in flight a warp.
template <int BITS> struct TcPiece;
template <> struct TcPiece<8> {
    static constexpr int KB = 64, U = 4, WORDS = 4;
    __device__ __forceinline__ static void load(const u32* row, int p, u32 w[4]) {
        const uint4 v = __ldcs((const uint4*)row + p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ __forceinline__ static u32 pair(const u32 w[4], int h) { return tc_pair8(w[h >> 1], h & 1); }
};
template <> struct TcPiece<4> {
    static constexpr int KB = 128, U = 2, WORDS = 4;
    __device__ __forceinline__ static void load(const u32* row, int p, u32 w[4]) {
        const uint4 v = __ldcs((const uint4*)row + p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ __forceinline__ static u32 pair(const u32 w[4], int h) { return tc_pair4(w[h >> 2], h & 3); }
};
template <> struct TcPiece<6> {
    static constexpr int KB = 128, U = 2, WORDS = 6;
    // A piece is one unit: three 8-byte loads (a unit is 24 bytes, 8-byte aligned).
    __device__ __forceinline__ static void load(const u32* row, int p, u32 w[6]) { Unit<6>::load(row, p, w); }
    __device__ __forceinline__ static u32 pair(const u32 w[6], int h) { return tc_pair6(w, h); }
};

template <int BITS, bool PER_ROW, typename OUT>
__device__ __forceinline__ void gemv_tc_body(const u32* __restrict__ W, const float* __restrict__ S,
                                             const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                             int group, int m, int block) {
    typedef TcPiece<BITS> P;
    constexpr int KB = P::KB, U = P::U, WORDS = P::WORDS;
    constexpr int PV = KB / 4;   // values of a piece
    constexpr int XV = PV / 8;   // x chunks (16 bytes, 8 values) a piece
    __shared__ float red[8][32][4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long tile0 = (long long)block * 16;
    // Rows past n read row n - 1 (never stored).
    const long long ra = min(tile0 + g, (long long)n - 1), rb = min(tile0 + g + 8, (long long)n - 1);
    const int pieces = (k + PV - 1) / PV;  // pieces a row (INT8, INT4: k / PV; INT6: its units)
    const int nblk = (pieces + 3) >> 2;
    const size_t wpr = (size_t)pieces * WORDS;  // u32 words a row
    const u32* wa = W + ra * wpr;
    const u32* wb = W + rb * wpr;
    const bool xon = g < m;
    const uint4* xr = (const uint4*)(X + (size_t)(xon ? g : 0) * k);
    const int scols = (k + group - 1) / group;
    const float* sa = S + ra * scols;
    const float* sb = S + rb * scols;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int b0 = warp; b0 < nblk; b0 += 8 * U) {
        u32 pa[U][WORDS], pb[U][WORDS];
        uint4 px[U][XV];
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int p = 4 * (b0 + 8 * i) + t;
            const bool on = p < pieces;
            if (on) {
                P::load(wa, p, pa[i]);
                P::load(wb, p, pb[i]);
            } else {
#pragma unroll
                for (int e = 0; e < WORDS; ++e) pa[i][e] = pb[i][e] = 0u;
            }
#pragma unroll
            for (int v = 0; v < XV; ++v) {
                // Only INT6 has a partial last piece (k % 8 == 0); INT8 and INT4 need k % KB == 0.
                const bool xin = BITS != 6 || PV * p + 8 * v < k;
                px[i][v] = on && xon && xin ? __ldg(xr + XV * p + v) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int b = b0 + 8 * i;
            u32 xw[4 * XV];
#pragma unroll
            for (int v = 0; v < XV; ++v) {
                xw[4 * v] = px[i][v].x;
                xw[4 * v + 1] = px[i][v].y;
                xw[4 * v + 2] = px[i][v].z;
                xw[4 * v + 3] = px[i][v].w;
            }
            float cp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            // Step s pairs A codes 4s .. 4s + 3 of the lane's piece with x words 2s, 2s + 1.
#pragma unroll
            for (int s = 0; s < KB / 16; ++s) {
                const u32 a[4] = {P::pair(pa[i], 2 * s), P::pair(pb[i], 2 * s), P::pair(pa[i], 2 * s + 1),
                                  P::pair(pb[i], 2 * s + 1)};
                if (PER_ROW)
                    tc_mma(c, a, xw[2 * s], xw[2 * s + 1]);
                else
                    tc_mma(cp, a, xw[2 * s], xw[2 * s + 1]);
            }
            if (!PER_ROW && b < nblk) {
                const float s0 = __ldg(sa + (b * KB) / group), s1 = __ldg(sb + (b * KB) / group);
                c[0] = fmaf(cp[0], s0, c[0]);
                c[1] = fmaf(cp[1], s0, c[1]);
                c[2] = fmaf(cp[2], s1, c[2]);
                c[3] = fmaf(cp[3], s1, c[3]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][lane][i] = c[i];
    __syncthreads();
    if (threadIdx.x < 128) {
        // Output (row r of the tile, column j of X): c[(r / 8) · 2 + j % 2] of lane (r % 8) · 4 + j / 2.
        const int r = threadIdx.x >> 3, j = threadIdx.x & 7;
        const int ln = (r & 7) * 4 + (j >> 1), ci = (r >> 3) * 2 + (j & 1);
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) v += red[w][ln][ci];
        const long long row = tile0 + r;
        if (row < n && j < m) {
            if (PER_ROW) v *= __ldg(S + row);
            store_out<OUT>(Y, (size_t)j * n + row, v);
        }
    }
}

template <int BITS, typename OUT>
__device__ __forceinline__ void gemv_tc_impl(const u32* __restrict__ W, const float* __restrict__ S,
                                             const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                             int group, int m, int block) {
    if (group >= k)
        gemv_tc_body<BITS, true, OUT>(W, S, X, Y, n, k, group, m, block);
    else
        gemv_tc_body<BITS, false, OUT>(W, S, X, Y, n, k, group, m, block);
}

// Rows [row0, row0 + rows) of dequant(W) as bf16 into OUT [rows, k]: one thread per unit. S null: the
// integer codes q themselves (exact in bf16), for a GEMM that applies per-row scales afterwards.
template <int BITS>
__device__ __forceinline__ void dequant_q_impl(const u32* __restrict__ W, const float* __restrict__ S,
                                               bf16* __restrict__ OUT, int row0, int rows, int k, int group) {
    typedef Unit<BITS> U;
    const int units = (k + 31) >> 5;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)rows * units) return;
    const int rr = (int)(t / units), u = (int)(t % units);
    const long long row = (long long)row0 + rr;
    const int scols = (k + group - 1) / group;
    u32 w[U::WORDS];
    U::load(W + row * units * U::WORDS, u, w);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int j0 = u * 32 + c * 8;
        if (j0 >= k) break;
        const float s = S ? __ldg(S + row * scols + j0 / group) : 1.0f;
        u32 o[4];
        dequant8_bf16<BITS, U>(w, c, s, o);
        *(uint4*)(OUT + (size_t)rr * k + j0) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// Entry points. Each runs the segment table t (common.cuh): a block finds its segment and runs the body
// on that weight, its scales, output and n with its index inside the segment; a single GEMV is a
// one-segment table. The first statement asks L2 for the block's weight rows before the PDL wait.
#define GEMV_Q_ARGS const GemvSegs t, const bf16* X, int k, int group

// The weight rows of this block's segment that a row-slot (q_slot_span) or tensor-core (q_tile_span)
// block reads, for pdl_prologue_prefetch.
template <int BITS>
__device__ __forceinline__ RowSpan q_slot_span(const GemvSegs& t, int k) {
    return gemv_slot_span(gemv_seg(t), 4 * q_row_words<BITS>(k));
}
template <int BITS>
__device__ __forceinline__ RowSpan q_tile_span(const GemvSegs& t, int k) {
    return gemv_tile_span(gemv_seg(t), 4 * q_row_words<BITS>(k));
}

// The row-slot (gemv_q_impl; SW: X the gate|up rows, see unit_dot) and tensor-core (gemv_tc_impl)
// GEMVs on this block's segment of t.
template <int BITS, int M, typename OUT, bool SW = false>
__device__ __forceinline__ void gemv_q_segs(const GemvSegs& t, const bf16* X, int k, int group) {
    const GemvSeg s = gemv_seg(t);
    gemv_q_impl<BITS, M, OUT, SW>((const u32*)s.w, s.s, X, (OUT*)s.y, s.n, k, group, s.rps, s.tpr_log2,
                                  gemv_seg_block(s));
}
template <int BITS, typename OUT>
__device__ __forceinline__ void gemv_tc_segs(const GemvSegs& t, const bf16* X, int k, int group, int m) {
    const GemvSeg s = gemv_seg(t);
    gemv_tc_impl<BITS, OUT>((const u32*)s.w, s.s, X, (OUT*)s.y, s.n, k, group, m, gemv_seg_block(s));
}

// Row slots: 256 threads; per segment rps ∈ 1..QROWS rows a slot, slots of 2^tpr_log2 ≤ 256 threads,
// ceil(n / (rps · 256 / 2^tpr_log2)) blocks. Y: [M, n] per segment.
// M ≤ 4: the registers of one resident block.
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m2(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m3(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 3, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m4(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 4, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 1, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m2(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m3(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 3, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m4(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 4, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m2(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m3(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 3, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m4(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 4, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m2(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m3(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 3, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m4(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 4, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m2(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m3(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 3, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m4(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 4, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 1, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m2(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m3(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 3, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m4(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 4, float>(t, X, k, group); }
// M ≥ 5: held to the registers of two resident blocks.
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_m5(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 5, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_m6(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 6, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_m7(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 7, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_m8(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 8, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_f32_m5(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 5, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_f32_m6(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 6, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_f32_m7(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 7, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_f32_m8(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 8, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_m5(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 5, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_m6(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 6, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_m7(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 7, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_m8(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 8, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_f32_m5(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 5, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_f32_m6(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 6, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_f32_m7(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 7, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_f32_m8(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 8, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_m5(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 5, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_m6(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 6, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_m7(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 7, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_m8(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 8, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_f32_m5(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 5, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_f32_m6(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 6, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_f32_m7(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 7, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_f32_m8(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 8, float>(t, X, k, group); }
// INT8 M = 1: held to four resident blocks, so that n = 8192's 512 blocks are resident at once.
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 1, float>(t, X, k, group); }
// M = 1 followed by the residual add and the next RMSNorm of the output row (a mixer's output
// projection): the same cut and sums as gemv_q{4,6,8}_m1, y written as there, then the last block to
// finish adds y to acc and writes normed (last_block_add_rms_norm, add_norm.cuh: add_rms_norm_bf16's
// bits, its block size being this one's 256 threads). One segment; n = the row's d. Dynamic shared
// memory: n bf16.
#define GEMV_Q_NORM_ARGS GEMV_Q_ARGS, bf16* acc, const bf16* nw, bf16* normed, u32* ticket, float eps, float offset
template <int BITS>
__device__ __forceinline__ void gemv_q_norm(const GemvSegs& t, const bf16* X, int k, int group, bf16* acc,
                                            const bf16* nw, bf16* normed, u32* ticket, float eps, float offset) {
    extern __shared__ __align__(16) unsigned short gemv_norm_row[];
    gemv_q_segs<BITS, 1, bf16>(t, X, k, group);
    last_block_add_rms_norm((const bf16*)t.seg[0].y, acc, nw, normed, t.seg[0].n, eps, offset, ticket,
                            gemv_norm_row);
}
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m1_norm(GEMV_Q_NORM_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_norm<4>(t, X, k, group, acc, nw, normed, ticket, eps, offset); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m1_norm(GEMV_Q_NORM_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_norm<6>(t, X, k, group, acc, nw, normed, ticket, eps, offset); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8_m1_norm(GEMV_Q_NORM_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_norm<8>(t, X, k, group, acc, nw, normed, ticket, eps, offset); }
// M = 1 with the SwiGLU staged: X is a gate|up row [2k], x = bf16(silu(gate) · up) (an MLP's down
// projection without the activation launch); the same cut and sums as gemv_q{4,6,8}_m1.
extern "C" __global__ void __launch_bounds__(256) gemv_q4_sw_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_q_segs<4, 1, bf16, true>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_sw_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<6>(t, k)); gemv_q_segs<6, 1, bf16, true>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8_sw_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_q_segs<8, 1, bf16, true>(t, X, k, group); }
// M = 1 on 16-byte chunks (gemv_qv_impl): R rows a slot at most, 8 loads of 16 bytes in flight per thread.
template <int BITS, int R, typename OUT>
__device__ __forceinline__ void gemv_qv_segs(const GemvSegs& t, const bf16* X, int k, int group) {
    const GemvSeg s = gemv_seg(t);
    gemv_qv_impl<BITS, R, OUT>((const u32*)s.w, s.s, X, (OUT*)s.y, s.n, k, group, s.rps, s.tpr_log2,
                               gemv_seg_block(s));
}
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8v1_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_qv_segs<8, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8v1_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_qv_segs<8, 1, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8v2_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_qv_segs<8, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8v2_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_qv_segs<8, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8v4_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_qv_segs<8, 4, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q8v4_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<8>(t, k)); gemv_qv_segs<8, 4, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q4v1_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_qv_segs<4, 1, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q4v1_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_qv_segs<4, 1, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q4v2_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_qv_segs<4, 2, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q4v2_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_qv_segs<4, 2, float>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q4v4_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_qv_segs<4, 4, bf16>(t, X, k, group); }
extern "C" __global__ void __launch_bounds__(256, 4) gemv_q4v4_f32_m1(GEMV_Q_ARGS) { pdl_prologue_prefetch(q_slot_span<4>(t, k)); gemv_qv_segs<4, 4, float>(t, X, k, group); }
// Batched decode on the tensor cores: 256 threads, ceil(n / 16) blocks a segment, 2 ≤ m ≤ 8 rows of X,
// Y: [m, n] per segment. INT8: k % 64 == 0; INT4: k % 128 == 0; INT6: k % 8 == 0; group ≥ k (per row)
// or group % KB == 0 (INT8: 64, INT4 and INT6: 128).
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_tc(GEMV_Q_ARGS, int m) { pdl_prologue_prefetch(q_tile_span<8>(t, k)); gemv_tc_segs<8, bf16>(t, X, k, group, m); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q8_tc_f32(GEMV_Q_ARGS, int m) { pdl_prologue_prefetch(q_tile_span<8>(t, k)); gemv_tc_segs<8, float>(t, X, k, group, m); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_tc(GEMV_Q_ARGS, int m) { pdl_prologue_prefetch(q_tile_span<4>(t, k)); gemv_tc_segs<4, bf16>(t, X, k, group, m); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q4_tc_f32(GEMV_Q_ARGS, int m) { pdl_prologue_prefetch(q_tile_span<4>(t, k)); gemv_tc_segs<4, float>(t, X, k, group, m); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_tc(GEMV_Q_ARGS, int m) { pdl_prologue_prefetch(q_tile_span<6>(t, k)); gemv_tc_segs<6, bf16>(t, X, k, group, m); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q6_tc_f32(GEMV_Q_ARGS, int m) { pdl_prologue_prefetch(q_tile_span<6>(t, k)); gemv_tc_segs<6, float>(t, X, k, group, m); }
// The per-row scales of a GEMM over integer codes: Y[i, row0 + j] = bf16(YT[i, j] · S[row0 + j]) for
// i < m, j < rows, YT [m, rows] f32 (the product with the codes), Y [m, n]. One thread per element.
extern "C" __global__ void __launch_bounds__(256) scale_cols_bf16(const float* __restrict__ YT, const float* __restrict__ S,
                                                                  bf16* __restrict__ Y, int m, int n, int row0, int rows) {
    pdl_prologue();
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)m * rows) return;
    const int i = (int)(t / rows), j = (int)(t % rows);
    Y[(size_t)i * n + row0 + j] = f2bf(YT[t] * __ldg(S + row0 + j));
}
// Dequantise rows [row0, row0 + rows) into a bf16 [rows, k] tile: 256 threads, one per unit of 32 values.
extern "C" __global__ void __launch_bounds__(256) dequant_q4(const u32* W, const float* S, bf16* OUT, int row0, int rows, int k, int group) {
    pdl_prologue();
    dequant_q_impl<4>(W, S, OUT, row0, rows, k, group);
}
extern "C" __global__ void __launch_bounds__(256) dequant_q8(const u32* W, const float* S, bf16* OUT, int row0, int rows, int k, int group) {
    pdl_prologue();
    dequant_q_impl<8>(W, S, OUT, row0, rows, k, group);
}
extern "C" __global__ void __launch_bounds__(256) dequant_q6(const u32* W, const float* S, bf16* OUT, int row0, int rows, int k, int group) {
    pdl_prologue();
    dequant_q_impl<6>(W, S, OUT, row0, rows, k, group);
}
