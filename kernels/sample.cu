// Token sampling next to the logits: the stages of the host sampler (sanmai_model::sample), in its order
// and with its f32 roundings wherever a decision depends on them, so that host and device pick the same
// token for the same uniform (up to rounding of cumulative sums: near-ties).
//
// Per row: allowed-token mask → raw max and log-normaliser (the reported log-probability) → sparse edits
// (penalties, then the summed bias; a list sorted by id, marked in a shared bitmap) → argmax for greedy
// (lowest id among equal maxima), else weights w = exp_nonpos((z - m)·scale) (the host's polynomial, bit
// for bit) → top-k cut → top-p cut → min-p → inverse CDF over the kept tokens in id order with the row's
// uniform. Only the chosen id and its log-probability are written.
//
// Cuts are found without sorting the row: the ranking (larger logit, then lower id) is the order of the
// monotone 32-bit key of the logit; passes histogram the keys of a shrinking key window (256 bins) until
// the ranking prefix that holds the answer has at most SAMPLE_CAP tokens (gathered into shared memory,
// sorted, resolved exactly) or the window is one key (a run of equal logits: resolved by id).
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Largest vocabulary: the bitmap of edited ids lives in shared memory (32 KiB).
#define SAMPLE_MAX_VOCAB 262144
// Ids per tile: one warp reads a tile as 32 lanes × 8 bf16 (one 16-byte load each).
#define SAMPLE_TILE 256
#define SAMPLE_MAX_TILES (SAMPLE_MAX_VOCAB / SAMPLE_TILE)
// Candidates resolved in shared memory; also the number of tiles at most (one thread per tile).
#define SAMPLE_CAP 1024
#define SAMPLE_BINS 256
// Words per row of `params` and per entry of `edits` (layouts in crates/cuda/src/ops/sample.rs).
#define SAMPLE_PARAM_WORDS 16
#define SAMPLE_EDIT_WORDS 4
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

// Whether (key, id) ranks at or before the cut (ckey, cid).
__device__ __forceinline__ bool within_cut(u32 key, u32 id, bool has_cut, u32 ckey, u32 cid) {
    return !has_cut || key > ckey || (key == ckey && id <= cid);
}

struct SampleRow {
    const bf16* logits;
    int vocab;
    bool vec;
    const u32* mask;    // nullptr: every token allowed
    const u32* edits;   // n_edits entries of SAMPLE_EDIT_WORDS, ascending ids
    float* vals;        // edited values, filled by the edit stage
    int n_edits;
    const u32* edited;  // shared bitmap of edited ids
};

// The masked raw logit of one id.
__device__ __forceinline__ float masked_raw(const SampleRow& R, u32 id) {
    if ((int)id >= R.vocab) return NEG_INF;
    if (R.mask && !((R.mask[id >> 5] >> (id & 31)) & 1u)) return NEG_INF;
    return bf2f(R.logits[id]);
}

__device__ __forceinline__ float edited_value(const SampleRow& R, u32 id) {
    int lo = 0, hi = R.n_edits;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (R.edits[mid * SAMPLE_EDIT_WORDS] < id) lo = mid + 1;
        else hi = mid;
    }
    return R.vals[lo];
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
    ebits = (R.edited[base >> 5] >> (base & 31)) & 0xffu;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (!((mbits >> j) & 1u)) raw[j] = NEG_INF;
        ze[j] = raw[j];
        if (VALUES && ((ebits >> j) & 1u)) ze[j] = edited_value(R, (u32)(base + j));
    }
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
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_d(v);
    if (lane == 0) s[warp] = v;
    __syncthreads();
    double t = lane < SAMPLE_WARPS ? s[lane] : 0.0;
    t = warp_sum_d(t);
    __syncthreads();
    return t;
}

