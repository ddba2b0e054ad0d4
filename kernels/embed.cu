// Embedding gather: rows of a [vocab, hidden] bf16 table for a list of token ids.
#include "common.cuh"

// out[s, :] = table[ids[s], :], or zeros for an id outside the table. One block per token; 16-byte
// copies when `vec` (the host sets it when hidden % 8 == 0 and both buffers are 16-byte aligned).
extern "C" __global__ void embed_bf16(const bf16* __restrict__ table, const u32* __restrict__ ids,
                                      bf16* __restrict__ out, u32 vocab, int hidden, int vec) {
    pdl_prologue();
    const int s = blockIdx.x;
    const u32 id = ids[s];
    bf16* dst = out + (size_t)s * hidden;
    if (vec) {
        uint4* d4 = (uint4*)dst;
        const uint4* s4 = (const uint4*)(table + (size_t)id * hidden);
        for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
            d4[c] = id < vocab ? s4[c] : make_uint4(0, 0, 0, 0);
        }
    } else {
        const bf16* src = table + (size_t)id * hidden;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            dst[c] = id < vocab ? src[c] : f2bf(0.0f);
        }
    }
}
