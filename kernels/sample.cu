// Token sampling next to the logits: the stages of the host sampler (sanmai_model::sample), in its order
// and with its f32 roundings wherever a decision depends on them, so that host and device pick the same
// token for the same uniform (up to rounding of cumulative sums: near-ties).
//
// Per row: allowed-token mask → raw max and log-normaliser (the reported log-probability) → sparse edits
// (penalties, then the summed bias; a list sorted by id) → argmax for greedy (lowest id among equal
// maxima), else weights w = exp_nonpos((z - m)·scale) (the host's polynomial, bit for bit) → top-k cut →
// top-p cut → min-p → inverse CDF over the kept tokens in id order with the row's uniform. Only the
// chosen id and its log-probability are written.
//
// The row is split into chunks of SAMPLE_CHUNK ids, one block each, and the stages run as a fixed
// sequence of kernels (the launch shapes depend only on the batch and the vocabulary; rows a kernel has
// nothing to do for return at once), exchanging per-row results through the `work` buffer:
//   sample_stats       per chunk: raw max and exponential sum, argmax of the edited row, edited values;
//   sample_top_k       one block per row with top-k: the cut (and top-p after it) by key histograms;
//   sample_radix ×3    per chunk, rows with top-p and no top-k: the mass histogram of one 11/11/10-bit
//                      digit of the ranking key below the row's maximum, within the bin the digits so far
//                      chose; together the three passes find the exact key where the top-p mass is reached;
//   sample_draw_mass   per chunk: the mass of the kept tokens above the cut key and the tokens at it;
//   sample_finish      one block per row: picks the chunk the draw lands in and walks it.
// The ranking (larger logit, then lower id) is the order of the monotone 32-bit key of the logit; the
// cut is a key and, among the tokens at that key (a run of equal logits), a number of them by id.
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Largest vocabulary: the top-k kernel's bitmap of edited ids lives in shared memory (32 KiB).
#define SAMPLE_MAX_VOCAB 262144
// Ids per tile of the top-k kernel: one warp reads a tile as 32 lanes × 8 bf16 (one 16-byte load each).
#define SAMPLE_TILE 256
#define SAMPLE_MAX_TILES (SAMPLE_MAX_VOCAB / SAMPLE_TILE)
// Candidates resolved in shared memory; also the number of tiles at most (one thread per tile).
#define SAMPLE_CAP 1024
#define SAMPLE_BINS 256
// Ids per chunk and threads per chunk block: each thread reads 16 consecutive ids (two 16-byte loads).
#define SAMPLE_CHUNK 4096
#define SAMPLE_CHUNK_THREADS 256
#define SAMPLE_MAX_CHUNKS (SAMPLE_MAX_VOCAB / SAMPLE_CHUNK)
// Bins of one radix pass (the widest digit, 11 bits); each thread of a chunk block scans 8 of them.
#define SAMPLE_RADIX_BINS 2048
// Words per row of `params` and per entry of `edits` (layouts in crates/cuda/src/ops/sample.rs).
#define SAMPLE_PARAM_WORDS 16
#define SAMPLE_EDIT_WORDS 4
// Per-row area of `work` (u32 words; doubles at even offsets): the three radix histograms (f64), the
// chunk statistics [raw max, best edited value, its id, -] and exponential sums (f64), the chunk draw
// masses (f64) and tie counts, the windows after radix passes 0 and 1, the cut.
#define SAMPLE_W_HIST 0
#define SAMPLE_W_STATS (SAMPLE_W_HIST + 3 * SAMPLE_RADIX_BINS * 2)
#define SAMPLE_W_SUMS (SAMPLE_W_STATS + SAMPLE_MAX_CHUNKS * 4)
#define SAMPLE_W_MASS (SAMPLE_W_SUMS + SAMPLE_MAX_CHUNKS * 2)
#define SAMPLE_W_TIES (SAMPLE_W_MASS + SAMPLE_MAX_CHUNKS * 2)
#define SAMPLE_W_WINDOW (SAMPLE_W_TIES + SAMPLE_MAX_CHUNKS)
#define SAMPLE_WINDOW_WORDS 6
#define SAMPLE_W_CUT (SAMPLE_W_WINDOW + 2 * SAMPLE_WINDOW_WORDS)
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

// Whether the row's cut comes from the radix passes: a draw with top-p and without top-k.
__device__ __forceinline__ bool uses_radix(const SampleParams& p) {
    return !is_greedy(p) && p.top_k == 0 && p.top_p < 1.0f;
}

