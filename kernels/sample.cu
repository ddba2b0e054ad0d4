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
//   sample_radix ×6    per chunk, two stages of three passes: each pass histograms one 11/11/10-bit digit
//                      of the ranking key's distance below the row's maximum, within the bin the digits
//                      so far chose, so a stage finds the exact key where its target is reached. Stage 0
//                      counts tokens for top-k (the key where k are reached) or sums mass for top-p
//                      without top-k; stage 1, for rows with both, sums the mass of the top-k set only
//                      (top-p's target is a share of that set's mass);
//   sample_draw_mass   per chunk (sample_draw.cu): the mass of the kept tokens above the cut key and the
//                      tokens at it;
//   sample_finish      one block per row (sample_draw.cu): picks the chunk the draw lands in and walks it.
// Every row takes the same passes whatever its filters (a pass with nothing to search for a row returns
// at once), so the launches are the same for every batch of a size and can be replayed from a graph; a
// top-k of any size costs three chunk-parallel passes, and the top-p cut after it three more.
// The ranking (larger logit, then lower id) is the order of the monotone 32-bit key of the logit; the
// cut is a key and, among the tokens at that key (a run of equal logits), a number of them by id.
#include "sample.cuh"

// Per chunk: raw max and exponential sum (online, as one block did before), the best (largest, lowest
// id) edited value, and the chunk's edited values into `vals`. Also clears the radix histograms of the
// stages the row searches. Grid (chunks, rows), SAMPLE_CHUNK_THREADS threads.
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
    const int stages = stage_search(p, 1) != SAMPLE_SEARCH_NONE ? 2 : stage_search(p, 0) != SAMPLE_SEARCH_NONE;
    double* h = radix_hist(W, 0);
    const int words = stages * SAMPLE_RADIX_DIGITS * SAMPLE_RADIX_BINS;
    for (int i = chunk * blockDim.x + tid; i < words; i += gridDim.x * blockDim.x) h[i] = 0.0;
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

// Radix pass `pass` (0..SAMPLE_RADIX_PASSES): digit pass % 3 of stage pass / 3. Adds the count (top-k)
// or mass (top-p) of the chunk's tokens of positive weight in the chosen window, by that digit of their
// key distance below the row's maximum, into the row's histogram `pass`. Digits 1 and 2 first narrow the
// window with the histogram before (chunk 0 records it for the next pass). Stage 1 counts only the top-k
// set: keys above the top-k cut's, and at its key the first j tokens, whose mass chunk 0 adds at once.
// Grid (chunks, rows), SAMPLE_CHUNK_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_CHUNK_THREADS) sample_radix(SAMPLE_ARGS, int pass) {
    pdl_prologue();
    __shared__ float s_hist[SAMPLE_RADIX_BINS];
    __shared__ float s_wl[SAMPLE_CHUNK_THREADS];
    __shared__ u32 s_bits[SAMPLE_CHUNK / 32];
    __shared__ double s_red_d[32];
    __shared__ u32 s_u[2];
    __shared__ double s_d[2];
    const int chunk = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const int stage = pass / SAMPLE_RADIX_DIGITS, digit = pass % SAMPLE_RADIX_DIGITS;
    const SampleParams p = read_params(params, row);
    const int search = stage_search(p, stage);
    if (search == SAMPLE_SEARCH_NONE) return;
    u32* W = work + (size_t)row * SAMPLE_ROW_WORDS;
    const RowStats st = row_stats(W, num_chunks(vocab));
    if (!draws(p, st)) return;
    const bool count = search == SAMPLE_SEARCH_COUNT;
    SampleWindow w = {0u, 0u, 0.0, 0.0};
    if (digit > 0) {
        if (digit == 2) w = radix_window(W, stage, 0);
        w = find_crossing(radix_hist(W, pass - 1), w, digit - 1, count, p, s_red_d, s_u, s_d);
        if (chunk == 0 && tid == 0) *radix_window_slot(W, stage, digit - 1) = w;
    }
    // The top-k cut bounds stage 1 (stage 0 keeps every key: the cut below all of them).
    SampleCut kc = {0u, 0u, SAMPLE_NONE};
    if (stage == 1) kc = stage_cut(W, p, st, 0, s_red_d, s_u, s_d);
    const u32 kmax = rank_key(st.m);
    double* g = radix_hist(W, pass);
    if (stage == 1 && kc.j != SAMPLE_NONE && chunk == 0 && tid == 0) {
        const u32 d = kmax - kc.ckey;
        if (radix_in(digit, d, w.prefix))
            atomicAdd(&g[radix_digit(digit, d)], (double)kc.j * (double)key_weight(kc.ckey, p, st));
    }
    // A chunk whose best token ranks below the top-k cut adds nothing.
    if (rank_key(__uint_as_float(W[SAMPLE_W_STATS + chunk * 4 + 1])) < kc.ckey) return;

    for (int b = tid; b < SAMPLE_RADIX_BINS; b += blockDim.x) s_hist[b] = 0.0f;
    SampleRow R = row_view(logits, cols, vocab, masks, edits, work, rows, row, p);
    int hi;
    chunk_edits(R, chunk * SAMPLE_CHUNK, s_bits, hi);  // its barriers also order the clearing above

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
            const u32 key = rank_key(ze[j]), d = kmax - key;
            const bool in_set = key > kc.ckey || (key == kc.ckey && kc.j == SAMPLE_NONE);
            if (in_set && radix_in(digit, d, w.prefix)) {
                bin = radix_digit(digit, d);
                wt = count ? 1.0f : exp_nonpos(x);
            }
        }
        hist_add(s_hist, wl, bin, wt);
    }
    __syncthreads();
    for (int b = tid; b < SAMPLE_RADIX_BINS; b += blockDim.x)
        if (s_hist[b] != 0.0f) atomicAdd(&g[b], (double)s_hist[b]);
}
