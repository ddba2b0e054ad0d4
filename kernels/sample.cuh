// Shared device code of the sampling kernels (sample.cu, sample_draw.cu): the work-buffer layout, the
// host's exp_nonpos and ranking key, one row's parameters and view (mask, sparse edits), vector loads,
// block reductions, the row statistics and the radix search over key-distance histograms.
#pragma once

#include "common.cuh"

// Largest vocabulary (the chunk statistics of a row fit two per lane of one warp).
#define SAMPLE_MAX_VOCAB 262144
// Ids per chunk and threads per chunk block: each thread reads 16 consecutive ids (two 16-byte loads).
#define SAMPLE_CHUNK 4096
#define SAMPLE_CHUNK_THREADS 256
#define SAMPLE_MAX_CHUNKS (SAMPLE_MAX_VOCAB / SAMPLE_CHUNK)
// Bins of one radix pass (the widest digit, 11 bits); each thread of a chunk block scans 8 of them.
#define SAMPLE_RADIX_BINS 2048
// Radix passes: two stages (the first cut, then top-p within top-k) of three digits each.
#define SAMPLE_RADIX_DIGITS 3
#define SAMPLE_RADIX_PASSES (2 * SAMPLE_RADIX_DIGITS)
// Words per row of `params` and per entry of `edits` (layouts in crates/cuda/src/ops/sample.rs).
#define SAMPLE_PARAM_WORDS 16
#define SAMPLE_EDIT_WORDS 4
// Per-row area of `work` (u32 words; doubles at even offsets): the six radix histograms (f64), the
// chunk statistics [raw max, best edited value, its id, -] and exponential sums (f64), the chunk draw
// masses (f64) and tie counts, the windows after digits 0 and 1 of both stages, the cut.
#define SAMPLE_W_HIST 0
#define SAMPLE_W_STATS (SAMPLE_W_HIST + SAMPLE_RADIX_PASSES * SAMPLE_RADIX_BINS * 2)
#define SAMPLE_W_SUMS (SAMPLE_W_STATS + SAMPLE_MAX_CHUNKS * 4)
#define SAMPLE_W_MASS (SAMPLE_W_SUMS + SAMPLE_MAX_CHUNKS * 2)
#define SAMPLE_W_TIES (SAMPLE_W_MASS + SAMPLE_MAX_CHUNKS * 2)
#define SAMPLE_W_WINDOW (SAMPLE_W_TIES + SAMPLE_MAX_CHUNKS)
#define SAMPLE_WINDOW_WORDS 6
#define SAMPLE_W_CUT (SAMPLE_W_WINDOW + 4 * SAMPLE_WINDOW_WORDS)
#define SAMPLE_ROW_WORDS (SAMPLE_W_CUT + 4)
#define SAMPLE_NONE 0xffffffffu
#define SAMPLE_NO_CANDIDATES 0xffffffffu
#define SAMPLE_INFINITE_LOGIT 0xfffffffeu
#define SAMPLE_POS_INF __int_as_float(0x7f800000)
// e^x for x <= 0 exactly as the host's `exp_nonpos`: Cody–Waite reduction and a degree-6 polynomial,
// each operation one IEEE rounding (no contraction), 0 for x <= -87, -inf and NaN.
__device__ __forceinline__ float exp_nonpos(float x) {
    const float LOG2E = 1.44269504088896340736f;
    const float LN2_HI = 0.693145751953125f;
    const float LN2_LO = 1.428606765330187045e-6f;
    const float MAGIC = 12582912.0f;
    float xc = x > -87.0f ? x : -87.0f;
    xc = xc < 0.0f ? xc : 0.0f;
    const float t = __fadd_rn(__fmul_rn(xc, LOG2E), MAGIC);
    const float n = __fsub_rn(t, MAGIC);
    const int ni = __float_as_int(t) - __float_as_int(MAGIC);
    const float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = __fadd_rn(1.0f / 120.0f, __fmul_rn(r, 1.0f / 720.0f));
    p = __fadd_rn(1.0f / 24.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f / 6.0f, __fmul_rn(r, p));
    p = __fadd_rn(0.5f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    const float scale = __int_as_float((ni + 127) << 23);
    const float y = __fmul_rn(p, scale);
    return x > -87.0f ? y : 0.0f;
}

// The ranking key: larger logits have larger keys (f32 total order).
__device__ __forceinline__ u32 rank_key(float z) {
    const u32 u = __float_as_uint(z);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ bool finite_f(float x) { return x > NEG_INF && x < SAMPLE_POS_INF; }

// One row's sampling parameters (layout in crates/cuda/src/ops/sample.rs).
struct SampleParams {
    u32 flags, top_k, mask_at, edit_at, n_edits;
    float scale, top_p, min_p, rep, freq, pres;
    double uniform;
};

__device__ __forceinline__ SampleParams read_params(const u32* params, int row) {
    const u32* P = params + (size_t)row * SAMPLE_PARAM_WORDS;
    SampleParams p;
    p.flags = P[0];
    p.scale = __uint_as_float(P[1]);
    p.top_k = P[2];
    p.top_p = __uint_as_float(P[3]);
    p.min_p = __uint_as_float(P[4]);
    p.rep = __uint_as_float(P[5]);
    p.freq = __uint_as_float(P[6]);
    p.pres = __uint_as_float(P[7]);
    p.uniform = __hiloint2double((int)P[9], (int)P[8]);
    p.mask_at = P[10];
    p.edit_at = P[11];
    p.n_edits = P[12];
    return p;
}

__device__ __forceinline__ bool is_greedy(const SampleParams& p) { return p.flags & 1u; }

// What a radix stage searches for a row: nothing, the top-k cut (a count of tokens) or the top-p cut (a
// share of the mass). Stage 0 cuts by top-k when the row has it, else by top-p; stage 1 cuts by top-p
// within the top-k set, for rows with both.
#define SAMPLE_SEARCH_NONE 0
#define SAMPLE_SEARCH_COUNT 1
#define SAMPLE_SEARCH_MASS 2
__device__ __forceinline__ int stage_search(const SampleParams& p, int stage) {
    if (is_greedy(p)) return SAMPLE_SEARCH_NONE;
    const bool top_p = p.top_p < 1.0f;
    if (stage == 0) return p.top_k > 0 ? SAMPLE_SEARCH_COUNT : (top_p ? SAMPLE_SEARCH_MASS : SAMPLE_SEARCH_NONE);
    return p.top_k > 0 && top_p ? SAMPLE_SEARCH_MASS : SAMPLE_SEARCH_NONE;
}

struct SampleRow {
    const bf16* logits;
    int vocab;
    bool vec;
    const u32* mask;    // nullptr: every token allowed
    const u32* edits;   // n_edits entries of SAMPLE_EDIT_WORDS, ascending ids
    float* vals;        // edited values, filled by sample_stats
    int n_edits;
    int elo, ehi;       // the edits a lookup searches: all of them, or one chunk's after chunk_edits
    const u32* edited;  // shared bitmap of edited ids, its word 0 for ids 32·ebase..
    int ebase;
};

__device__ __forceinline__ SampleRow row_view(const bf16* logits, int cols, int vocab, const u32* masks,
                                              const u32* edits, u32* work, int rows, int row,
                                              const SampleParams& p) {
    SampleRow R;
    R.logits = logits + (size_t)row * cols;
    R.vocab = vocab;
    R.vec = (cols & 7) == 0 && (((size_t)R.logits) & 15) == 0;
    R.mask = (p.flags & 2u) ? masks + p.mask_at : nullptr;
    R.edits = edits + (size_t)p.edit_at * SAMPLE_EDIT_WORDS;
    R.vals = reinterpret_cast<float*>(work + (size_t)rows * SAMPLE_ROW_WORDS) + p.edit_at;
    R.n_edits = (int)p.n_edits;
    R.elo = 0;
    R.ehi = R.n_edits;
    R.edited = nullptr;
    R.ebase = 0;
    return R;
}

// The masked raw logit of one id.
__device__ __forceinline__ float masked_raw(const SampleRow& R, u32 id) {
    if ((int)id >= R.vocab) return NEG_INF;
    if (R.mask && !((R.mask[id >> 5] >> (id & 31)) & 1u)) return NEG_INF;
    return bf2f(R.logits[id]);
}

// Index of the first edit with id >= `id` among edits elo..ehi.
__device__ __forceinline__ int edit_lower_bound(const SampleRow& R, u32 id) {
    int lo = R.elo, hi = R.ehi;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (R.edits[mid * SAMPLE_EDIT_WORDS] < id) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

__device__ __forceinline__ float edited_value(const SampleRow& R, u32 id) { return R.vals[edit_lower_bound(R, id)]; }

// Edit `e` applied to its masked raw logit: penalties, then the bias, one IEEE rounding per operation
// as on the host.
__device__ __forceinline__ float edit_value(const SampleRow& R, const SampleParams& p, int e) {
    const u32* E = R.edits + e * SAMPLE_EDIT_WORDS;
    const u32 id = E[0], ef = E[1], count = E[2];
    float v = masked_raw(R, id);
    if (ef & 1u) {
        if (p.rep != 1.0f) v = v > 0.0f ? __fdiv_rn(v, p.rep) : __fmul_rn(v, p.rep);
        if (count > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(p.freq, __uint2float_rn(count)), p.pres));
    }
    if (ef & 2u) v = __fadd_rn(v, __uint_as_float(E[3]));
    return v;
}

// Marks the edited ids of the chunk starting at c0 in `bits` (SAMPLE_CHUNK / 32 words of shared memory)
// and points R at it, narrowing its edit lookups to the chunk's edits (a few of a long penalty list);
// returns the chunk's first edit and sets `end` past its last. Ends with a barrier.
__device__ __forceinline__ int chunk_edits(SampleRow& R, int c0, u32* bits, int& end) {
    for (int w = threadIdx.x; w < SAMPLE_CHUNK / 32; w += blockDim.x) bits[w] = 0;
    R.elo = 0;
    R.ehi = R.n_edits;
    const int lo = edit_lower_bound(R, (u32)c0), hi = edit_lower_bound(R, (u32)(c0 + SAMPLE_CHUNK));
    __syncthreads();
    for (int e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const u32 id = R.edits[e * SAMPLE_EDIT_WORDS];
        atomicOr(&bits[(id - (u32)c0) >> 5], 1u << (id & 31));
    }
    __syncthreads();
    R.edited = bits;
    R.ebase = c0 >> 5;
    R.elo = lo;
    R.ehi = hi;
    end = hi;
    return lo;
}

// Ids base..base+7: masked raw logits (-inf past the vocabulary), the edited bits, and (with `values`)
// the edited logits.
template <bool VALUES>
__device__ __forceinline__ void load8(const SampleRow& R, int base, float raw[8], float ze[8], u32& ebits) {
    if (base >= R.vocab) {
#pragma unroll
        for (int j = 0; j < 8; ++j) raw[j] = ze[j] = NEG_INF;
        ebits = 0;
        return;
    }
    if (R.vec && base + 8 <= R.vocab) {
        unpack8(*reinterpret_cast<const uint4*>(R.logits + base), raw);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) raw[j] = base + j < R.vocab ? bf2f(R.logits[base + j]) : NEG_INF;
    }
    const u32 mbits = R.mask ? (R.mask[base >> 5] >> (base & 31)) : 0xffu;
    ebits = (R.edited[(base >> 5) - R.ebase] >> (base & 31)) & 0xffu;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (!((mbits >> j) & 1u)) raw[j] = NEG_INF;
        ze[j] = raw[j];
        if (VALUES && ((ebits >> j) & 1u)) ze[j] = edited_value(R, (u32)(base + j));
    }
}

