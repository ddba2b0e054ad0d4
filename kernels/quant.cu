// Packed-integer weights (compressed-tensors pack-quantized INT4 / INT8, and INT6 gapless), consumed in
// their packed form: the decode GEMV `Y[m, :] = dequant(W) · X[m, :]` for M ≤ 8 rows of X, and the
// tile dequantiser the prefill GEMM feeds to cuBLAS (into a caller-owned bf16 workspace).
//
// W is [n, words_per_row] u32, row-major; value j of a row is the unsigned code q + 2^(b-1), LSB first:
//   INT4: 8 codes per word (value j at bits 4(j%8) of word j/8)       32 values = 4 words
//   INT8: 4 codes per word (value j at bits 8(j%4) of word j/4)       32 values = 8 words
//   INT6: rows padded to 32 values, value j at bits [6j, 6j+6) of the row's bit stream: 32 values = 6 words
// S is [n, ceil(k / group)] f32 (group = k for per-channel scales); w[r, j] = q[r, j] · S[r, j / group].
// A "unit" is 32 consecutive values of a row; each lane decodes whole units. Requirements (checked on
// the host): k % 32 == 0 for INT4/INT8, k % 8 == 0 for INT6 (its last unit is partial when k % 32 != 0),
// group % 8 == 0, 16-byte aligned W, X.
#include "common.cuh"

#define QROWS 2

// Unsigned code -> signed value as f32: (code | 2^23 bit pattern) is the float 2^23 + code, exact.
template <int BITS>
__device__ __forceinline__ float qval(u32 code) {
    return __uint_as_float(code | 0x4B000000u) - (8388608.0f + (float)(1 << (BITS - 1)));
}

// Words of one unit (4, 8 or 6) from a row, streamed (the weights are read once).
template <int BITS> struct Unit;
template <> struct Unit<4> {
    static constexpr int WORDS = 4;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[4]) {
        const uint4 v = __ldcs((const uint4*)row + u);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[4], int j) { return (w[j >> 3] >> ((j & 7) * 4)) & 15u; }
};
template <> struct Unit<8> {
    static constexpr int WORDS = 8;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[8]) {
        const uint4 a = __ldcs((const uint4*)row + 2 * u), b = __ldcs((const uint4*)row + 2 * u + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[8], int j) { return (w[j >> 2] >> ((j & 3) * 8)) & 255u; }
};
template <> struct Unit<6> {
    static constexpr int WORDS = 6;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[6]) {
        const uint2* p = (const uint2*)(row + 6 * u);
        const uint2 a = __ldcs(p), b = __ldcs(p + 1), c = __ldcs(p + 2);
        w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y; w[4] = c.x; w[5] = c.y;
    }
    // j is a compile-time constant after unrolling, so the word index and shift fold away.
    __device__ __forceinline__ static u32 code(const u32 w[6], int j) {
        const int bit = 6 * j, wi = bit >> 5, sh = bit & 31;
        const u32 v = sh <= 26 ? (w[wi] >> sh) : __funnelshift_r(w[wi], w[wi + 1], sh);
        return v & 63u;
    }
};

template <typename OUT>
__device__ __forceinline__ void qput(OUT* y, size_t i, float v);
template <>
__device__ __forceinline__ void qput<bf16>(bf16* y, size_t i, float v) { y[i] = f2bf(v); }
template <>
__device__ __forceinline__ void qput<float>(float* y, size_t i, float v) { y[i] = v; }

// Loads unit u of each of a warp's rows: its words and the scale of each 8-value chunk (the chunk
// index is clamped to k - 1 so the INT6 tail past k reads a valid scale; that chunk is skipped).
template <int BITS>
__device__ __forceinline__ void fetch_unit(const u32* const wrow[QROWS], const float* const srow[QROWS],
                                           int u, int k, int group, u32 w[QROWS][Unit<BITS>::WORDS],
                                           float sc[QROWS][4]) {
#pragma unroll
    for (int r = 0; r < QROWS; ++r) {
        Unit<BITS>::load(wrow[r], u, w[r]);
#pragma unroll
        for (int c = 0; c < 4; ++c) sc[r][c] = __ldg(srow[r] + min(u * 32 + c * 8, k - 1) / group);
    }
}

