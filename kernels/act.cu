// Elementwise activations: SwiGLU over a fused gate|up buffer.
#include "common.cuh"

// out[s, j] = silu(gate_up[s, j]) · gate_up[s, i + j]. gate_up: [t, 2i]; out: [t, i].
extern "C" __global__ void swiglu_bf16(const bf16* __restrict__ gate_up, bf16* __restrict__ out,
                                       long long t, int i) {
    pdl_prologue();
    const long long total = t * i;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long s = idx / i;
        const int j = (int)(idx - s * i);
        const bf16* gu = gate_up + s * 2 * i;
        out[idx] = f2bf(silu_f(bf2f(gu[j])) * bf2f(gu[i + j]));
    }
}