struct SampleRow {
    const bf16* logits;
    int vocab;
    bool vec;
    const u32* mask;    // nullptr: every token allowed
    const u32* edits;   // n_edits entries of SAMPLE_EDIT_WORDS, ascending ids
    float* vals;        // edited values, filled by sample_stats
    int n_edits;
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

// Index of the first edit with id >= `id`.
__device__ __forceinline__ int edit_lower_bound(const SampleRow& R, u32 id) {
    int lo = 0, hi = R.n_edits;
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
// and points R at it; returns the chunk's first edit and sets `end` past its last. Ends with a barrier.
__device__ __forceinline__ int chunk_edits(SampleRow& R, int c0, u32* bits, int& end) {
    for (int w = threadIdx.x; w < SAMPLE_CHUNK / 32; w += blockDim.x) bits[w] = 0;
    const int lo = edit_lower_bound(R, (u32)c0), hi = edit_lower_bound(R, (u32)(c0 + SAMPLE_CHUNK));
    __syncthreads();
    for (int e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const u32 id = R.edits[e * SAMPLE_EDIT_WORDS];
        atomicOr(&bits[(id - (u32)c0) >> 5], 1u << (id & 31));
    }
    __syncthreads();
    R.edited = bits;
    R.ebase = c0 >> 5;
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

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u32 warp_sum_u(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block sum in f64; every thread gets it. `s` is 32 doubles of shared memory.
__device__ __forceinline__ double block_sum_d(double v, double* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum_d(v);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    double t = lane < nwarps ? s[lane] : 0.0;
    t = warp_sum_d(t);
    __syncthreads();
    return t;
}

__device__ __forceinline__ u32 block_sum_u(u32 v, u32* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum_u(v);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    u32 t = lane < nwarps ? s[lane] : 0u;
    t = warp_sum_u(t);
    __syncthreads();
    return t;
}

// Block inclusive prefix sum in f64 over thread order.
__device__ __forceinline__ double block_scan_d(double v, double* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    if (lane == 31) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double t = lane < nwarps ? s[lane] : 0.0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        s[lane] = t;
    }
    __syncthreads();
    if (warp > 0) v += s[warp - 1];
    __syncthreads();
    return v;
}

// Block inclusive prefix sum of u32 over thread order.
__device__ __forceinline__ u32 block_scan_u(u32 v, u32* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    if (lane == 31) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        u32 t = lane < nwarps ? s[lane] : 0u;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        s[lane] = t;
    }
    __syncthreads();
    if (warp > 0) v += s[warp - 1];
    __syncthreads();
    return v;
}

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


// Sorts SAMPLE_CAP 64-bit values descending (one per thread).
__device__ __forceinline__ void bitonic_desc(unsigned long long* a) {
    const int t = threadIdx.x;
    for (int size = 2; size <= SAMPLE_CAP; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const int o = t ^ stride;
            if (o > t) {
                const unsigned long long x = a[t], y = a[o];
                const bool desc = (t & size) == 0;
                if (desc ? x < y : x > y) {
                    a[t] = y;
                    a[o] = x;
                }
            }
            __syncthreads();
        }
    }
}

struct SampleShared {
    u32* edited;
    u32* hist_n;
    float* wbuf;
    unsigned long long* buf;
    double* red_d;
    float* red_f;
    u32* red_u;
    u32* misc;
    double* misc_d;
};

// The ranking prefix that top-k (`mass` false: `k` tokens) or top-p (`mass` true: mass `p` times that of
// the tokens within the current cut) keeps, among tokens of positive weight within the current cut.
// Updates the cut (has_cut, ckey, cid); leaves it when every such token is kept.
__device__ void select_cut(const SampleRow& R, const SampleShared& S, float m, float scale, bool mass,
                           u32 k, float p, bool& has_cut, u32& ckey, u32& cid) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ntiles = (R.vocab + SAMPLE_TILE - 1) / SAMPLE_TILE;
    const bool prior = has_cut;
    const u32 pkey = ckey, pid = cid;
    u32 khi = rank_key(m);
    const float zlo = m - 88.0f / scale;
    u32 klo = zlo >= -3.402823466e38f ? rank_key(zlo) : rank_key(-3.402823466e38f);
    if (prior && klo < pkey) klo = pkey;
    if (klo > khi) klo = khi;
    u32 above_n = 0;
    double above_w = 0.0, target = 0.0;
    // A token of the restricted set: positive weight, within the prior cut.
#define SAMPLE_ELIGIBLE(key, id, z) \
    ((!prior || (key) > pkey || ((key) == pkey && (id) <= pid)) && __fmul_rn(__fsub_rn((z), m), scale) > -87.0f)
    for (int level = 0; level < 4; ++level) {
        const u32 range = khi - klo;
        const int shift = range ? max(0, 32 - __clz(range) - 8) : 0;
        for (int b = tid; b < SAMPLE_BINS; b += SAMPLE_THREADS) {
            S.hist_n[b] = 0;
            S.wbuf[b] = 0.0f;
        }
        __syncthreads();
        float tw = 0.0f;
        for (int t = warp; t < ntiles; t += SAMPLE_WARPS) {
            const int base = t * SAMPLE_TILE + lane * 8;
            float raw[8], ze[8];
            u32 eb;
            load8<true>(R, base, raw, ze, eb);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 key = rank_key(ze[j]), id = (u32)(base + j);
                if (key < klo || key > khi || !SAMPLE_ELIGIBLE(key, id, ze[j])) continue;
                const u32 bin = (khi - key) >> shift;
                atomicAdd(&S.hist_n[bin], 1u);
                if (mass) {
                    const float w = exp_nonpos(__fmul_rn(__fsub_rn(ze[j], m), scale));
                    atomicAdd(&S.wbuf[bin], w);
                    tw += w;
                }
            }
        }
        __syncthreads();
        if (mass && level == 0) target = (double)p * block_sum_d((double)tw, S.red_d);
        if (tid == 0) {
            const u32 nb = (range >> shift) + 1;
            u32 cn = above_n, found = SAMPLE_NONE;
            double cw = above_w;
            for (u32 b = 0; b < nb; ++b) {
                const u32 n = S.hist_n[b];
                const double w = S.wbuf[b];
                if (mass ? (n > 0 && cw + w >= target) : (cn + n >= k)) {
                    found = b;
                    break;
                }
                cn += n;
                cw += w;
            }
            S.misc[0] = found;
            S.misc[1] = cn;
            S.misc_d[0] = cw;
        }
        __syncthreads();
        const u32 b = S.misc[0];
        if (b == SAMPLE_NONE) return;  // every token is kept
        above_n = S.misc[1];
        above_w = S.misc_d[0];
        const u32 nbin = S.hist_n[b];
        const u32 bhi = khi - (b << shift);
        const u32 span = shift ? (1u << shift) - 1u : 0u;
        const u32 blo = bhi - klo > span ? bhi - span : klo;
        __syncthreads();
        if (above_n + nbin <= SAMPLE_CAP) {
            // The whole prefix down to this bin fits: gather it, sort it by rank, resolve exactly.
            if (tid == 0) S.misc[2] = 0;
            S.buf[tid] = 0ull;  // ranks after every token
            __syncthreads();
            for (int t = warp; t < ntiles; t += SAMPLE_WARPS) {
                const int base = t * SAMPLE_TILE + lane * 8;
                float raw[8], ze[8];
                u32 eb;
                load8<true>(R, base, raw, ze, eb);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 key = rank_key(ze[j]), id = (u32)(base + j);
                    if (key < blo || !SAMPLE_ELIGIBLE(key, id, ze[j])) continue;
                    const u32 at = atomicAdd(&S.misc[2], 1u);
                    if (at < SAMPLE_CAP) S.buf[at] = ((unsigned long long)key << 32) | (u32)~id;
                }
            }
            __syncthreads();
            const u32 cnt = min(S.misc[2], (u32)SAMPLE_CAP);
            bitonic_desc(S.buf);
            const unsigned long long mine = S.buf[tid];
            u32 at;
            if (!mass) {
                at = k - 1;
            } else {
                double w = 0.0;
                if ((u32)tid < cnt)
                    w = exp_nonpos(__fmul_rn(__fsub_rn(key_value((u32)(mine >> 32)), m), scale));
                const double incl = block_scan_d(w, S.red_d);
                if (tid == 0) S.misc[3] = cnt - 1;
                __syncthreads();
                // The prefix sums grow with the rank: the first reaching the target is the cut.
                if ((u32)tid < cnt && incl >= target) atomicMin(&S.misc[3], (u32)tid);
                __syncthreads();
                at = S.misc[3];
            }
            const unsigned long long c = S.buf[min(at, cnt - 1)];
            has_cut = true;
            ckey = (u32)(c >> 32);
            cid = ~(u32)c;
            __syncthreads();
            return;
        }
        if (shift == 0) {
            // One key: a run of equal logits, cut by id. The j-th lowest id of the run is the cut.
            u32 j;
            if (!mass) {
                j = k - above_n;
            } else {
                const double w = exp_nonpos(__fmul_rn(__fsub_rn(key_value(bhi), m), scale));
                const double need = ceil((target - above_w) / w);
                j = need < 1.0 ? 1u : (need > (double)nbin ? nbin : (u32)need);
            }
            u32* tile_n = reinterpret_cast<u32*>(S.buf);
            for (int t = warp; t < SAMPLE_MAX_TILES; t += SAMPLE_WARPS) {
                const int base = t * SAMPLE_TILE + lane * 8;
                u32 c = 0;
                if (t < ntiles) {
                    float raw[8], ze[8];
                    u32 eb;
                    load8<true>(R, base, raw, ze, eb);
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        const u32 key = rank_key(ze[q]), id = (u32)(base + q);
                        c += key == bhi && SAMPLE_ELIGIBLE(key, id, ze[q]);
                    }
                }
                c = warp_sum_u(c);
                if (lane == 0) tile_n[t] = c;
            }
            __syncthreads();
            if (tid == 0) {
                u32 cum = 0, t = 0;
                for (; t < (u32)ntiles && cum + tile_n[t] < j; ++t) cum += tile_n[t];
                S.misc[4] = min(t, (u32)ntiles - 1);
                S.misc[5] = j - cum;
                S.misc[6] = SAMPLE_NONE;  // not found (inconsistent counts): the whole run is kept
            }
            __syncthreads();
            if (warp == 0) {
                const int t = S.misc[4];
                const u32 rj = S.misc[5];
                const int base = t * SAMPLE_TILE + lane * 8;
                float raw[8], ze[8];
                u32 eb, c = 0, flags = 0;
                load8<true>(R, base, raw, ze, eb);
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    const u32 key = rank_key(ze[q]), id = (u32)(base + q);
                    const bool hit = key == bhi && SAMPLE_ELIGIBLE(key, id, ze[q]);
                    c += hit;
                    flags |= (u32)hit << q;
                }
                u32 incl = c;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const u32 y = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += y;
                }
                if (incl >= rj && incl - c < rj) {
                    u32 need = rj - (incl - c);
                    for (int q = 0; q < 8; ++q)
                        if ((flags >> q) & 1u && --need == 0) {
                            S.misc[6] = (u32)(base + q);
                            break;
                        }
                }
            }
            __syncthreads();
            has_cut = true;
            ckey = bhi;
            cid = S.misc[6];
            __syncthreads();
            return;
        }
        khi = bhi;
        klo = blo;
    }
