// The draw of the sampling kernels (see sample.cu for the whole sequence): the kept mass per chunk under
// the row's cut and min-p, then one block per row that finds the chunk the uniform lands in, walks it in
// id order and writes the chosen id and its log-probability.
#include "sample.cuh"

// The row's cut: that of the last radix stage it searched (stage 1, top-p within top-k, keeps at most the
// top-k cut's tokens at a shared key), none for rows without top-k or top-p.
__device__ __forceinline__ SampleCut row_cut(const u32* W, const SampleParams& p, const RowStats& st, double* s_red,
                                             u32* s_u, double* s_d) {
    SampleCut c = {0u, 0u, SAMPLE_NONE};
    if (stage_search(p, 0) == SAMPLE_SEARCH_NONE) return c;
    if (stage_search(p, 1) == SAMPLE_SEARCH_NONE) return stage_cut(W, p, st, 0, s_red, s_u, s_d);
    const SampleCut kc = stage_cut(W, p, st, 0, s_red, s_u, s_d);
    c = stage_cut(W, p, st, 1, s_red, s_u, s_d);
    if (c.ckey == kc.ckey && kc.j < c.j) c.j = kc.j;
    return c;
}

// Per chunk: the mass of the kept tokens ranking before the cut key (weight at least min-p) and the
// number of tokens at the cut key (positive weight). Chunk 0 records the cut for sample_finish. Grid
// (chunks, rows), SAMPLE_CHUNK_THREADS threads.
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
    if (chunk == 0 && tid == 0) *reinterpret_cast<SampleCut*>(W + SAMPLE_W_CUT) = c;
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
            ++ties;
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
            tie_flags |= 1u << j;
            ++nt;
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