// Ids base..base+15 (base a multiple of 8): masked raw and edited logits.
__device__ __forceinline__ void load16(const SampleRow& R, int base, float raw[16], float ze[16]) {
    u32 e0, e1;
    load8<true>(R, base, raw, ze, e0);
    load8<true>(R, base + 8, raw + 8, ze + 8, e1);
}

__device__ __forceinline__ double warp_sum_d(double v) { return warp_reduce<SumOp>(v); }

// Block sums in f64 and u32 (block_reduce); every thread gets them. `s` is 32 values of shared memory.
__device__ __forceinline__ double block_sum_d(double v, double* s) { return block_reduce<SumOp>(v, s, 0.0); }
__device__ __forceinline__ u32 block_sum_u(u32 v, u32* s) { return block_reduce<SumOp>(v, s, 0u); }

// Block inclusive prefix sum over thread order (T: double or u32); `s` is 32 values of shared memory.
template <typename T>
__device__ __forceinline__ T block_scan(T v, T* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    if (lane == 31) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T t = lane < nwarps ? s[lane] : (T)0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        s[lane] = t;
    }
    __syncthreads();
    if (warp > 0) v += s[warp - 1];
    __syncthreads();
    return v;
}
__device__ __forceinline__ double block_scan_d(double v, double* s) { return block_scan(v, s); }
__device__ __forceinline__ u32 block_scan_u(u32 v, u32* s) { return block_scan(v, s); }