#undef SAMPLE_ELIGIBLE
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

// Per chunk: raw max and exponential sum (online, as one block did before), the best (largest, lowest
// id) edited value, and the chunk's edited values into `vals`. Also clears the radix histograms of rows
// that use them. Grid (chunks, rows), SAMPLE_CHUNK_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_CHUNK_THREADS) sample_stats(SAMPLE_ARGS) {
    pdl_prologue();
    __shared__ u32 s_bits[SAMPLE_CHUNK / 32];
    __shared__ float s_red_f[32];
    __shared__ u32 s_red_u[32];
    __shared__ double s_red_d[32];
    const int chunk = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const SampleParams p = read_params(params, row);
    SampleRow R = row_view(logits, cols, vocab, masks, edits, work, rows, row, p);
    u32* W = work + (size_t)row * SAMPLE_ROW_WORDS;
    const int c0 = chunk * SAMPLE_CHUNK;
    int hi;
    const int lo = chunk_edits(R, c0, s_bits, hi);
    for (int e = lo + tid; e < hi; e += blockDim.x) R.vals[e] = edit_value(R, p, e);
    if (uses_radix(p)) {
        double* h = reinterpret_cast<double*>(W + SAMPLE_W_HIST);
        for (int i = chunk * blockDim.x + tid; i < 3 * SAMPLE_RADIX_BINS; i += gridDim.x * blockDim.x) h[i] = 0.0;
    }
    __syncthreads();  // the chunk's edited values are visible to the block

    float raw[16], ze[16];
    const int base = c0 + tid * 16;
    load16(R, base, raw, ze);
    float rm = NEG_INF, rs = 0.0f, bv = NEG_INF;
    u32 bi = SAMPLE_NONE;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float z = raw[j];
        if (z > rm) {
            rs = __fadd_rn(__fmul_rn(rs, exp_nonpos(__fsub_rn(rm, z))), 1.0f);
            rm = z;
        } else {
            rs = __fadd_rn(rs, exp_nonpos(__fsub_rn(z, rm)));
        }
        if (ze[j] > bv) {
            bv = ze[j];
            bi = (u32)(base + j);
        }
    }
    const float cm = block_max(rm, s_red_f);
    const double cs = block_sum_d((double)rs * (double)exp_nonpos(__fsub_rn(rm, cm)), s_red_d);
    block_argmax(bv, bi, s_red_f, s_red_u);
    if (tid == 0) {
        u32* s = W + SAMPLE_W_STATS + chunk * 4;
        s[0] = __float_as_uint(cm);
        s[1] = __float_as_uint(bv);
        s[2] = bi;
        s[3] = 0;
        reinterpret_cast<double*>(W + SAMPLE_W_SUMS)[chunk] = cs;
    }
}

