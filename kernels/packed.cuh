// The packed-integer weight layout (compressed-tensors pack-quantized INT4 / INT8, INT6 gapless), shared
// by every kernel that reads it. A row is [words_per_row] u32; value j of a row is the unsigned code
// q + 2^(b-1), LSB first: INT4 8 codes a word, INT8 4, INT6 a 6-bit stream over rows padded to 32
// values. A "unit" is 32 consecutive values of a row: 4, 8 or 6 words.
#pragma once
#include "common.cuh"

// The scale column of value v of a row (v / group) in the streaming loops of the packed GEMVs, which ask
// for every unit or span they fetch: 0 for per-row scales (group ≥ k), a shift for a power-of-two group,
// a division (some twenty instructions) only for other groups.
__device__ __forceinline__ int scale_group(int v, int k, int group) {
    if (group >= k) return 0;
    if ((group & (group - 1)) == 0) return v >> (__ffs(group) - 1);
    return v / group;
}

// Unsigned code -> signed value as f32: (code | 2^23 bit pattern) is the float 2^23 + code, exact.
template <int BITS>
__device__ __forceinline__ float qval(u32 code) {
    return __uint_as_float(code | 0x4B000000u) - (8388608.0f + (float)(1 << (BITS - 1)));
}

// A 16-byte / 8-byte load: streamed (evict-first, weights read once) or through the read-only cache.
template <bool STREAM>
__device__ __forceinline__ uint4 pk_ld4(const uint4* p) { return STREAM ? __ldcs(p) : __ldg(p); }
template <bool STREAM>
__device__ __forceinline__ uint2 pk_ld2(const uint2* p) { return STREAM ? __ldcs(p) : __ldg(p); }

// The words of unit u of a row (load), and code j (0..31) of a unit's words (code).
template <int BITS, bool STREAM> struct PackedUnit;
template <bool STREAM> struct PackedUnit<4, STREAM> {
    static constexpr int WORDS = 4;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[4]) {
        const uint4 v = pk_ld4<STREAM>((const uint4*)row + u);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[4], int j) { return (w[j >> 3] >> ((j & 7) * 4)) & 15u; }
};
template <bool STREAM> struct PackedUnit<8, STREAM> {
    static constexpr int WORDS = 8;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[8]) {
        const uint4 a = pk_ld4<STREAM>((const uint4*)row + 2 * u), b = pk_ld4<STREAM>((const uint4*)row + 2 * u + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[8], int j) { return (w[j >> 2] >> ((j & 3) * 8)) & 255u; }
};
template <bool STREAM> struct PackedUnit<6, STREAM> {
    static constexpr int WORDS = 6;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[6]) {
        const uint2* p = (const uint2*)(row + 6 * u);
        const uint2 a = pk_ld2<STREAM>(p), b = pk_ld2<STREAM>(p + 1), c = pk_ld2<STREAM>(p + 2);
        w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y; w[4] = c.x; w[5] = c.y;
    }
    // j is a compile-time constant after unrolling, so the word index and shift fold away.
    __device__ __forceinline__ static u32 code(const u32 w[6], int j) {
        const int bit = 6 * j, wi = bit >> 5, sh = bit & 31;
        const u32 v = sh <= 26 ? (w[wi] >> sh) : __funnelshift_r(w[wi], w[wi + 1], sh);
        return v & 63u;
    }
};

// Values 8c .. 8c + 7 of a unit's words w (as U, the PackedUnit<BITS, ..> that loaded them, reads them),
// times s, as 8 bf16 (each rounded once) in the words o (a 16-byte vector's).
template <int BITS, typename U>
__device__ __forceinline__ void dequant8_bf16(const u32* w, int c, float s, u32 o[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
        o[e] = pack_bf16x2(qval<BITS>(U::code(w, c * 8 + 2 * e)) * s, qval<BITS>(U::code(w, c * 8 + 2 * e + 1)) * s);
}

// Values 8c .. 8c + 7 of a unit as f32 (the GEMV's decode). INT8 and INT4 place each code in the low byte
// of the float 2^23 (one byte permute, then the offset subtracted: 2 instructions a value); INT6 shifts.
template <int BITS>
__device__ __forceinline__ void decode8(const u32 w[PackedUnit<BITS, true>::WORDS], int c, float q[8]) {
    const float base = 8388608.0f + (float)(1 << (BITS - 1));
    if (BITS == 8) {
#pragma unroll
        for (int e = 0; e < 8; ++e)
            q[e] = __uint_as_float(__byte_perm(w[2 * c + (e >> 2)], 0x4B000000u, 0x7540u | (e & 3))) - base;
    } else if (BITS == 4) {
        const u32 lo = w[c] & 0x0F0F0F0Fu, hi = (w[c] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[2 * i] = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7540u | i)) - base;
            q[2 * i + 1] = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7540u | i)) - base;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = qval<BITS>(PackedUnit<BITS, true>::code(w, c * 8 + e));
    }
}

// ---- INT4 on tensor cores (moe.cu's grouped GEMV, moe_layer.cu's experts' gate|up) ----
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