// The best (largest value, then lowest id) over the warp; every lane gets it.
__device__ __forceinline__ void warp_argmax(float& v, u32& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
}

// The best (largest value, then lowest id) over the block; every thread gets it.
__device__ __forceinline__ void block_argmax(float& v, u32& i, float* sv, u32* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    warp_argmax(v, i);
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < nwarps ? sv[lane] : NEG_INF;
    i = lane < nwarps ? si[lane] : SAMPLE_NONE;
    warp_argmax(v, i);
    __syncthreads();
}


// Kernel arguments shared by every stage. logits: [rows, cols] bf16 (the first `vocab` columns are
// tokens, vocab <= SAMPLE_MAX_VOCAB); params: [rows, SAMPLE_PARAM_WORDS]; masks, edits: the rows' allowed-
// token bitmasks and sorted edit lists at the offsets their params give; work: rows × SAMPLE_ROW_WORDS
// words of per-row results, then one f32 per edit; out: [rows, 2] = chosen id (SAMPLE_NO_CANDIDATES /
// SAMPLE_INFINITE_LOGIT on failure) and the bits of its log-probability.
#define SAMPLE_ARGS                                                                                        \
    const bf16 *__restrict__ logits, int cols, int vocab, int rows, const u32 *__restrict__ params,       \
        const u32 *__restrict__ masks, const u32 *__restrict__ edits, u32 *__restrict__ work,               \
        u32 *__restrict__ out