// Block inclusive prefix sum in f64 over thread order.
__device__ __forceinline__ double block_scan_d(double v, double* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    if (lane == 31) s[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double t = s[lane];
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

// The best (largest value, then lowest id) over the block; every thread gets it.
__device__ __forceinline__ void block_argmax(float& v, u32& i, float* sv, u32* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = sv[lane];
    i = si[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ u32 block_max_u(u32 v, u32* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) s[warp] = v;
    __syncthreads();
    v = s[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    return v;
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

// One block of SAMPLE_THREADS threads per row; grid = rows. logits: [rows, cols] bf16 (the first `vocab`
// columns are tokens, vocab <= SAMPLE_MAX_VOCAB); params: [rows, SAMPLE_PARAM_WORDS]; masks, edits:
// the rows' allowed-token bitmasks and sorted edit lists at the offsets their params give; vals: one f32
// per edit (scratch); out: [rows, 2] = chosen id (SAMPLE_NO_CANDIDATES / SAMPLE_INFINITE_LOGIT on
// failure) and the bits of its log-probability.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_bf16(
    const bf16* __restrict__ logits, int cols, int vocab, const u32* __restrict__ params,
    const u32* __restrict__ masks, const u32* __restrict__ edits, float* __restrict__ vals, u32* __restrict__ out) {
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

    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32* P = params + (size_t)row * SAMPLE_PARAM_WORDS;
    const u32 flags = P[0];
    const float scale = __uint_as_float(P[1]);
    const u32 top_k = P[2];
    const float top_p = __uint_as_float(P[3]), min_p = __uint_as_float(P[4]);
    const float rep = __uint_as_float(P[5]), freq = __uint_as_float(P[6]), pres = __uint_as_float(P[7]);
    const double uniform = __hiloint2double((int)P[9], (int)P[8]);
    SampleRow R;
    R.logits = logits + (size_t)row * cols;
    R.vocab = vocab;
    R.vec = (cols & 7) == 0 && (((size_t)R.logits) & 15) == 0;
    R.mask = (flags & 2u) ? masks + P[10] : nullptr;
    R.edits = edits + (size_t)P[11] * SAMPLE_EDIT_WORDS;
    R.vals = vals + P[11];
    R.n_edits = (int)P[12];
    R.edited = s_edited;
    const int ntiles = (vocab + SAMPLE_TILE - 1) / SAMPLE_TILE;
    const int words = (vocab + 31) >> 5;

    for (int w = tid; w < words; w += SAMPLE_THREADS) s_edited[w] = 0;
    __syncthreads();
    for (int e = tid; e < R.n_edits; e += SAMPLE_THREADS) {
        const u32 id = R.edits[e * SAMPLE_EDIT_WORDS];
        atomicOr(&s_edited[id >> 5], 1u << (id & 31));
    }
    __syncthreads();

    // Raw max and normaliser (online), and the argmax of the tokens without edits.
    float rm = NEG_INF, rs = 0.0f, um = NEG_INF;
    u32 ui = SAMPLE_NONE;
    for (int t = warp; t < ntiles; t += SAMPLE_WARPS) {
        const int base = t * SAMPLE_TILE + lane * 8;
        float raw[8], ze[8];
        u32 eb;
        load8<false>(R, base, raw, ze, eb);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float z = raw[j];
            if (z > rm) {
                rs = __fadd_rn(__fmul_rn(rs, exp_nonpos(__fsub_rn(rm, z))), 1.0f);
                rm = z;
            } else {
                rs = __fadd_rn(rs, exp_nonpos(__fsub_rn(z, rm)));
            }
            if (!((eb >> j) & 1u) && z > um) {
                um = z;
                ui = (u32)(base + j);
            }
        }
    }
    const float M = block_max(rm, s_red_f);
    const double Z = block_sum_d((double)rs * (double)exp_nonpos(__fsub_rn(rm, M)), s_red_d);
    block_argmax(um, ui, s_red_f, s_red_u);
    u32* o = out + (size_t)row * 2;
    if (M == SAMPLE_POS_INF || M == NEG_INF) {
        if (tid == 0) {
            o[0] = M == SAMPLE_POS_INF ? SAMPLE_INFINITE_LOGIT : SAMPLE_NO_CANDIDATES;
            o[1] = 0;
        }
        return;
    }
    const float log_z = M + (float)log(Z);

    // The edits: penalties, then the bias, one IEEE rounding per operation as on the host.
    float em = NEG_INF;
    u32 ei = SAMPLE_NONE;
    for (int e = tid; e < R.n_edits; e += SAMPLE_THREADS) {
        const u32* E = R.edits + e * SAMPLE_EDIT_WORDS;
        const u32 id = E[0], ef = E[1], count = E[2];
        float v = masked_raw(R, id);
        if (ef & 1u) {
            if (rep != 1.0f) v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
            if (count > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(freq, __uint2float_rn(count)), pres));
        }
        if (ef & 2u) v = __fadd_rn(v, __uint_as_float(E[3]));
        R.vals[e] = v;
        if (v > em || (v == em && id < ei)) {
            em = v;
            ei = id;
        }
    }
    block_argmax(em, ei, s_red_f, s_red_u);  // also makes the edited values visible to the block
    const float m = fmaxf(um, em);
    u32 chosen = SAMPLE_NONE;
    if (m == NEG_INF) {
        chosen = SAMPLE_NO_CANDIDATES;
    } else if ((flags & 1u) || m == SAMPLE_POS_INF) {
        chosen = min(um == m ? ui : SAMPLE_NONE, em == m ? ei : SAMPLE_NONE);
    } else {
        bool has_cut = false;
        u32 ckey = 0, cid = 0;
        if (top_k > 0) select_cut(R, S, m, scale, false, top_k, 1.0f, has_cut, ckey, cid);
        if (top_p < 1.0f) select_cut(R, S, m, scale, true, 0, top_p, has_cut, ckey, cid);

        // Inverse CDF over the kept tokens in id order: tile masses, their prefix sums, then one warp
        // walks the tile the draw lands in.
        const float xmin = min_p > 0.0f ? logf(min_p) - 0.01f * (1.0f + fabsf(logf(min_p))) : -87.0f;
        double* tile_w = reinterpret_cast<double*>(s_buf);
        u32 last = 0;
        bool any = false;
        for (int t = warp; t < SAMPLE_MAX_TILES; t += SAMPLE_WARPS) {
            double sum = 0.0;
            if (t < ntiles) {
                const int base = t * SAMPLE_TILE + lane * 8;
                float raw[8], ze[8];
                u32 eb;
                load8<true>(R, base, raw, ze, eb);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 id = (u32)(base + j);
                    const float x = __fmul_rn(__fsub_rn(ze[j], m), scale);
                    if (!(x > -87.0f) || x < xmin || !within_cut(rank_key(ze[j]), id, has_cut, ckey, cid)) continue;
                    const float w = exp_nonpos(x);
                    if (w > 0.0f && w >= min_p) {
                        sum += w;
                        last = id;
                        any = true;
                    }
                }
            }
            sum = warp_sum_d(sum);
            if (lane == 0) tile_w[t] = sum;
        }
        const u32 last_kept = block_max_u(any ? last + 1 : 0, s_red_u);  // id + 1, 0: none
        const double incl = block_scan_d(tile_w[tid], s_red_d);
        tile_w[tid] = incl;
        if (tid == 0) s_misc[0] = SAMPLE_NONE;
        __syncthreads();
        const double u = uniform * tile_w[SAMPLE_MAX_TILES - 1];
        // The prefix sums grow with the id: the first tile whose sum passes u holds the draw.
        if (u < incl) atomicMin(&s_misc[0], (u32)tid);
        __syncthreads();
        const u32 tile = s_misc[0];
        if (tile != SAMPLE_NONE) {
            if (tid == 0) s_misc[1] = SAMPLE_NONE;
            __syncthreads();
            if (warp == 0) {
                const double rest = u - (tile > 0 ? tile_w[tile - 1] : 0.0);
                const int base = tile * SAMPLE_TILE + lane * 8;
                float raw[8], ze[8], w8[8];
                u32 eb;
                load8<true>(R, base, raw, ze, eb);
                double c = 0.0;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 id = (u32)(base + j);
                    const float x = __fmul_rn(__fsub_rn(ze[j], m), scale);
                    float w = 0.0f;
                    if (x > -87.0f && x >= xmin && within_cut(rank_key(ze[j]), id, has_cut, ckey, cid)) {
                        w = exp_nonpos(x);
                        if (!(w >= min_p)) w = 0.0f;
                    }
                    w8[j] = w;
                    c += w;
                }
                double li = c;
#pragma unroll
                for (int off = 1; off < 32; off <<= 1) {
                    const double y = __shfl_up_sync(0xffffffffu, li, off);
                    if (lane >= off) li += y;
                }
                const u32 who = __ballot_sync(0xffffffffu, rest < li);
                const u32 nonzero = __ballot_sync(0xffffffffu, c > 0.0);
                // Rounding can leave the draw past the tile's last token: it takes that token.
                const int pick = who ? __ffs(who) - 1 : 31 - __clz(nonzero);
                if (lane == pick) {
                    double seen = li - c;
                    u32 id = SAMPLE_NONE;
                    for (int j = 0; j < 8; ++j) {
                        if (w8[j] > 0.0f) {
                            id = (u32)(base + j);
                            seen += w8[j];
                            if (rest < seen) break;
                        }
                    }
                    s_misc[1] = id;
                }
            }
            __syncthreads();
            chosen = s_misc[1];
        } else {
            // Rounding carried the draw past the last tile: the last kept token.
            chosen = last_kept ? last_kept - 1 : SAMPLE_NO_CANDIDATES;
        }
    }
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
