// Embedding gather from a packed table (compressed-tensors INT4 / INT8 pack-quantized, INT6 gapless; the
// layout quant.cu documents): out[s, :] = bf16(q[ids[s], :] · scale), or zeros for an id outside the
// table, so an INT8 embedding stays INT8 on the device.
//
// W: [vocab, words_per_row] u32, S: [vocab, ceil(k / group)] f32 (group = k for per-row scales).
// k % 32 == 0 for INT4/INT8, k % 8 == 0 for INT6; group % 8 == 0; W and out 16-byte aligned.
#include "common.cuh"

// Unsigned code -> signed value as f32 (exact: (code | 2^23 pattern) is the float 2^23 + code).
template <int BITS>
__device__ __forceinline__ float emb_qval(u32 code) {
    return __uint_as_float(code | 0x4B000000u) - (8388608.0f + (float)(1 << (BITS - 1)));
}

template <int BITS> struct EmbUnit;
template <> struct EmbUnit<4> {
    static constexpr int WORDS = 4;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[4]) {
        const uint4 v = __ldg((const uint4*)row + u);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[4], int j) { return (w[j >> 3] >> ((j & 7) * 4)) & 15u; }
};
template <> struct EmbUnit<8> {
    static constexpr int WORDS = 8;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[8]) {
        const uint4 a = __ldg((const uint4*)row + 2 * u), b = __ldg((const uint4*)row + 2 * u + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
    __device__ __forceinline__ static u32 code(const u32 w[8], int j) { return (w[j >> 2] >> ((j & 3) * 8)) & 255u; }
};
template <> struct EmbUnit<6> {
    static constexpr int WORDS = 6;
    __device__ __forceinline__ static void load(const u32* row, int u, u32 w[6]) {
        const uint2* p = (const uint2*)(row + 6 * u);
        const uint2 a = __ldg(p), b = __ldg(p + 1), c = __ldg(p + 2);
        w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y; w[4] = c.x; w[5] = c.y;
    }
    __device__ __forceinline__ static u32 code(const u32 w[6], int j) {
        const int bit = 6 * j, wi = bit >> 5, sh = bit & 31;
        const u32 v = sh <= 26 ? (w[wi] >> sh) : __funnelshift_r(w[wi], w[wi + 1], sh);
        return v & 63u;
    }
};

// One block per token; thread i decodes units i, i + blockDim.x, ... (32 values each) of the token's row.
template <int BITS>
__device__ __forceinline__ void embed_q_impl(const u32* __restrict__ W, const float* __restrict__ S,
                                             const u32* __restrict__ ids, bf16* __restrict__ out, u32 vocab,
                                             int k, int group) {
    typedef EmbUnit<BITS> U;
    const int s = blockIdx.x;
    const u32 id = ids[s];
    const int units = (k + 31) >> 5;
    const int scols = (k + group - 1) / group;
    bf16* dst = out + (size_t)s * k;
    const u32* row = W + (size_t)(id < vocab ? id : 0) * units * U::WORDS;
    const float* srow = S + (size_t)(id < vocab ? id : 0) * scols;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        u32 w[U::WORDS];
        if (id < vocab) U::load(row, u, w);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int j0 = u * 32 + c * 8;
            if (j0 >= k) break;
            u32 o[4] = {0u, 0u, 0u, 0u};
            if (id < vocab) {
                const float sc = __ldg(srow + j0 / group);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bf16 lo = f2bf(emb_qval<BITS>(U::code(w, c * 8 + 2 * e)) * sc);
                    const bf16 hi = f2bf(emb_qval<BITS>(U::code(w, c * 8 + 2 * e + 1)) * sc);
                    o[e] = (u32)__bfloat16_as_ushort(lo) | ((u32)__bfloat16_as_ushort(hi) << 16);
                }
            }
            *(uint4*)(dst + j0) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}

// Grid (tokens); any multiple of 32 threads. out: [tokens, k] bf16.
extern "C" __global__ void embed_q4(const u32* W, const float* S, const u32* ids, bf16* out, u32 vocab, int k, int group) { embed_q_impl<4>(W, S, ids, out, vocab, k, group); }
extern "C" __global__ void embed_q8(const u32* W, const float* S, const u32* ids, bf16* out, u32 vocab, int k, int group) { embed_q_impl<8>(W, S, ids, out, vocab, k, group); }
extern "C" __global__ void embed_q6(const u32* W, const float* S, const u32* ids, bf16* out, u32 vocab, int k, int group) { embed_q_impl<6>(W, S, ids, out, vocab, k, group); }