// The cut of a row: tokens ranking at or before (ckey, cid) are in, and of those at key ckey only the
// first `j` by id.
struct SampleCut {
    u32 has_cut, ckey, cid, j;
};

// Rows with top-k: the top-k cut, then top-p's within it, by one block (as the single-kernel sampler
// did). Grid rows, SAMPLE_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_top_k(SAMPLE_ARGS) {
    pdl_prologue();
    __shared__ u32 s_edited[SAMPLE_MAX_VOCAB / 32];
    __shared__ u32 s_hist_n[SAMPLE_BINS];
    __shared__ float s_wbuf[SAMPLE_CAP];
    __shared__ unsigned long long s_buf[SAMPLE_CAP];
    __shared__ double s_red_d[32];
    __shared__ float s_red_f[32];
    __shared__ u32 s_red_u[32];
    __shared__ u32 s_misc[8];
    __shared__ double s_misc_d[2];
    const SampleShared S = {s_edited, s_hist_n, s_wbuf, s_buf, s_red_d, s_red_f, s_red_u, s_misc, s_misc_d};
    const int row = blockIdx.x, tid = threadIdx.x;
    const SampleParams p = read_params(params, row);
    u32* W = work + (size_t)row * SAMPLE_ROW_WORDS;
    if (p.top_k == 0) return;
    const RowStats st = row_stats(W, num_chunks(vocab));
    if (!draws(p, st)) return;
    SampleRow R = row_view(logits, cols, vocab, masks, edits, work, rows, row, p);
    R.edited = s_edited;
    const int words = (vocab + 31) >> 5;
    for (int w = tid; w < words; w += blockDim.x) s_edited[w] = 0;
    __syncthreads();
    for (int e = tid; e < R.n_edits; e += blockDim.x) {
        const u32 id = R.edits[e * SAMPLE_EDIT_WORDS];
        atomicOr(&s_edited[id >> 5], 1u << (id & 31));
    }
    __syncthreads();
    bool has_cut = false;
    u32 ckey = 0, cid = 0;
    select_cut(R, S, st.m, p.scale, false, p.top_k, 1.0f, has_cut, ckey, cid);
    if (p.top_p < 1.0f) select_cut(R, S, st.m, p.scale, true, 0, p.top_p, has_cut, ckey, cid);
    if (tid == 0) {
        SampleCut* c = reinterpret_cast<SampleCut*>(W + SAMPLE_W_CUT);
        c->has_cut = has_cut;
        c->ckey = ckey;
        c->cid = cid;
        c->j = SAMPLE_NONE;
    }
}

