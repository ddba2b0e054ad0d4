// Embedding gather from a packed table (compressed-tensors INT4 / INT8 pack-quantized, INT6 gapless; the
// layout quant.cu documents): out[s, :] = bf16(q[ids[s], :] · scale), or zeros for an id outside the
// table, so an INT8 embedding stays INT8 on the device.
//
// W: [vocab, words_per_row] u32, S: [vocab, ceil(k / group)] f32 (group = k for per-row scales).
// k % 32 == 0 for INT4/INT8, k % 8 == 0 for INT6; group % 8 == 0; W and out 16-byte aligned.
#include "packed.cuh"

// Units read through the read-only cache.
template <int BITS> using EmbUnit = PackedUnit<BITS, false>;

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
            if (id < vocab) dequant8_bf16<BITS, U>(w, c, __ldg(srow + j0 / group), o);
            *(uint4*)(dst + j0) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}

// Grid (tokens); any multiple of 32 threads. out: [tokens, k] bf16.
extern "C" __global__ void embed_q4(const u32* W, const float* S, const u32* ids, bf16* out, u32 vocab, int k, int group) {
    pdl_prologue();
    embed_q_impl<4>(W, S, ids, out, vocab, k, group);
}
extern "C" __global__ void embed_q8(const u32* W, const float* S, const u32* ids, bf16* out, u32 vocab, int k, int group) {
    pdl_prologue();
    embed_q_impl<8>(W, S, ids, out, vocab, k, group);
}
extern "C" __global__ void embed_q6(const u32* W, const float* S, const u32* ids, bf16* out, u32 vocab, int k, int group) {
    pdl_prologue();
    embed_q_impl<6>(W, S, ids, out, vocab, k, group);
}
