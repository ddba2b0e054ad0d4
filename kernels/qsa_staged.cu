// QSA's gathered attention in sections (crates/cuda/src/ops/qsa_staged.rs): the selected K/V rows of
// one sequence live in pools the device reads slowly (pinned host memory through unified addressing),
// and only `rows` positions at a time fit the VRAM arena they are staged into. The three kernels split
// qsa_attn_partial (qsa.cu, the uncached path: rc_tags null) at its phase boundaries and run each
// phase's arithmetic as it does, on the same bytes, in the same order, so part_o and part_ml, and
// after qsa_attn_reduce the output, are bit for bit the unsectioned kernel's:
//
// - qsa_staged_scores, once a section [first, end) whose K rows the arena holds (position p at arena
//   row p − first): the score of every entry j of the block's span whose position lies in the section
//   (a contiguous run of j: the positions ascend), each by a warp with the lane striding, warp_sum and
//   scale of qsa_attn_partial's score loop, stored to S [rows, hq, sel_stride] f32;
// - qsa_staged_softmax, once after every section: the span's max m (block_max), its weights e_j =
//   exp(sc_j − m) (0 for −inf) and their sum l (block_sum), the same loops and block size as the
//   kernel's, so the same reduction orders; e_j back into S, (m, l) to part_ml;
// - qsa_staged_values, once a section (ascending) whose V rows the arena holds: each thread continues
//   its accumulator acc (0 in the first section, else the f32 it stored in part_o) over the span's
//   entries in the section in ascending j with the kernel's expression acc += e · v, skipping e == 0.
//   f32 stores and loads are exact and the entries are visited in the kernel's global order, so the
//   chain of rounded multiply-adds is the kernel's.
//
// Launch every kernel with the block size qsa_attn_partial is launched with (128 threads): block_max
// and block_sum reduce in an order that depends on it.
#include "common.cuh"

// qsa.cu's values (a module per file: each file defines its own): QSA_SPLIT is QSA_SPLIT_WIDE, the span
// of qsa_attn_partial_wide, whose arithmetic these kernels repeat.
#define QSA_SPLIT 256
#define QSA_MAX_D 256