// What the radix passes so far chose: the key distance below the row's maximum key has these leading
// digits; `above` is the mass of the tokens ranking before that bin, `target` top-p's share of the total
// (+inf once rounding left the target unreached: every token of the bin is kept).
struct SampleWindow {
    u32 prefix, unused;
    double above, target;
};

// Digit `pass` of the key distance d (11, 11, 10 bits from the top), whether d lies in the bin the
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

// Scans radix histogram `pass` (SAMPLE_RADIX_BINS f64 masses, bins in ranking order) for the first bin
// where the mass before it plus its own reaches the target, and narrows the window to it; pass 0 first
// sets the target to top_p times the histogram's total. Every block computes the same answer (the same
// sums in the same order). Needs blockDim.x == SAMPLE_RADIX_BINS / 8.
__device__ SampleWindow find_crossing(const double* h, SampleWindow w, int pass, float top_p, double* s_red,
                                      u32* s_u, double* s_d) {
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
        w.target = (double)top_p * s_d[0];
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
        // Rounding kept the target out of reach: the whole window is kept, down to its last token.
        out.prefix = radix_extend(pass, w.prefix, last > 0 ? last - 1 : 0);
        if (last > 0) out.above = s_d[1];
        out.target = (double)SAMPLE_POS_INF;
    }
    __syncthreads();
    return out;
}

// Adds w to bin `bin` of the shared histogram h (bin SAMPLE_NONE: nothing) with one atomic per distinct
// bin of the warp: lanes of one bin pool their weights through `wl` (this warp's 32 floats). Every lane
// of the warp calls it together.
__device__ __forceinline__ void hist_add(float* h, float* wl, u32 bin, float w) {
    const int lane = threadIdx.x & 31;
    const u32 peers = __match_any_sync(0xffffffffu, bin);
    wl[lane] = w;
    __syncwarp();
    if (bin != SAMPLE_NONE && lane == __ffs(peers) - 1) {
        float s = 0.0f;
        for (u32 q = peers; q; q &= q - 1) s += wl[__ffs(q) - 1];
        atomicAdd(&h[bin], s);
    }
    __syncwarp();
}

