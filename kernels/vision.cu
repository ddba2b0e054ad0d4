// The vision tower's kernels (crates/cuda/src/vision.rs): the residual stream is f32, GEMM inputs
// bf16, GEMM outputs f32 (cuBLAS), so each kernel here adds a bias or a residual in f32 and rounds
// once where a GEMM reads its output.
//
// - vit_embed_pos: patch embedding output + bias + the bilinear position embedding (four taps of the
//   learned table per patch, indices and weights computed on the host);
// - vit_layer_norm: LayerNorm over rows (biased variance, f32 in, bf16 out), one block per row;
// - vit_qkv_rope: the qkv GEMM output + bias, q and k turned by the 2-D rotary embedding
//   (`x · cos + rotate_half(x) · sin` per head, cos/sin per patch from the host), in place;
// - vit_attention_d{D}: bidirectional attention within each frame, one block per (query tile, head),
//   one query row per thread, K/V tiles in shared memory, online softmax in f32; bf16 output;
// - vit_bias_act: GEMM output + bias, the MLP activation, bf16 out;
// - vit_bias_residual: x += y + bias; vit_add_bias: y += bias.
#include "common.cuh"

#define VIT_THREADS 256
#define VIT_ATTN_ROWS 128

// Activation codes (crates/cuda/src/vision.rs `act_code`).
#define VIT_GELU_TANH 0
#define VIT_GELU_ERF 1
#define VIT_SILU 2
#define VIT_QUICK_GELU 3

__device__ __forceinline__ float vit_act(float x, int act) {
    switch (act) {
        case VIT_GELU_TANH: {
            const float k = 0.7978845608028654f;  // sqrt(2 / pi)
            return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
        }
        case VIT_GELU_ERF:
            return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
        case VIT_SILU:
            return x / (1.0f + expf(-x));
        default:
            return x / (1.0f + expf(-1.702f * x));
    }
}

// x[r, c] += bias[c] + Σ_k wts[r, k] · table[idx[r, k], c].
extern "C" __global__ void vit_embed_pos(float* __restrict__ x, const float* __restrict__ bias,
                                         const float* __restrict__ table, const int* __restrict__ idx,
                                         const float* __restrict__ wts, int rows, int cols) {
    pdl_prologue();
    const long long n = (long long)rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / cols), c = (int)(i % cols);
        float p = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) p += wts[r * 4 + k] * table[(long long)idx[r * 4 + k] * cols + c];
        x[i] += bias[c] + p;
    }
}

// y[r] = (x[r] − mean) / sqrt(var + eps) · g + b, one block of VIT_THREADS per row.
extern "C" __global__ void vit_layer_norm(const float* __restrict__ x, const float* __restrict__ g,
                                          const float* __restrict__ b, bf16* __restrict__ y, int rows, int cols,
                                          float eps) {
    pdl_prologue();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += xr[c];
    const float mean = block_sum(s, scratch) / cols;
    float v = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = xr[c] - mean;
        v += d * d;
    }
    const float inv = rsqrtf(block_sum(v, scratch) / cols + eps);
    bf16* yr = y + (long long)r * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = f2bf((xr[c] - mean) * inv * g[c] + b[c]);
}

// One block per row of qkv ([rows, 3 · hidden], each row [q | k | v] with heads of `dim`): adds the
// bias, then turns every head of q and k: out[j] = x[j] · cos[j] + rot[j] · sin[j], rot[j] = −x[j + dim/2]
// for j < dim/2, else x[j − dim/2]. Shared memory: 2 · hidden floats.
extern "C" __global__ void vit_qkv_rope(float* __restrict__ qkv, const float* __restrict__ bias,
                                        const float* __restrict__ cosv, const float* __restrict__ sinv, int rows,
                                        int hidden, int dim) {
    pdl_prologue();
    extern __shared__ float row[];
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* q = qkv + (long long)r * 3 * hidden;
    for (int c = threadIdx.x; c < 3 * hidden; c += blockDim.x) {
        const float v = q[c] + bias[c];
        if (c < 2 * hidden)
            row[c] = v;
        else
            q[c] = v;
    }
    __syncthreads();
    const int half = dim / 2;
    const float* cr = cosv + (long long)r * dim;
    const float* sr = sinv + (long long)r * dim;
    for (int c = threadIdx.x; c < 2 * hidden; c += blockDim.x) {
        const int j = c % dim, base = c - j;
        const float rot = j < half ? -row[base + j + half] : row[base + j - half];
        q[c] = row[c] * cr[j] + rot * sr[j];
    }
}