// The first index j in [lo, hi) with ps[j] ≥ x (hi when none): ps ascends.
__device__ __forceinline__ int staged_lower_bound(const u32* __restrict__ ps, int lo, int hi, u32 x) {
    while (lo < hi) {
        const int mid = lo + ((hi - lo) >> 1);
        if (ps[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

// The span of block (h, sp, r) of qsa_attn_partial: entries [i0, i1) of row r's selection.
struct StagedSpan {
    const u32* ps;
    int i0;
    int i1;
};

__device__ __forceinline__ StagedSpan staged_span(const u32* __restrict__ sel, int sel_stride,
                                                  const u32* __restrict__ counts, int r, int sp) {
    const int n = (int)min(counts[r], (u32)sel_stride);
    const int i0 = sp * QSA_SPLIT;
    return StagedSpan{sel + (size_t)r * sel_stride, i0, min(i0 + QSA_SPLIT, n)};
}

// Grid (hq, splits, rows); block 128 threads. The arena `k_rows` holds the K rows of positions [first,
// end) (position p at row p − first, hkv·d values a row). Block (h, sp, r) scores the entries of its
// span whose positions lie in the section: S[(r·hq + h)·sel_stride + j] = (q_r,h · k_p)·scale, as
// qsa_attn_partial's score loop.
extern "C" __global__ void qsa_staged_scores(const bf16* __restrict__ q, const bf16* __restrict__ k_rows, u32 first,
                                             u32 end, const u32* __restrict__ sel, int sel_stride,
                                             const u32* __restrict__ counts, float* __restrict__ S, int hq,
                                             int hkv, int d, float scale) {
    pdl_prologue();
    __shared__ float qs[QSA_MAX_D];
    const int h = blockIdx.x, sp = blockIdx.y, r = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (d > QSA_MAX_D) return;
    const StagedSpan s = staged_span(sel, sel_stride, counts, r, sp);
    if (s.i0 >= s.i1) return;
    // Uniform over the block: every thread finds the same run.
    const int ja = staged_lower_bound(s.ps, s.i0, s.i1, first);
    const int jb = staged_lower_bound(s.ps, ja, s.i1, end);
    if (ja >= jb) return;
    const int kh = h / (hq / hkv);
    const bf16* qr = q + ((size_t)r * hq + h) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) qs[i] = bf2f(qr[i]);
    __syncthreads();
    const size_t row = (size_t)hkv * d;
    float* out = S + ((size_t)r * hq + h) * sel_stride;
    for (int j = ja + warp; j < jb; j += nw) {
        const u32 p = s.ps[j];
        const bf16* kr = k_rows + (size_t)(p - first) * row + (size_t)kh * d;
        float acc = 0.0f;
        for (int i = lane; i < d; i += 32) {
            const bf16 x = kr[i];
            acc += qs[i] * bf2f(x);
        }
        acc = warp_sum(acc) * scale;
        if (lane == 0) out[j] = acc;
    }
}

// Grid (hq, splits, rows); block 128 threads; after qsa_staged_scores of every section. Block (h, sp,
// r): m = max of its span's scores, e_j = exp(sc_j − m) (0 when either is −inf) written over the scores
// in S, l = Σ e_j, with qsa_attn_partial's loops and block reductions; part_ml[slot] = (m, l) (an empty
// span: (−inf, 0)).
extern "C" __global__ void qsa_staged_softmax(const u32* __restrict__ sel, int sel_stride,
                                              const u32* __restrict__ counts, float* __restrict__ S,
                                              float* __restrict__ part_ml, int hq, int splits) {
    pdl_prologue();
    __shared__ float scratch[32];
    const int h = blockIdx.x, sp = blockIdx.y, r = blockIdx.z;
    const StagedSpan s = staged_span(sel, sel_stride, counts, r, sp);
    const size_t slot = ((size_t)r * hq + h) * splits + sp;
    if (s.i0 >= s.i1) {
        if (threadIdx.x == 0) {
            part_ml[2 * slot] = NEG_INF;
            part_ml[2 * slot + 1] = 0.0f;
        }
        return;
    }
    float* sc = S + ((size_t)r * hq + h) * sel_stride + s.i0;
    const int n = s.i1 - s.i0;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, sc[i]);
    m = block_max(m, scratch);
    float l = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = (m == NEG_INF || sc[i] == NEG_INF) ? 0.0f : expf(sc[i] - m);
        sc[i] = e;
        l += e;
    }
    l = block_sum(l, scratch);
    if (threadIdx.x == 0) {
        part_ml[2 * slot] = m;
        part_ml[2 * slot + 1] = l;
    }
}

// Grid (hq, splits, rows); block 128 threads; after qsa_staged_softmax, once a section in ascending
// order. The arena `v_rows` holds the V rows of positions [first, end). Block (h, sp, r), thread i < d:
// acc = 0 (first_section) or part_o[slot·d + i]; then for the span's entries j in the section,
// ascending: acc += e_j · v_p[kh·d + i] (e_j == 0 skipped), as qsa_attn_partial's V loop; acc back to
// part_o. In the first section every block writes its part_o (0 where it has no entry there).
extern "C" __global__ void qsa_staged_values(const bf16* __restrict__ v_rows, u32 first, u32 end,
                                             const u32* __restrict__ sel, int sel_stride,
                                             const u32* __restrict__ counts, const float* __restrict__ S,
                                             float* __restrict__ part_o, int hq, int hkv, int d, int splits,
                                             int first_section) {
    pdl_prologue();
    __shared__ float se[QSA_SPLIT];
    __shared__ u32 sp_pos[QSA_SPLIT];
    const int h = blockIdx.x, sp = blockIdx.y, r = blockIdx.z;
    if (d > QSA_MAX_D) return;
    const StagedSpan s = staged_span(sel, sel_stride, counts, r, sp);
    const size_t slot = ((size_t)r * hq + h) * splits + sp;
    int ja = 0, jb = 0;
    if (s.i0 < s.i1) {
        ja = staged_lower_bound(s.ps, s.i0, s.i1, first);
        jb = staged_lower_bound(s.ps, ja, s.i1, end);
    }
    if (ja >= jb) {
        if (first_section)
            for (int i = threadIdx.x; i < d; i += blockDim.x) part_o[slot * d + i] = 0.0f;
        return;
    }
    const float* e_row = S + ((size_t)r * hq + h) * sel_stride;
    for (int j = ja + threadIdx.x; j < jb; j += blockDim.x) {
        se[j - ja] = e_row[j];
        sp_pos[j - ja] = s.ps[j] - first;
    }
    __syncthreads();
    const int kh = h / (hq / hkv);
    const size_t row = (size_t)hkv * d;
    const bf16* vh = v_rows + (size_t)kh * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = first_section ? 0.0f : part_o[slot * d + i];
        for (int j = 0; j < jb - ja; ++j) {
            const float e = se[j];
            if (e == 0.0f) continue;
            const bf16 x = vh[(size_t)sp_pos[j] * row + i];
            acc += e * bf2f(x);
        }
        part_o[slot * d + i] = acc;
    }
}