// Radix pass `pass` (0, 1, 2) of rows with top-p and without top-k: the mass of the chunk's tokens of
// positive weight in the chosen window, by digit `pass` of their key distance below the row's maximum,
// added into the row's histogram `pass`. Pass 1 and 2 first narrow the window with the histogram before
// (chunk 0 records it for the next kernel). Grid (chunks, rows), SAMPLE_CHUNK_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_CHUNK_THREADS) sample_radix(SAMPLE_ARGS, int pass) {
    pdl_prologue();
    __shared__ float s_hist[SAMPLE_RADIX_BINS];
    __shared__ float s_wl[SAMPLE_CHUNK_THREADS];
    __shared__ u32 s_bits[SAMPLE_CHUNK / 32];
    __shared__ double s_red_d[32];
    __shared__ u32 s_u[2];
    __shared__ double s_d[2];
    const int chunk = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const SampleParams p = read_params(params, row);
    if (!uses_radix(p)) return;
    u32* W = work + (size_t)row * SAMPLE_ROW_WORDS;
    const RowStats st = row_stats(W, num_chunks(vocab));
    if (!draws(p, st)) return;
    double* hist = reinterpret_cast<double*>(W + SAMPLE_W_HIST);
    SampleWindow* windows = reinterpret_cast<SampleWindow*>(W + SAMPLE_W_WINDOW);
    SampleWindow w = {0u, 0u, 0.0, 0.0};
    if (pass > 0) {
        if (pass == 2) w = windows[0];
        w = find_crossing(hist + (pass - 1) * SAMPLE_RADIX_BINS, w, pass - 1, p.top_p, s_red_d, s_u, s_d);
        if (chunk == 0 && tid == 0) windows[pass - 1] = w;
    }
    for (int b = tid; b < SAMPLE_RADIX_BINS; b += blockDim.x) s_hist[b] = 0.0f;
    SampleRow R = row_view(logits, cols, vocab, masks, edits, work, rows, row, p);
    int hi;
    chunk_edits(R, chunk * SAMPLE_CHUNK, s_bits, hi);  // its barriers also order the clearing above

    const u32 kmax = rank_key(st.m);
    float raw[16], ze[16];
    const int base = chunk * SAMPLE_CHUNK + tid * 16;
    load16(R, base, raw, ze);
    float* wl = s_wl + (tid & ~31);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float x = __fmul_rn(__fsub_rn(ze[j], st.m), p.scale);
        u32 bin = SAMPLE_NONE;
        float wt = 0.0f;
        if (x > -87.0f) {
            const u32 d = kmax - rank_key(ze[j]);
            if (radix_in(pass, d, w.prefix)) {
                bin = radix_digit(pass, d);
                wt = exp_nonpos(x);
            }
        }
        hist_add(s_hist, wl, bin, wt);
    }
    __syncthreads();
    double* g = hist + pass * SAMPLE_RADIX_BINS;
    for (int b = tid; b < SAMPLE_RADIX_BINS; b += blockDim.x)
        if (s_hist[b] != 0.0f) atomicAdd(&g[b], (double)s_hist[b]);
}

// The row's cut: top-k rows' from sample_top_k, top-p rows' from the last radix histogram (the exact
// key, and how many of its tokens reach the target: ceil((target - above) / weight)), none otherwise.
__device__ __forceinline__ SampleCut row_cut(const u32* W, const SampleParams& p, const RowStats& st, double* s_red,
                                             u32* s_u, double* s_d) {
    if (p.top_k > 0) return *reinterpret_cast<const SampleCut*>(W + SAMPLE_W_CUT);
    SampleCut c = {0u, 0u, SAMPLE_NONE, SAMPLE_NONE};
    if (!uses_radix(p)) return c;
    const SampleWindow w0 = reinterpret_cast<const SampleWindow*>(W + SAMPLE_W_WINDOW)[1];
    const double* hist = reinterpret_cast<const double*>(W + SAMPLE_W_HIST);
    const SampleWindow w = find_crossing(hist + 2 * SAMPLE_RADIX_BINS, w0, 2, p.top_p, s_red, s_u, s_d);
    c.has_cut = 1u;
    c.ckey = rank_key(st.m) - w.prefix;
    const double wc = exp_nonpos(__fmul_rn(__fsub_rn(key_value(c.ckey), st.m), p.scale));
    const double need = ceil((w.target - w.above) / wc);
    c.j = need < 1.0 ? 1u : (need < 4294967295.0 ? (u32)need : SAMPLE_NONE);
    return c;
}