__device__ __forceinline__ int num_chunks(int vocab) { return (vocab + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK; }

// The whole row's statistics, reduced from sample_stats' chunk records by every warp alike.
struct RowStats {
    float M;    // raw (masked) maximum
    double Z;   // Σ e^(z - M) over the raw row
    float m;    // maximum of the edited row
    u32 am;     // its lowest id
};

__device__ __forceinline__ RowStats row_stats(const u32* W, int nchunks) {
    const int lane = threadIdx.x & 31;
    float cm[2];
    double cs[2];
    float v = NEG_INF;
    u32 i = SAMPLE_NONE;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int c = lane + 32 * q;
        cm[q] = NEG_INF;
        cs[q] = 0.0;
        if (c < nchunks) {
            const u32* s = W + SAMPLE_W_STATS + c * 4;
            cm[q] = __uint_as_float(s[0]);
            cs[q] = reinterpret_cast<const double*>(W + SAMPLE_W_SUMS)[c];
            const float bv = __uint_as_float(s[1]);
            const u32 bi = s[2];
            if (bv > v || (bv == v && bi < i)) {
                v = bv;
                i = bi;
            }
        }
    }
    RowStats st;
    st.M = warp_max(fmaxf(cm[0], cm[1]));
    st.Z = warp_sum_d(cs[0] * (double)exp_nonpos(__fsub_rn(cm[0], st.M)) +
                      cs[1] * (double)exp_nonpos(__fsub_rn(cm[1], st.M)));
    warp_argmax(v, i);
    st.m = v;
    st.am = i;
    return st;
}

