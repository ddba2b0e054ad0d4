// The vision tower's kernels (crates/cuda/src/vision.rs): the residual stream is f32, GEMM inputs
// bf16, GEMM outputs f32 (cuBLAS), so each kernel here adds a bias or a residual in f32 and rounds
// once where a GEMM reads its output.
//
// - vit_embed_pos: patch embedding output + bias + the bilinear position embedding (four taps of the
//   learned table per patch, indices and weights computed on the host);
// - vit_layer_norm: LayerNorm over rows (biased variance, f32 in, bf16 out), one block per row;
// - vit_qkv_rope: the qkv GEMM output + bias, q and k turned by the 2-D rotary embedding
//   (`x · cos + rotate_half(x) · sin` per head, cos/sin per patch from the host), written as bf16
//   q, k and v, head-major, the head dimension padded with zeros to a multiple of 16;
// - vit_flash_dp{DP}: bidirectional attention within each frame on tensor cores (flash-attention 2's
//   forward), one block of 64 queries per (query tile, head), online softmax in f32; bf16 output;
// - vit_bias_act: GEMM output + bias, the MLP activation, bf16 out;
// - vit_bias_residual: x += y + bias; vit_add_bias: y += bias.
#include "common.cuh"

#define VIT_THREADS 256

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

// One block per row of qkv ([chunk, 3 · hidden], each row [q | k | v] with heads of `dim`; row i is the
// image's row r = row0 + i of `rows`): adds the bias, turns every head of q and k (out[j] = x[j] · cos[j] + rot[j] · sin[j], rot[j] = −x[j + dim/2] for
// j < dim/2, else x[j − dim/2]) and writes q, k and v in bf16, head-major: qb[(head · rows + r) · dp + j]
// (dp ≥ dim; the padding columns are left as they are, zero). Shared memory: 2 · hidden floats.
extern "C" __global__ void vit_qkv_rope(const float* __restrict__ qkv, const float* __restrict__ bias,
                                        const float* __restrict__ cosv, const float* __restrict__ sinv,
                                        bf16* __restrict__ qb, bf16* __restrict__ kb, bf16* __restrict__ vb, int rows,
                                        int row0, int chunk, int hidden, int dim, int dp) {
    pdl_prologue();
    extern __shared__ float row[];
    if ((int)blockIdx.x >= chunk) return;
    const float* q = qkv + (long long)blockIdx.x * 3 * hidden;
    const int r = row0 + blockIdx.x;
    for (int c = threadIdx.x; c < 3 * hidden; c += blockDim.x) {
        const float v = q[c] + bias[c];
        if (c < 2 * hidden) {
            row[c] = v;
        } else {
            const int e = c - 2 * hidden, h = e / dim, j = e % dim;
            vb[((long long)h * rows + r) * dp + j] = f2bf(v);
        }
    }
    __syncthreads();
    const int half = dim / 2;
    const float* cr = cosv + (long long)r * dim;
    const float* sr = sinv + (long long)r * dim;
    for (int c = threadIdx.x; c < 2 * hidden; c += blockDim.x) {
        const int j = c % dim, base = c - j;
        const float rot = j < half ? -row[base + j + half] : row[base + j - half];
        const float v = row[c] * cr[j] + rot * sr[j];
        const int part = c / hidden, h = (c % hidden) / dim;
        (part == 0 ? qb : kb)[((long long)h * rows + r) * dp + j] = f2bf(v);
    }
}

// c += A (16×16, row-major fragment a) · B (16×8, column-major fragment b0 b1).
__device__ __forceinline__ void vit_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 vit_ld32(const bf16* p) { return *(const u32*)p; }

// Two f32 rounded to a bf16 pair (x in the low half); their rounded values added to *sum.
__device__ __forceinline__ u32 vit_pack(float x, float y, float* sum) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    *sum += __low2float(h) + __high2float(h);
    return *(const u32*)&h;
}

