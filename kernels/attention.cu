// Gated attention over the paged K/V cache, decode and prefill, as split-K: a partial kernel attends
// one query row and one query head to one span of ATT_SPLIT context positions, a reduce kernel merges
// the spans (log-sum-exp) and multiplies by sigmoid(gate).
//
// Cache layout (the CPU backend's): k_pool, v_pool [num_blocks, bs, hkv·d]; position p of a row lies
// in block table[p / bs], row p % bs. Query head h reads KV head h / (hq / hkv). Scores
// q·k·scale in f32 with max subtraction, as transformers' eager attention.
#include "common.cuh"

#define ATT_MAX_D 256
#define ATT_SPLIT 256

// Grid (hq, splits, rows); block: a multiple of 32 threads. Row r's query is q + r·hq·d (bf16, normed
// and roped). Row r sees positions 0 .. len − 1 where len = lens[r] (decode, lens non-null) or
// pos0 + r + 1 (causal prefill of one sequence, lens null), capped at max_blocks·bs; its block table
// is table + r·table_stride (table_stride 0: every row shares row 0). A block id ≥ num_blocks masks
// the position. Writes part_o [rows, hq, splits, d] (unnormalised Σ e·v) and part_ml [.., 2] (max, Σ e).
extern "C" __global__ void attn_paged_partial(const bf16* __restrict__ q, const bf16* __restrict__ k_pool,
                                              const bf16* __restrict__ v_pool, const u32* __restrict__ table,
                                              int table_stride, int max_blocks, const u32* __restrict__ lens,
                                              int pos0, float* __restrict__ part_o, float* __restrict__ part_ml,
                                              int hq, int hkv, int d, int bs, u32 num_blocks, int splits,
                                              float scale) {
    __shared__ float qs[ATT_MAX_D];
    __shared__ float sc[ATT_SPLIT];
    __shared__ float scratch[32];
    const int h = blockIdx.x, sp = blockIdx.y, r = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (d > ATT_MAX_D) return;
    const int kh = h / (hq / hkv);
    long long len = lens ? (long long)lens[r] : (long long)pos0 + r + 1;
    len = min(len, (long long)max_blocks * bs);
    const u32* tab = table + (size_t)r * table_stride;
    const int p0 = sp * ATT_SPLIT;
    const int p1 = (int)min((long long)p0 + ATT_SPLIT, len);
    const size_t slot = ((size_t)r * hq + h) * splits + sp;
    if (p0 >= p1) {  // nothing of this row in this span
        for (int i = threadIdx.x; i < d; i += blockDim.x) part_o[slot * d + i] = 0.0f;
        if (threadIdx.x == 0) {
            part_ml[2 * slot] = NEG_INF;
            part_ml[2 * slot + 1] = 0.0f;
        }
        return;
    }
    const bf16* qr = q + ((size_t)r * hq + h) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) qs[i] = bf2f(qr[i]);
    __syncthreads();

    const size_t row = (size_t)hkv * d;
    for (int p = p0 + warp; p < p1; p += nw) {
        const u32 blk = tab[p / bs];
        float s = NEG_INF;
        if (blk < num_blocks) {
            const bf16* kr = k_pool + ((size_t)blk * bs + p % bs) * row + (size_t)kh * d;
            float acc = 0.0f;
            for (int i = lane; i < d; i += 32) acc += qs[i] * bf2f(kr[i]);
            s = warp_sum(acc) * scale;
        }
        if (lane == 0) sc[p - p0] = s;
    }
    __syncthreads();
    float m = NEG_INF;
    for (int i = threadIdx.x; i < p1 - p0; i += blockDim.x) m = fmaxf(m, sc[i]);
    m = block_max(m, scratch);
    float l = 0.0f;
    for (int i = threadIdx.x; i < p1 - p0; i += blockDim.x) {
        const float e = (m == NEG_INF || sc[i] == NEG_INF) ? 0.0f : expf(sc[i] - m);
        sc[i] = e;
        l += e;
    }
    l = block_sum(l, scratch);  // ends with a barrier: every sc[i] is written

    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int p = p0; p < p1; ++p) {
            const float e = sc[p - p0];
            if (e == 0.0f) continue;
            const u32 blk = tab[p / bs];
            acc += e * bf2f(v_pool[((size_t)blk * bs + p % bs) * row + (size_t)kh * d + i]);
        }
        part_o[slot * d + i] = acc;
    }
    if (threadIdx.x == 0) {
        part_ml[2 * slot] = m;
        part_ml[2 * slot + 1] = l;
    }
}

// Grid (hq, rows); block: a multiple of 32 threads. Merges the splits of attn_paged_partial:
// o = Σ_s exp(m_s − M)·o_s / Σ_s exp(m_s − M)·l_s (zero when nothing was visible), times
// sigmoid(gate) when gate is non-null (gate and out: [rows, hq·d]), rounded once to bf16.
extern "C" __global__ void attn_paged_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             const bf16* __restrict__ gate, bf16* __restrict__ out, int hq, int d,
                                             int splits) {
    const int h = blockIdx.x, r = blockIdx.y;
    const size_t slot0 = ((size_t)r * hq + h) * splits;
    float M = NEG_INF;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, part_ml[2 * (slot0 + s)]);
    float den = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float m = part_ml[2 * (slot0 + s)];
        if (m != NEG_INF) den += expf(m - M) * part_ml[2 * (slot0 + s) + 1];
    }
    const size_t at = ((size_t)r * hq + h) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float num = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float m = part_ml[2 * (slot0 + s)];
            if (m != NEG_INF) num += expf(m - M) * part_o[(slot0 + s) * d + i];
        }
        float o = den > 0.0f ? num / den : 0.0f;
        if (gate) o *= sigmoid_f(bf2f(gate[at + i]));
        out[at + i] = f2bf(o);
    }
}