// Per chunk: the mass of the kept tokens ranking before the cut key (weight at least min-p) and the
// number of tokens at the cut key with id at most the cut's (positive weight). Chunk 0 records the cut
// of rows without top-k for sample_finish. Grid (chunks, rows), SAMPLE_CHUNK_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_CHUNK_THREADS) sample_draw_mass(SAMPLE_ARGS) {
    pdl_prologue();
    __shared__ u32 s_bits[SAMPLE_CHUNK / 32];
    __shared__ double s_red_d[32];
    __shared__ u32 s_red_u[32];
    __shared__ u32 s_u[2];
    __shared__ double s_d[2];
    const int chunk = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const SampleParams p = read_params(params, row);
    u32* W = work + (size_t)row * SAMPLE_ROW_WORDS;
    const RowStats st = row_stats(W, num_chunks(vocab));
    if (!draws(p, st)) return;
    const SampleCut c = row_cut(W, p, st, s_red_d, s_u, s_d);
    if (p.top_k == 0 && chunk == 0 && tid == 0) *reinterpret_cast<SampleCut*>(W + SAMPLE_W_CUT) = c;
    SampleRow R = row_view(logits, cols, vocab, masks, edits, work, rows, row, p);
    int hi;
    chunk_edits(R, chunk * SAMPLE_CHUNK, s_bits, hi);
    float raw[16], ze[16];
    const int base = chunk * SAMPLE_CHUNK + tid * 16;
    load16(R, base, raw, ze);
    double mass = 0.0;
    u32 ties = 0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float x = __fmul_rn(__fsub_rn(ze[j], st.m), p.scale);
        if (!(x > -87.0f)) continue;
        const u32 key = rank_key(ze[j]);
        if (c.has_cut && key < c.ckey) continue;
        if (c.has_cut && key == c.ckey) {
            ties += (u32)(base + j) <= c.cid;
            continue;
        }
        const float wt = exp_nonpos(x);
        if (wt >= p.min_p) mass += wt;
    }
    mass = block_sum_d(mass, s_red_d);
    ties = block_sum_u(ties, s_red_u);
    if (tid == 0) {
        reinterpret_cast<double*>(W + SAMPLE_W_MASS)[chunk] = mass;
        W[SAMPLE_W_TIES + chunk] = ties;
    }
}

