// Attention input preparation and the K/V cache write.
//
// qk_norm_rope_bf16: per head, the zero-centred RMSNorm over head_dim (weight offset 1, as q_norm and
// k_norm) followed by NeoX RoPE on the first 2·half dims at the row's position (read from device memory),
// in f32 with one rounding per output; optionally also copies the head's gate half out of a fused
// [q | gate] row. With explicit interleaved-MRoPE positions (pos3, (t, h, w) per row) frequency j turns
// by the position of axis mrope_axis(j) instead: the same f32 product and the same sincosf, so a row
// whose three positions equal its sequence position comes out bit for bit as without them.
// kv_write_bf16: copies the step's new K and V rows into their pool rows (the pool row of every token is
// computed on the host as block·block_size + pos % block_size and uploaded with the step).
#include "common.cuh"

#define KV_MAX_D 256

// Grid (n_heads, rows); block a multiple of 32 threads (≤ 256). Head h of row r is read at
// x + r·x_row_stride + h·x_head_stride and written at out + r·out_row_stride + h·d; when gate_out is
// non-null, the d values after the head are copied to gate_out + r·out_row_stride + h·d. w: [d] (the
// norm weight, used as 1 + w); pos: [rows]; inv_freq: [half] (half = 0: no rotation). pos3: null (every
// frequency at pos[r]) or [rows, 3] explicit (t, h, w) positions, frequency j taking axis 1 when
// j % 3 == 1 and j < 3·sec_h, axis 2 when j % 3 == 2 and j < 3·sec_w, axis 0 otherwise (transformers'
// interleaved MRoPE; sec_h, sec_w: the h and w entries of mrope_section).
__device__ __forceinline__ int mrope_axis(int j, int sec_h, int sec_w) {
    const int m = j % 3;
    return (m == 1 && j < 3 * sec_h) ? 1 : (m == 2 && j < 3 * sec_w) ? 2 : 0;
}

extern "C" __global__ void qk_norm_rope_bf16(const bf16* __restrict__ x, long long x_row_stride,
                                             long long x_head_stride, bf16* __restrict__ out,
                                             long long out_row_stride, bf16* __restrict__ gate_out,
                                             const bf16* __restrict__ w, float eps, int d,
                                             const u32* __restrict__ pos, const float* __restrict__ inv_freq,
                                             int half, float mscale, const u32* __restrict__ pos3,
                                             int sec_h, int sec_w) {
    pdl_prologue();
    __shared__ float v[KV_MAX_D];
    __shared__ float scratch[32];
    const int h = blockIdx.x, r = blockIdx.y;
    if (d > KV_MAX_D) return;
    const bf16* xh = x + (long long)r * x_row_stride + (long long)h * x_head_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float a = bf2f(xh[i]);
        v[i] = a;
        ss += a * a;
    }
    ss = block_sum(ss, scratch);  // ends with a barrier: v is complete
    const float rr = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) v[i] = (v[i] * rr) * (1.0f + bf2f(w[i]));
    __syncthreads();
    bf16* oh = out + (long long)r * out_row_stride + (long long)h * d;
    const float p = (float)pos[r];
    const u32* p3 = pos3 ? pos3 + 3ll * r : nullptr;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float o = v[i];
        if (i < 2 * half) {
            const int j = i < half ? i : i - half;
            const float pj = p3 ? (float)p3[mrope_axis(j, sec_h, sec_w)] : p;
            float sn, cs;
            sincosf(pj * inv_freq[j], &sn, &cs);
            cs *= mscale;
            sn *= mscale;
            const float a = v[j], b = v[j + half];
            o = i < half ? a * cs + (-b) * sn : b * cs + a * sn;
        }
        oh[i] = f2bf(o);
    }
    if (gate_out) {
        bf16* gh = gate_out + (long long)r * out_row_stride + (long long)h * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) gh[i] = xh[d + i];
    }
}

// Grid (rows); block any multiple of 32. Row r of k and v ([rows, row_elems]) goes to pool row dst[r]
// of k_pool and v_pool ([pool_rows, row_elems]); a dst at or beyond pool_rows is skipped.
extern "C" __global__ void kv_write_bf16(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                         bf16* __restrict__ k_pool, bf16* __restrict__ v_pool,
                                         const u32* __restrict__ dst, int row_elems, u32 pool_rows) {
    pdl_prologue();
    const int r = blockIdx.x;
    const u32 d = dst[r];
    if (d >= pool_rows) return;
    const bf16* ks = k + (size_t)r * row_elems;
    const bf16* vs = v + (size_t)r * row_elems;
    bf16* kd = k_pool + (size_t)d * row_elems;
    bf16* vd = v_pool + (size_t)d * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        kd[i] = ks[i];
        vd[i] = vs[i];
    }
}

// Grid (n); block any multiple of 32. Stages rows of one sequence for a step that reads them from
// VRAM: position first + i's row of k_pool and v_pool (pool row table[p / bs]·bs + p % bs, through
// unified addressing when the pools are in host memory) goes to row i of k_out and v_out
// ([n, row_elems]); a null k_out or v_out stages only the other. The rows are copied as 16-byte words
// when row_elems is a multiple of 8 (the pools' rows are then 16-byte aligned), else element by element.
extern "C" __global__ void kv_stage_bf16(const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
                                         const u32* __restrict__ table, int bs, int row_elems, u32 first,
                                         bf16* __restrict__ k_out, bf16* __restrict__ v_out) {
    pdl_prologue();
    const u32 p = first + blockIdx.x;
    const size_t src = ((size_t)table[p / bs] * bs + p % bs) * row_elems;
    const size_t dst = (size_t)blockIdx.x * row_elems;
    if (row_elems % 8 == 0) {
        const int words = row_elems / 8;
        const uint4* ks = reinterpret_cast<const uint4*>(k_pool + src);
        const uint4* vs = reinterpret_cast<const uint4*>(v_pool + src);
        uint4* kd = reinterpret_cast<uint4*>(k_out + dst);
        uint4* vd = reinterpret_cast<uint4*>(v_out + dst);
        for (int i = threadIdx.x; i < words; i += blockDim.x) {
            if (k_out) kd[i] = ks[i];
            if (v_out) vd[i] = vs[i];
        }
    } else {
        for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
            if (k_out) k_out[dst + i] = k_pool[src + i];
            if (v_out) v_out[dst + i] = v_pool[src + i];
        }
    }
}
