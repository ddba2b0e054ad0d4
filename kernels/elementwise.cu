// Elementwise and row-shuffling ops on bf16 activations, f32 arithmetic, one rounding per output:
// residual add (alone or fused with the next RMSNorm), the sigmoid-gated add of the shared expert, row gather and column concatenation.
#include "add_norm.cuh"

// acc[i] = acc[i] + y[i] for i < n.
extern "C" __global__ void add_bf16(bf16* __restrict__ acc, const bf16* __restrict__ y, long long n) {
    pdl_prologue();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        acc[i] = f2bf(bf2f(acc[i]) + bf2f(y[i]));
}

// The residual add fused with the next RMSNorm: acc[r, :] = bf16(acc[r, :] + y[r, :]), then out[r, :] =
// acc[r, :] · rsqrt(mean(acc[r, :]²) + eps) · (offset + w) over the rounded sums, as add_bf16 followed by
// rms_norm_bf16 with the same block size (each thread sums the same elements in the same order). One
// block per row (row_threads(d) threads); the row's work is add_rms_norm_row (add_norm.cuh).
extern "C" __global__ void add_rms_norm_bf16(bf16* __restrict__ acc, const bf16* __restrict__ y,
                                             const bf16* __restrict__ w, bf16* __restrict__ out, int d,
                                             float eps, float offset) {
    pdl_prologue();
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    add_rms_norm_row(acc + row * d, y + row * d, w, out + row * d, d, eps, offset, scratch);
}

// out[r, :] = x[idx[r], :] (zeros when idx[r] ≥ x_rows). Grid (rows); out: [rows, cols].
extern "C" __global__ void gather_rows_bf16(const bf16* __restrict__ x, const u32* __restrict__ idx,
                                            bf16* __restrict__ out, int cols, u32 x_rows) {
    pdl_prologue();
    const int r = blockIdx.x;
    const u32 s = idx[r];
    bf16* o = out + (size_t)r * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = s < x_rows ? x[(size_t)s * cols + i] : f2bf(0.0f);
}

// out[r, :] = [a[r, :] | b[r, :]]. Grid (rows); a: [rows, ca]; b: [rows, cb]; out: [rows, ca + cb].
extern "C" __global__ void concat_cols_bf16(const bf16* __restrict__ a, const bf16* __restrict__ b,
                                            bf16* __restrict__ out, int ca, int cb) {
    pdl_prologue();
    const int r = blockIdx.x;
    bf16* o = out + (size_t)r * (ca + cb);
    for (int i = threadIdx.x; i < ca + cb; i += blockDim.x)
        o[i] = i < ca ? a[(size_t)r * ca + i] : b[(size_t)r * cb + (i - ca)];
}

// out[i] = silu(x[i]) for i < n.
extern "C" __global__ void silu_bf16(const bf16* __restrict__ x, bf16* __restrict__ out, long long n) {
    pdl_prologue();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = f2bf(silu_f(bf2f(x[i])));
}

// Hyper-connections pre-mix: out[r, j] = Σ_c p_c · streams[r, c·h + j] with p = softmax(pre) (f32, max
// subtracted), summed in order c = 0..s−1. streams: [rows, s·h]; pre: [s] f32; out: [rows, h].
extern "C" __global__ void hc_premix_bf16(const bf16* __restrict__ streams, const float* __restrict__ pre,
                                          bf16* __restrict__ out, long long rows, int s, int h) {
    pdl_prologue();
    float m = NEG_INF;
    for (int c = 0; c < s; ++c) m = fmaxf(m, pre[c]);
    float z = 0.0f;
    for (int c = 0; c < s; ++c) z += expf(pre[c] - m);
    const long long n = rows * h;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / h;
        const int j = (int)(i - r * h);
        float acc = 0.0f;
        for (int c = 0; c < s; ++c) acc += (expf(pre[c] - m) / z) * bf2f(streams[(r * s + c) * h + j]);
        out[i] = f2bf(acc);
    }
}

// Hyper-connections gated residual: streams[r, c·h + j] += sigmoid(u[r, c·h + j]) · y[r, j].
// streams, u: [rows, s·h]; y: [rows, h].
extern "C" __global__ void hc_gated_residual_bf16(bf16* __restrict__ streams, const bf16* __restrict__ u,
                                                  const bf16* __restrict__ y, long long rows, int s, int h) {
    pdl_prologue();
    const long long n = rows * s * h;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / ((long long)s * h);
        const int j = (int)(i % h);
        streams[i] = f2bf(bf2f(streams[i]) + sigmoid_f(bf2f(u[i])) * bf2f(y[r * h + j]));
    }
}