// The draw of a row that samples: the chunk the uniform lands in by the chunk masses (tokens at the cut
// key counted in id order across chunks), then that chunk's kept token by an inverse CDF in id order.
__device__ u32 draw_row(SampleRow& R, const SampleParams& p, const RowStats& st, const u32* W, int nchunks,
                        u32* s_bits, double* s_red_d, u32* s_red_u, u32* s_u, double* s_d) {
    const int tid = threadIdx.x;
    const SampleCut c = *reinterpret_cast<const SampleCut*>(W + SAMPLE_W_CUT);
    const float wc = c.has_cut ? exp_nonpos(__fmul_rn(__fsub_rn(key_value(c.ckey), st.m), p.scale)) : 0.0f;
    const bool ties_kept = c.has_cut && wc > 0.0f && wc >= p.min_p;
    // Per chunk (one thread each): the tied tokens it keeps, and its kept mass.
    const u32 ties = tid < nchunks ? W[SAMPLE_W_TIES + tid] : 0u;
    const u32 before = block_scan_u(ties, s_red_u) - ties;
    const u32 kt = ties_kept && before < c.j ? min(ties, c.j - before) : 0u;
    const double kept =
        (tid < nchunks ? reinterpret_cast<const double*>(W + SAMPLE_W_MASS)[tid] : 0.0) + (double)wc * (double)kt;
    const double incl = block_scan_d(kept, s_red_d);
    if (tid == blockDim.x - 1) s_d[0] = incl;
    if (tid == 0) {
        s_u[0] = SAMPLE_NONE;
        s_u[1] = 0;
    }
    __syncthreads();
    const double total = s_d[0];
    if (!(total > 0.0)) return SAMPLE_NO_CANDIDATES;
    const double u = p.uniform * total;
    // The prefix sums grow with the chunk: the first passing u holds the draw; rounding can carry u past
    // the last, which then takes the last kept token.
    if (u < incl && kept > 0.0) atomicMin(&s_u[0], (u32)tid);
    if (kept > 0.0) atomicMax(&s_u[1], (u32)tid + 1);
    __syncthreads();
    const u32 hit = s_u[0];
    const u32 ch = hit != SAMPLE_NONE ? hit : s_u[1] - 1;
    __syncthreads();
    if ((u32)tid == ch) {
        s_d[1] = hit != SAMPLE_NONE ? u - (incl - kept) : (double)SAMPLE_POS_INF;
        s_u[0] = kt;
    }
    __syncthreads();
    const double rest = s_d[1];
    const u32 chunk_kt = s_u[0];
    __syncthreads();

    // The chunk: each thread's 16 consecutive ids, tied tokens ranked by id through a block scan.
    int hi;
    chunk_edits(R, (int)ch * SAMPLE_CHUNK, s_bits, hi);
    float raw[16], ze[16], w16[16];
    const int base = (int)ch * SAMPLE_CHUNK + tid * 16;
    load16(R, base, raw, ze);
    u32 tie_flags = 0, nt = 0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float x = __fmul_rn(__fsub_rn(ze[j], st.m), p.scale);
        w16[j] = 0.0f;
        if (!(x > -87.0f)) continue;
        const u32 key = rank_key(ze[j]);
        if (c.has_cut && key < c.ckey) continue;
        if (c.has_cut && key == c.ckey) {
            if ((u32)(base + j) <= c.cid) {
                tie_flags |= 1u << j;
                ++nt;
            }
            continue;
        }
        const float wt = exp_nonpos(x);
        if (wt >= p.min_p) w16[j] = wt;
    }
    u32 rank = block_scan_u(nt, s_red_u) - nt;
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        if ((tie_flags >> j) & 1u) {
            if (ties_kept && rank < chunk_kt) w16[j] = wc;
            ++rank;
        }
        sum += w16[j];
    }
    const double li = block_scan_d(sum, s_red_d);
    if (tid == 0) {
        s_u[0] = SAMPLE_NONE;
        s_u[1] = 0;
    }
    __syncthreads();
    if (rest < li && sum > 0.0) atomicMin(&s_u[0], (u32)tid);
    if (sum > 0.0) atomicMax(&s_u[1], (u32)tid + 1);
    __syncthreads();
    const u32 who = s_u[0] != SAMPLE_NONE ? s_u[0] : s_u[1] - 1;
    __syncthreads();
    if (tid == 0) s_u[0] = SAMPLE_NO_CANDIDATES;
    __syncthreads();
    if ((u32)tid == who) {
        double seen = li - sum;
        u32 id = SAMPLE_NO_CANDIDATES;
        for (int j = 0; j < 16; ++j) {
            if (w16[j] > 0.0f) {
                id = (u32)(base + j);
                seen += w16[j];
                if (rest < seen) break;
            }
        }
        s_u[0] = id;
    }
    __syncthreads();
    return s_u[0];
}

// One block per row: the log-normaliser, the argmax (greedy) or the draw, and the output. Grid rows,
// SAMPLE_CHUNK_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_CHUNK_THREADS) sample_finish(SAMPLE_ARGS) {
    pdl_prologue();
    __shared__ u32 s_bits[SAMPLE_CHUNK / 32];
    __shared__ double s_red_d[32];
    __shared__ u32 s_red_u[32];
    __shared__ u32 s_u[2];
    __shared__ double s_d[2];
    const int row = blockIdx.x, tid = threadIdx.x;
    const SampleParams p = read_params(params, row);
    SampleRow R = row_view(logits, cols, vocab, masks, edits, work, rows, row, p);
    const u32* W = work + (size_t)row * SAMPLE_ROW_WORDS;
    const int nchunks = num_chunks(vocab);
    const RowStats st = row_stats(W, nchunks);
    u32* o = out + (size_t)row * 2;
    if (!finite_f(st.M)) {
        if (tid == 0) {
            o[0] = st.M == SAMPLE_POS_INF ? SAMPLE_INFINITE_LOGIT : SAMPLE_NO_CANDIDATES;
            o[1] = 0;
        }
        return;
    }
    const float log_z = st.M + (float)log(st.Z);
    u32 chosen;
    if (st.m == NEG_INF) chosen = SAMPLE_NO_CANDIDATES;
    else if (is_greedy(p) || st.m == SAMPLE_POS_INF) chosen = st.am;
    else chosen = draw_row(R, p, st, W, nchunks, s_bits, s_red_d, s_red_u, s_u, s_d);
    if (tid == 0) {
        if (chosen == SAMPLE_NONE || chosen == SAMPLE_NO_CANDIDATES) {
            o[0] = SAMPLE_NO_CANDIDATES;
            o[1] = 0;
        } else {
            o[0] = chosen;
            o[1] = __float_as_uint(masked_raw(R, chosen) - log_z);
        }
    }
}