// One warp owns QROWS consecutive rows (rows past n re-read row n - 1 and are not stored); lane l takes
// units l, l+32, ... and loads unit u+32 (words and scales) before computing unit u, so two units' loads
// are in flight. Per 8-value chunk: decode the chunk of every row once, then for each m one x chunk
// (read-only cache, shared by the block's warps), dot, times the chunk's scale.
template <int BITS, int M, typename OUT>
__device__ __forceinline__ void gemv_q_impl(const u32* __restrict__ W, const float* __restrict__ S,
                                            const bf16* __restrict__ X, OUT* __restrict__ Y, int n, int k,
                                            int group) {
    typedef Unit<BITS> U;
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long row0 = warp * QROWS;
    if (row0 >= n) return;
    const int nrows = (int)min((long long)QROWS, (long long)n - row0);
    const int units = (k + 31) >> 5;
    const size_t wpr = (size_t)units * U::WORDS;
    const int scols = (k + group - 1) / group;
    const u32* wrow[QROWS];
    const float* srow[QROWS];
#pragma unroll
    for (int r = 0; r < QROWS; ++r) {
        const long long row = min(row0 + r, (long long)n - 1);
        wrow[r] = W + row * wpr;
        srow[r] = S + row * scols;
    }
    float acc[QROWS][M];
#pragma unroll
    for (int r = 0; r < QROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

    u32 w[QROWS][U::WORDS];
    float sc[QROWS][4];
    int u = lane;
    if (u < units) fetch_unit<BITS>(wrow, srow, u, k, group, w, sc);
#pragma unroll 1
    while (u < units) {
        u32 cw[QROWS][U::WORDS];
        float cs[QROWS][4];
#pragma unroll
        for (int r = 0; r < QROWS; ++r) {
#pragma unroll
            for (int i = 0; i < U::WORDS; ++i) cw[r][i] = w[r][i];
#pragma unroll
            for (int c = 0; c < 4; ++c) cs[r][c] = sc[r][c];
        }
        const int un = u + 32;
        if (un < units) fetch_unit<BITS>(wrow, srow, un, k, group, w, sc);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int j0 = u * 32 + c * 8;
            // Only INT6 has a partial last unit (k % 8 == 0); INT4/INT8 need k % 32 == 0.
            if (BITS == 6 && j0 >= k) continue;
            float q[QROWS][8];
#pragma unroll
            for (int r = 0; r < QROWS; ++r)
#pragma unroll
                for (int e = 0; e < 8; ++e) q[r][e] = qval<BITS>(U::code(cw[r], c * 8 + e));
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float xf[8];
                unpack8(__ldg((const uint4*)(X + (size_t)m * k + j0)), xf);
#pragma unroll
                for (int r = 0; r < QROWS; ++r) {
                    float d = 0.0f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) d = fmaf(q[r][e], xf[e], d);
                    acc[r][m] = fmaf(d, cs[r][c], acc[r][m]);
                }
            }
        }
        u = un;
    }
#pragma unroll
    for (int r = 0; r < QROWS; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < QROWS; ++r)
            if (r < nrows)
#pragma unroll
                for (int m = 0; m < M; ++m) qput<OUT>(Y, (size_t)m * n + row0 + r, acc[r][m]);
    }
}

// Rows [row0, row0 + rows) of dequant(W) as bf16 into OUT [rows, k]: one thread per unit.
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
        const float s = __ldg(S + row * scols + j0 / group);
        u32 o[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const bf16 lo = f2bf(qval<BITS>(U::code(w, c * 8 + 2 * e)) * s);
            const bf16 hi = f2bf(qval<BITS>(U::code(w, c * 8 + 2 * e + 1)) * s);
            o[e] = (u32)__bfloat16_as_ushort(lo) | ((u32)__bfloat16_as_ushort(hi) << 16);
        }
        *(uint4*)(OUT + (size_t)rr * k + j0) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// Entry points. GEMV: 256 threads (8 warps of QROWS rows), grid = ceil(n / 16). Y: [M, n].
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m1(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 1, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m2(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 2, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m3(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 3, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m4(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 4, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m5(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 5, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m6(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 6, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m7(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 7, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_m8(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<4, 8, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m1(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 1, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m2(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 2, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m3(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 3, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m4(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 4, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m5(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 5, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m6(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 6, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m7(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 7, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q4_f32_m8(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<4, 8, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m1(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 1, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m2(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 2, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m3(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 3, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m4(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 4, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m5(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 5, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m6(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 6, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m7(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 7, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_m8(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<8, 8, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m1(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 1, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m2(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 2, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m3(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 3, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m4(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 4, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m5(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 5, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m6(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 6, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m7(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 7, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q8_f32_m8(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<8, 8, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m1(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 1, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m2(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 2, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m3(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 3, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m4(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 4, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m5(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 5, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m6(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 6, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m7(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 7, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_m8(const u32* W, const float* S, const bf16* X, bf16* Y, int n, int k, int group) { gemv_q_impl<6, 8, bf16>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m1(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 1, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m2(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 2, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m3(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 3, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m4(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 4, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m5(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 5, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m6(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 6, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m7(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 7, float>(W, S, X, Y, n, k, group); }
extern "C" __global__ void __launch_bounds__(256) gemv_q6_f32_m8(const u32* W, const float* S, const bf16* X, float* Y, int n, int k, int group) { gemv_q_impl<6, 8, float>(W, S, X, Y, n, k, group); }
// Dequantise rows [row0, row0 + rows) into a bf16 [rows, k] tile: 256 threads, one per unit of 32 values.
extern "C" __global__ void __launch_bounds__(256) dequant_q4(const u32* W, const float* S, bf16* OUT, int row0, int rows, int k, int group) { dequant_q_impl<4>(W, S, OUT, row0, rows, k, group); }
extern "C" __global__ void __launch_bounds__(256) dequant_q8(const u32* W, const float* S, bf16* OUT, int row0, int rows, int k, int group) { dequant_q_impl<8>(W, S, OUT, row0, rows, k, group); }
extern "C" __global__ void __launch_bounds__(256) dequant_q6(const u32* W, const float* S, bf16* OUT, int row0, int rows, int k, int group) { dequant_q_impl<6>(W, S, OUT, row0, rows, k, group); }
