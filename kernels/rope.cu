// Rotary position embedding, NeoX style (rotate_half), on the first rot_dim dims of every head, in place.
// The angle of frequency j is the f32 product pos · inv_freq[j]; cos and sin (precise, with full range
// reduction) are scaled by mscale; pair (j, j + rot_dim/2) becomes (a·c − b·s, b·c + a·s).
#include "common.cuh"

// x: token s, head h starts at x + s·row_stride + h·head_stride (elements), so q can be rotated inside
// a fused [q | gate] row. pos: [t]; inv_freq: [half]. Grid: one block per token.
extern "C" __global__ void rope_neox_bf16(bf16* __restrict__ x, const u32* __restrict__ pos,
                                          const float* __restrict__ inv_freq, int n_heads, int half,
                                          long long row_stride, long long head_stride, float mscale) {
    pdl_prologue();
    const int s = blockIdx.x;
    const float p = (float)pos[s];
    bf16* row = x + (long long)s * row_stride;
    for (int idx = threadIdx.x; idx < n_heads * half; idx += blockDim.x) {
        const int h = idx / half, j = idx - h * half;
        float sn, cs;
        sincosf(p * inv_freq[j], &sn, &cs);
        cs *= mscale;
        sn *= mscale;
        bf16* head = row + h * head_stride;
        const float a = bf2f(head[j]), b = bf2f(head[j + half]);
        head[j] = f2bf(a * cs + (-b) * sn);
        head[j + half] = f2bf(b * cs + a * sn);
    }
}