// Whether the row draws (not greedy, finite maxima): only such rows have cuts and masses.
__device__ __forceinline__ bool draws(const SampleParams& p, const RowStats& st) {
    return !is_greedy(p) && finite_f(st.M) && finite_f(st.m);
}

// The cut of a row: tokens with keys above ckey are in, and of those at ckey the first `j` by id (all of
// them: SAMPLE_NONE).
struct SampleCut {
    u32 has_cut, ckey, j;
};

// What a radix stage's digits so far chose: the key distance below the row's maximum key has these
// leading digits; `above` is the count or mass of the tokens ranking before that bin, `target` top-k's
// count or top-p's share of the stage's total mass (+inf once the target is out of reach, by rounding or
// with fewer than k tokens of positive weight: every token of the bin is kept).
struct SampleWindow {
    u32 prefix, unused;
    double above, target;
};

// Digit `pass` (0, 1, 2) of the key distance d (11, 11, 10 bits from the top), whether d lies in the bin the
// earlier digits chose, and the prefix extended by one more digit.
__device__ __forceinline__ u32 radix_digit(int pass, u32 d) {
    return pass == 0 ? d >> 21 : pass == 1 ? (d >> 10) & (SAMPLE_RADIX_BINS - 1) : d & 1023u;
}
__device__ __forceinline__ bool radix_in(int pass, u32 d, u32 prefix) {
    return pass == 0 || (pass == 1 ? (d >> 21) == prefix : (d >> 10) == prefix);
}
__device__ __forceinline__ u32 radix_extend(int pass, u32 prefix, u32 b) {
    return pass == 0 ? b : pass == 1 ? (prefix << 11) | b : (prefix << 10) | b;
}

// Scans the radix histogram `h` of digit `pass` (SAMPLE_RADIX_BINS f64 counts or masses, bins in ranking
// order) for the first bin where the count or mass before it plus its own reaches the target, and
// narrows the window to it; digit 0 first sets the target: top-k (`count`), or top_p times the
// histogram's total. Every block computes the same answer (the same sums in the same order); counts are
// exact. Needs blockDim.x == SAMPLE_RADIX_BINS / 8.
__device__ SampleWindow find_crossing(const double* h, SampleWindow w, int pass, bool count, const SampleParams& p,
                                      double* s_red, u32* s_u, double* s_d) {
    const int tid = threadIdx.x;
    double hv[8], s = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        hv[i] = h[tid * 8 + i];
        s += hv[i];
    }
    const double incl = block_scan_d(s, s_red);
    if (pass == 0) {
        if (tid == blockDim.x - 1) s_d[0] = incl;
        __syncthreads();
        w.above = 0.0;
        w.target = count ? (double)p.top_k : (double)p.top_p * s_d[0];
        __syncthreads();
    }
    if (tid == 0) {
        s_u[0] = SAMPLE_NONE;
        s_u[1] = 0;
    }
    __syncthreads();
    double cw = w.above + (incl - s), fcw = 0.0, lcw = 0.0;
    u32 fb = SAMPLE_NONE, lb = SAMPLE_NONE;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (hv[i] > 0.0) {
            if (fb == SAMPLE_NONE && cw + hv[i] >= w.target) {
                fb = (u32)(tid * 8 + i);
                fcw = cw;
            }
            lb = (u32)(tid * 8 + i);
            lcw = cw;
        }
        cw += hv[i];
    }
    if (fb != SAMPLE_NONE) atomicMin(&s_u[0], fb);
    if (lb != SAMPLE_NONE) atomicMax(&s_u[1], lb + 1);
    __syncthreads();
    if (fb != SAMPLE_NONE && fb == s_u[0]) s_d[0] = fcw;
    if (lb != SAMPLE_NONE && lb + 1 == s_u[1]) s_d[1] = lcw;
    __syncthreads();
    const u32 found = s_u[0], last = s_u[1];
    SampleWindow out = w;
    if (found != SAMPLE_NONE) {
        out.prefix = radix_extend(pass, w.prefix, found);
        out.above = s_d[0];
    } else {
        // The target is out of reach (rounding, or fewer than k tokens): the whole window is kept, down
        // to its last token.
        out.prefix = radix_extend(pass, w.prefix, last > 0 ? last - 1 : 0);
        if (last > 0) out.above = s_d[1];
        out.target = (double)SAMPLE_POS_INF;
    }
    __syncthreads();
    return out;
}