// Bidirectional attention of the frame a query tile belongs to. tiles[3 · t] = frame start (row),
// frame length, first query of the tile within the frame. qkv: [rows, 3 · hidden] f32 (q and k after
// rope); out: [rows, hidden] bf16. Block: VIT_ATTN_ROWS threads, one query each; grid (tiles, heads).
template <int D, int BK>
__device__ __forceinline__ void vit_attention(const float* __restrict__ qkv, bf16* __restrict__ out,
                                              const int* __restrict__ tiles, int hidden, float scale_log2) {
    __shared__ __align__(16) float ks[BK][D];
    __shared__ __align__(16) float vs[BK][D];
    const int t = blockIdx.x, h = blockIdx.y;
    const int start = tiles[3 * t], len = tiles[3 * t + 1], q0 = tiles[3 * t + 2];
    const int qi = q0 + threadIdx.x;
    const bool live = qi < len;
    const long long stride = 3LL * hidden;
    float q[D], acc[D];
    {
        const float* qr = qkv + (long long)(start + (live ? qi : 0)) * stride + h * D;
#pragma unroll
        for (int d = 0; d < D; ++d) {
            q[d] = live ? qr[d] * scale_log2 : 0.0f;
            acc[d] = 0.0f;
        }
    }
    float m = NEG_INF, l = 0.0f;
    for (int kb = 0; kb < len; kb += BK) {
        __syncthreads();
        for (int i = threadIdx.x; i < BK * D; i += blockDim.x) {
            const int j = i / D, d = i % D;
            const bool ok = kb + j < len;
            const float* kr = qkv + (long long)(start + kb + j) * stride + hidden + h * D;
            ks[j][d] = ok ? kr[d] : 0.0f;
            vs[j][d] = ok ? kr[hidden + d] : 0.0f;
        }
        __syncthreads();
        const int nk = min(BK, len - kb);
        float s[BK];
        float mx = m;
#pragma unroll
        for (int j = 0; j < BK; ++j) {
            float a = 0.0f;
#pragma unroll
            for (int d = 0; d < D; ++d) a = fmaf(q[d], ks[j][d], a);
            s[j] = j < nk ? a : NEG_INF;
            mx = fmaxf(mx, s[j]);
        }
        const float corr = exp2f(m - mx);
        l *= corr;
#pragma unroll
        for (int d = 0; d < D; ++d) acc[d] *= corr;
#pragma unroll
        for (int j = 0; j < BK; ++j) {
            const float p = exp2f(s[j] - mx);
            l += p;
#pragma unroll
            for (int d = 0; d < D; ++d) acc[d] = fmaf(p, vs[j][d], acc[d]);
        }
        m = mx;
    }
    if (!live) return;
    const float inv = 1.0f / l;
    bf16* o = out + (long long)(start + qi) * hidden + h * D;
#pragma unroll
    for (int d = 0; d < D; ++d) o[d] = f2bf(acc[d] * inv);
}

extern "C" __global__ void __launch_bounds__(VIT_ATTN_ROWS) vit_attention_d16(const float* qkv, bf16* out, const int* tiles, int hidden, float scale_log2) {
    pdl_prologue();
    vit_attention<16, 32>(qkv, out, tiles, hidden, scale_log2);
}
extern "C" __global__ void __launch_bounds__(VIT_ATTN_ROWS) vit_attention_d32(const float* qkv, bf16* out, const int* tiles, int hidden, float scale_log2) {
    pdl_prologue();
    vit_attention<32, 32>(qkv, out, tiles, hidden, scale_log2);
}
extern "C" __global__ void __launch_bounds__(VIT_ATTN_ROWS) vit_attention_d64(const float* qkv, bf16* out, const int* tiles, int hidden, float scale_log2) {
    pdl_prologue();
    vit_attention<64, 32>(qkv, out, tiles, hidden, scale_log2);
}
extern "C" __global__ void __launch_bounds__(VIT_ATTN_ROWS) vit_attention_d72(const float* qkv, bf16* out, const int* tiles, int hidden, float scale_log2) {
    pdl_prologue();
    vit_attention<72, 32>(qkv, out, tiles, hidden, scale_log2);
}
extern "C" __global__ void __launch_bounds__(VIT_ATTN_ROWS) vit_attention_d80(const float* qkv, bf16* out, const int* tiles, int hidden, float scale_log2) {
    pdl_prologue();
    vit_attention<80, 32>(qkv, out, tiles, hidden, scale_log2);
}
extern "C" __global__ void __launch_bounds__(VIT_ATTN_ROWS) vit_attention_d128(const float* qkv, bf16* out, const int* tiles, int hidden, float scale_log2) {
    pdl_prologue();
    vit_attention<128, 16>(qkv, out, tiles, hidden, scale_log2);
}

// out[r, c] = act(y[r, c] + bias[c]) in bf16.
extern "C" __global__ void vit_bias_act(const float* __restrict__ y, const float* __restrict__ bias,
                                        bf16* __restrict__ out, int rows, int cols, int act) {
    pdl_prologue();
    const long long n = (long long)rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f2bf(vit_act(y[i] + bias[i % cols], act));
}

// x[r, c] += y[r, c] + bias[c].
extern "C" __global__ void vit_bias_residual(float* __restrict__ x, const float* __restrict__ y,
                                             const float* __restrict__ bias, int rows, int cols) {
    pdl_prologue();
    const long long n = (long long)rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i] + bias[i % cols];
}

// y[r, c] += bias[c].
extern "C" __global__ void vit_add_bias(float* __restrict__ y, const float* __restrict__ bias, int rows, int cols) {
    pdl_prologue();
    const long long n = (long long)rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] += bias[i % cols];
}