// Bidirectional attention of the frame a query tile belongs to, on tensor cores (flash-attention 2's
// forward: bf16 mma.sync m16n8k16, f32 accumulation, online softmax in registers). tiles[3 · t] =
// frame start (row), frame length, first query of the tile within the frame. qb, kb, vb: [heads, rows,
// DP] bf16 (head dimension `dim` padded with zeros to DP, a multiple of 16); out: [rows, hidden] bf16.
// Block: 4 warps of 16 queries; grid (tiles, heads). K tiles of VIT_BK keys row-major and V tiles
// transposed in shared memory (rows padded by 8 to spread the banks).
#define VIT_BK 64
template <int DP>
__device__ __forceinline__ void vit_flash(const bf16* __restrict__ qb, const bf16* __restrict__ kb,
                                          const bf16* __restrict__ vb, bf16* __restrict__ out,
                                          const int* __restrict__ tiles, int rows, int hidden, int dim,
                                          float scale_log2) {
    constexpr int KS = DP + 8, VS = VIT_BK + 8, CH = DP / 8;
    __shared__ __align__(16) bf16 ks[VIT_BK * KS];
    __shared__ __align__(16) bf16 vt[DP * VS];
    const int t = blockIdx.x, h = blockIdx.y;
    const int start = tiles[3 * t], len = tiles[3 * t + 1], q0 = tiles[3 * t + 2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const long long base = ((long long)h * rows + start) * DP;
    const bf16* Q = qb + base;
    const bf16* K = kb + base;
    const bf16* V = vb + base;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    u32 qf[DP / 16][4];
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        const int c = kk * 16 + tq * 2;
        qf[kk][0] = r0 < len ? vit_ld32(Q + (long long)r0 * DP + c) : 0u;
        qf[kk][1] = r1 < len ? vit_ld32(Q + (long long)r1 * DP + c) : 0u;
        qf[kk][2] = r0 < len ? vit_ld32(Q + (long long)r0 * DP + c + 8) : 0u;
        qf[kk][3] = r1 < len ? vit_ld32(Q + (long long)r1 * DP + c + 8) : 0u;
    }
    float o[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    for (int k0 = 0; k0 < len; k0 += VIT_BK) {
        __syncthreads();
        for (int i = threadIdx.x; i < VIT_BK * CH; i += blockDim.x) {
            const int j = i / CH, c = i % CH;
            const bool ok = k0 + j < len;
            const uint4 z = make_uint4(0, 0, 0, 0);
            const uint4 kv = ok ? *(const uint4*)(K + (long long)(k0 + j) * DP + c * 8) : z;
            const uint4 vv = ok ? *(const uint4*)(V + (long long)(k0 + j) * DP + c * 8) : z;
            *(uint4*)(ks + j * KS + c * 8) = kv;
            const bf16* ve = (const bf16*)&vv;
#pragma unroll
            for (int e = 0; e < 8; ++e) vt[(c * 8 + e) * VS + j] = ve[e];
        }
        __syncthreads();
        float s[VIT_BK / 8][4];
#pragma unroll
        for (int j = 0; j < VIT_BK / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const bf16* kr = ks + (j * 8 + g) * KS + tq * 2;
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) vit_mma(s[j], qf[kk], vit_ld32(kr + kk * 16), vit_ld32(kr + kk * 16 + 8));
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int j = 0; j < VIT_BK / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + j * 8 + tq * 2 + (e & 1);
                const float v = key < len ? s[j][e] * scale_log2 : NEG_INF;
                s[j][e] = v;
                if (e < 2)
                    mx0 = fmaxf(mx0, v);
                else
                    mx1 = fmaxf(mx1, v);
            }
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }
        m0 = mx0;
        m1 = mx1;
#pragma unroll
        for (int kk = 0; kk < VIT_BK / 16; ++kk) {
            u32 a[4];
            a[0] = vit_pack(exp2f(s[2 * kk][0] - mx0), exp2f(s[2 * kk][1] - mx0), &l0);
            a[1] = vit_pack(exp2f(s[2 * kk][2] - mx1), exp2f(s[2 * kk][3] - mx1), &l1);
            a[2] = vit_pack(exp2f(s[2 * kk + 1][0] - mx0), exp2f(s[2 * kk + 1][1] - mx0), &l0);
            a[3] = vit_pack(exp2f(s[2 * kk + 1][2] - mx1), exp2f(s[2 * kk + 1][3] - mx1), &l1);
#pragma unroll
            for (int n = 0; n < DP / 8; ++n) {
                const bf16* vr = vt + (n * 8 + g) * VS + kk * 16 + tq * 2;
                vit_mma(o[n], a, vit_ld32(vr), vit_ld32(vr + 8));
            }
        }
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    const float i0 = 1.0f / l0, i1 = 1.0f / l1;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int d = n * 8 + tq * 2 + e;
            if (d >= dim) continue;
            if (r0 < len) out[(long long)(start + r0) * hidden + h * dim + d] = f2bf(o[n][e] * i0);
            if (r1 < len) out[(long long)(start + r1) * hidden + h * dim + d] = f2bf(o[n][2 + e] * i1);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) vit_flash_dp16(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<16>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) vit_flash_dp32(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<32>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) vit_flash_dp48(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<48>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) vit_flash_dp64(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<64>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) vit_flash_dp80(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<80>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) vit_flash_dp96(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<96>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) vit_flash_dp112(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<112>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) vit_flash_dp128(const bf16* qb, const bf16* kb, const bf16* vb, bf16* out, const int* tiles, int rows, int hidden, int dim, float scale_log2) {
    pdl_prologue();
    vit_flash<128>(qb, kb, vb, out, tiles, rows, hidden, dim, scale_log2);
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