// Radix histogram `pass` (SAMPLE_RADIX_PASSES of them) of a row's work area.
__device__ __forceinline__ double* radix_hist(u32* W, int pass) {
    return reinterpret_cast<double*>(W + SAMPLE_W_HIST) + (size_t)pass * SAMPLE_RADIX_BINS;
}
__device__ __forceinline__ const double* radix_hist(const u32* W, int pass) {
    return reinterpret_cast<const double*>(W + SAMPLE_W_HIST) + (size_t)pass * SAMPLE_RADIX_BINS;
}

// The window stage `stage` chose after digit `digit` (0 or 1), recorded by chunk 0 of the next pass:
// where it goes, and its value.
__device__ __forceinline__ SampleWindow* radix_window_slot(u32* W, int stage, int digit) {
    return reinterpret_cast<SampleWindow*>(W + SAMPLE_W_WINDOW) + stage * 2 + digit;
}
__device__ __forceinline__ SampleWindow radix_window(const u32* W, int stage, int digit) {
    return reinterpret_cast<const SampleWindow*>(W + SAMPLE_W_WINDOW)[stage * 2 + digit];
}

// The unnormalised probability of the tokens at key `key`.
__device__ __forceinline__ float key_weight(u32 key, const SampleParams& p, const RowStats& st) {
    return exp_nonpos(__fmul_rn(__fsub_rn(key_value(key), st.m), p.scale));
}

// The cut radix stage `stage` found for a row it searches, from its last histogram: the exact key, and
// how many of the tokens at that key (by id) reach the target: the count still missing (top-k), or
// ceil((target - above) / weight) (top-p); every one of them (SAMPLE_NONE) when the target is out of
// reach. Every thread of the block gets it.
__device__ __forceinline__ SampleCut stage_cut(const u32* W, const SampleParams& p, const RowStats& st, int stage,
                                               double* s_red, u32* s_u, double* s_d) {
    const bool count = stage_search(p, stage) == SAMPLE_SEARCH_COUNT;
    const SampleWindow w = find_crossing(radix_hist(W, stage * SAMPLE_RADIX_DIGITS + 2), radix_window(W, stage, 1),
                                         2, count, p, s_red, s_u, s_d);
    SampleCut c;
    c.has_cut = 1u;
    c.ckey = rank_key(st.m) - w.prefix;
    const double need = count ? w.target - w.above : ceil((w.target - w.above) / (double)key_weight(c.ckey, p, st));
    c.j = need < 1.0 ? 1u : (need < 4294967295.0 ? (u32)need : SAMPLE_NONE);
    return c;
}
