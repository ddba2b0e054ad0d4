// Gated attention over the paged K/V cache, decode and prefill, as split-K: a partial kernel attends
// one query row and a group of query heads sharing one KV head to one span of context positions (each
// K/V row is read once for the whole group), a reduce kernel merges the spans (log-sum-exp) and
// multiplies by sigmoid(gate).
//
// Cache layout (the CPU backend's): k_pool, v_pool [num_blocks, bs, hkv·d]; position p of a row lies
// in block table[p / bs], row p % bs. Query head h reads KV head h / (hq / hkv). Scores
// q·k·scale in f32 with max subtraction, as transformers' eager attention.
#include "common.cuh"

#define ATT_MAX_D 256
// Query heads one partial block attends at most (their q slices and output sums live in registers).
#define ATT_HB 8
#define ATT_THREADS 128
// Context positions one partial block attends at most, and the granule of its span.
#define ATT_MAX_SPLIT 256
#define ATT_MIN_SPLIT 32
// K/V rows a thread has in flight per step.
#define ATT_R 8

// Position p's block-table slot p / bs by a multiply (the partial kernel divides for every row it reads,
// and a division is a long sequence of code): with magic = ceil(2^32 / bs) (att_magic),
// floor(p · magic / 2^32) = p / bs exactly while p · bs < 2^32, which the launcher checks for the
// longest row (its capacity, max_blocks · bs).
__device__ __forceinline__ u32 att_magic(int bs) { return bs > 1 ? (u32)(0xFFFFFFFFull / (u32)bs) + 1u : 0u; }
__device__ __forceinline__ u32 att_div(long long p, int bs, u32 magic) {
    return bs > 1 ? __umulhi((u32)p, magic) : (u32)p;
}

// Eight consecutive bf16 of a row from element 8c, packed as a 16-byte vector; elements at or past d
// read as zero. VEC: d is a multiple of 8 (so the row and the chunk are 16-byte aligned).
template <bool VEC>
__device__ __forceinline__ uint4 att_ld8(const bf16* __restrict__ row, int c, int d) {
    const int i0 = 8 * c;
    if constexpr (VEC) {
        return i0 < d ? __ldg(reinterpret_cast<const uint4*>(row + i0)) : make_uint4(0u, 0u, 0u, 0u);
    } else {
        u32 w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = i0 + 2 * e;
            const u32 lo = i < d ? (u32)__bfloat16_as_ushort(row[i]) : 0u;
            const u32 hi = i + 1 < d ? (u32)__bfloat16_as_ushort(row[i + 1]) : 0u;
            w[e] = lo | (hi << 16);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// 16 bytes global → shared without a register round trip (zeros when !ok; src is then not read).
__device__ __forceinline__ void att_cp16(void* dst, const void* src, bool ok) {
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

__device__ __forceinline__ void att_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void att_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void att_cp_wait_all_but_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

// Sums v[0..7] over the tpr lanes (8, 16 or 32, aligned) that share a row, transposed: afterwards
// lane lt of the group holds the full sum of value att_head_of(lt, tpr) (9 shuffles for tpr = 32
// instead of 8·5). Every lane of the warp must call it.
__device__ __forceinline__ float att_group_sum8(float v[8], int tpr, int lane) {
    int o = tpr >> 1;
    bool up = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float send = up ? v[i] : v[i + 4], keep = up ? v[i + 4] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    o >>= 1;
    up = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float send = up ? v[i] : v[i + 2], keep = up ? v[i + 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    o >>= 1;
    up = (lane & o) != 0;
    float s = (up ? v[1] : v[0]) + __shfl_xor_sync(0xffffffffu, up ? v[0] : v[1], o);
    for (o >>= 1; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

__device__ __forceinline__ int att_head_of(int lt, int tpr) {
    return ((lt & (tpr >> 1)) ? 4 : 0) | ((lt & (tpr >> 2)) ? 2 : 0) | ((lt & (tpr >> 3)) ? 1 : 0);
}

template <bool VEC>
__device__ __forceinline__ void attn_partial_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_pool,
                                                  const bf16* __restrict__ v_pool, const u32* __restrict__ table,
                                                  int table_stride, int max_blocks, const u32* __restrict__ lens,
                                                  int pos0, float* __restrict__ part_o, float* __restrict__ part_ml,
                                                  int hq, int hkv, int d, int bs, u32 num_blocks, int splits,
                                                  int max_split, int hb, float scale, float* sc, float* red,
                                                  float* ml) {
    const int group = hq / hkv, nchunk = (group + hb - 1) / hb;
    const int kh = blockIdx.x / nchunk, g0 = (blockIdx.x % nchunk) * hb;
    const int nh = min(hb, group - g0);
    const int h0 = kh * group + g0;  // the block's first query head
    const int r = blockIdx.y, sp = blockIdx.z;
    // Lanes per K/V row: a power of two ≥ 8 covering d in chunks of 8; row groups of the block.
    int tpr = 8;
    while (8 * tpr < d) tpr <<= 1;
    const int lt = threadIdx.x & (tpr - 1), rg = threadIdx.x / tpr, nrg = ATT_THREADS / tpr;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long cap = (long long)max_blocks * bs;
    const u32* tab = table + (size_t)r * table_stride;
    const u32 mg = att_magic(bs);

    // The first step's block ids (known before the length arrives: positions below the cap).
    const int step = ATT_R * nrg;
    u32 blk0[ATT_R];
#pragma unroll
    for (int j = 0; j < ATT_R; ++j) {
        const long long p = (long long)sp * ATT_MIN_SPLIT + j * nrg + rg;  // rebased below
        blk0[j] = p < cap ? tab[att_div(p, bs, mg)] : num_blocks;
    }
    long long len = lens ? (long long)lens[r] : (long long)pos0 + r + 1;
    len = min(len, cap);
    // This row's span size: len spread over the splits, a multiple of ATT_MIN_SPLIT, at most max_split.
    const long long per = (len + splits - 1) / splits;
    const int split = (int)min((long long)max_split,
                               max((long long)ATT_MIN_SPLIT, (per + ATT_MIN_SPLIT - 1) / ATT_MIN_SPLIT * ATT_MIN_SPLIT));
    const long long p0 = (long long)sp * split;
    if (p0 >= len) {  // nothing of this row in this span: an empty split, the reduce skips its sums
        if (threadIdx.x < nh) {
            const size_t slot = ((size_t)r * hq + h0 + threadIdx.x) * splits + sp;
            part_ml[2 * slot] = NEG_INF;
            part_ml[2 * slot + 1] = 0.0f;
        }
        return;
    }
    const int n = (int)min((long long)split, len - p0);
    if (split != ATT_MIN_SPLIT) {  // the prefetched ids assumed the smallest span
#pragma unroll
        for (int j = 0; j < ATT_R; ++j) {
            const long long p = p0 + j * nrg + rg;
            blk0[j] = p < cap ? tab[att_div(p, bs, mg)] : num_blocks;
        }
    }

    // q of the block's heads, this thread's 8 elements, in registers (heads past nh: zero).
    float qf[ATT_HB][8];
#pragma unroll
    for (int g = 0; g < ATT_HB; ++g) {
        const uint4 raw = g < nh ? att_ld8<VEC>(q + ((size_t)r * hq + h0 + g) * d, lt, d) : make_uint4(0u, 0u, 0u, 0u);
        unpack8(raw, qf[g]);
    }

    const size_t row = (size_t)hkv * d;
    const size_t koff = (size_t)kh * d;
    const int iters = (n + step - 1) / step;
    const int hsel = att_head_of(lt, tpr);
    const bool writer = (lt & ((tpr >> 3) - 1)) == 0;
    // K/V rows pass through shared memory (red, unused before the final sum): thread t's row j of a
    // step lies at slot j·ATT_THREADS + t of kst (16 bytes); with VEC, cp.async copies them without a
    // register round trip, and the first step's V rows go to vst while the scores are computed.
    uint4* kst = reinterpret_cast<uint4*>(red);
    uint4* vst = kst + ATT_R * ATT_THREADS;
    const int me = threadIdx.x;

    // Scores: sc[i·ATT_HB + g] = q_g·k_(p0+i)·scale (NEG_INF where the block id masks the position).
    for (int it = 0; it < iters; ++it) {
        size_t at[ATT_R];
        bool ok[ATT_R];
        u32 okm = 0;  // bit j: ok[j], for the loop below that is not unrolled
#pragma unroll
        for (int j = 0; j < ATT_R; ++j) {
            const int i = it * step + j * nrg + rg;
            const long long p = p0 + i;
            const u32 pq = att_div(p, bs, mg);
            const u32 blk = i >= n ? num_blocks : it == 0 ? blk0[j] : tab[pq];
            ok[j] = blk < num_blocks;
            okm |= (u32)ok[j] << j;
            at[j] = ok[j] ? ((size_t)blk * bs + ((u32)p - pq * (u32)bs)) * row + koff : 0;
            if constexpr (VEC) {
                const bool in = ok[j] && 8 * lt < d;
                att_cp16(kst + j * ATT_THREADS + me, k_pool + at[j] + (in ? 8 * lt : 0), in);
            } else {
                kst[j * ATT_THREADS + me] = ok[j] ? att_ld8<false>(k_pool + at[j], lt, d) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        if constexpr (VEC) {
            att_cp_commit();
            if (it == 0) {
#pragma unroll
                for (int j = 0; j < ATT_R; ++j) {
                    const bool in = ok[j] && 8 * lt < d;
                    att_cp16(vst + j * ATT_THREADS + me, v_pool + at[j] + (in ? 8 * lt : 0), in);
                }
                att_cp_commit();
                att_cp_wait_all_but_one();  // the K rows; the V rows stay in flight
            } else {
                att_cp_wait_all();
            }
        }
        // Not unrolled over the rows (the same sums in the same order): the kernel's code is what a
        // short decode launch waits on most, fetched into each multiprocessor's instruction cache.
#pragma unroll 1
        for (int j = 0; j < ATT_R; ++j) {
            float kf[8], s[8];
            unpack8(kst[j * ATT_THREADS + me], kf);
#pragma unroll
            for (int g = 0; g < ATT_HB; ++g) {
                float a = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) a += qf[g][e] * kf[e];
                s[g] = a;
            }
            const float t = att_group_sum8(s, tpr, lane);
            const int i = it * step + j * nrg + rg;
            if (writer && i < n) sc[i * ATT_HB + hsel] = (okm >> j) & 1u ? t * scale : NEG_INF;
        }
    }
    __syncthreads();

    // Per head: the span's max m, e = exp(s − m) in place of the scores, l = Σ e. (Loops here and below
    // are kept rolled where their work is small: the code, not the work, is what such a launch waits on.)
#pragma unroll 1
    for (int g = warp; g < ATT_HB; g += ATT_THREADS / 32) {
        float m = NEG_INF;
#pragma unroll 1
        for (int i = lane; i < n; i += 32) m = fmaxf(m, sc[i * ATT_HB + g]);
        m = warp_max(m);
        float l = 0.0f;
#pragma unroll 1
        for (int i = lane; i < n; i += 32) {
            const float s = sc[i * ATT_HB + g];
            const float e = (m == NEG_INF || s == NEG_INF) ? 0.0f : expf(s - m);
            sc[i * ATT_HB + g] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ml[g] = m;
            ml[ATT_HB + g] = l;
        }
    }
    __syncthreads();

    // Σ e·v per head over this thread's rows and 8 elements.
    float acc[ATT_HB][8];
#pragma unroll
    for (int g = 0; g < ATT_HB; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
    for (int it = 0; it < iters; ++it) {
        const uint4* src = kst;
        if (VEC && it == 0) {
            att_cp_wait_all();
            src = vst;
        } else {
#pragma unroll
            for (int j = 0; j < ATT_R; ++j) {
                const int i = it * step + j * nrg + rg;
                const long long p = p0 + i;
                const u32 pq = att_div(p, bs, mg);
                const u32 blk = i >= n ? num_blocks : tab[pq];
                const bool ok = blk < num_blocks;
                const size_t at = ok ? ((size_t)blk * bs + ((u32)p - pq * (u32)bs)) * row + koff : 0;
                if constexpr (VEC) {
                    const bool in = ok && 8 * lt < d;
                    att_cp16(kst + j * ATT_THREADS + me, v_pool + at + (in ? 8 * lt : 0), in);
                } else {
                    kst[j * ATT_THREADS + me] = ok ? att_ld8<false>(v_pool + at, lt, d) : make_uint4(0u, 0u, 0u, 0u);
                }
            }
            if constexpr (VEC) {
                att_cp_commit();
                att_cp_wait_all();
            }
        }
#pragma unroll 1
        for (int j = 0; j < ATT_R; ++j) {
            const int i = it * step + j * nrg + rg;
            if (i >= n) continue;
            const float4 ea = *reinterpret_cast<const float4*>(sc + i * ATT_HB);
            const float4 eb = *reinterpret_cast<const float4*>(sc + i * ATT_HB + 4);
            const float ev[ATT_HB] = {ea.x, ea.y, ea.z, ea.w, eb.x, eb.y, eb.z, eb.w};
            float vf[8];
            unpack8(src[j * ATT_THREADS + me], vf);
#pragma unroll
            for (int g = 0; g < ATT_HB; ++g)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] += ev[g] * vf[e];
        }
    }

    // Sum the row groups: red[(rg·ATT_HB + g)·d + i] (once every thread is done with its V rows in
    // red), then one thread per output element.
    __syncthreads();
    if (8 * lt < d) {
#pragma unroll
        for (int g = 0; g < ATT_HB; ++g) {
            if (g >= nh) break;
            float* dst = red + ((size_t)rg * ATT_HB + g) * d + 8 * lt;
            if constexpr (VEC) {
                reinterpret_cast<float4*>(dst)[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
                reinterpret_cast<float4*>(dst)[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (8 * lt + e < d) dst[e] = acc[g][e];
            }
        }
    }
    __syncthreads();
#pragma unroll 1
    for (int g = 0; g < nh; ++g) {
        float* po = part_o + (((size_t)r * hq + h0 + g) * splits + sp) * d;
#pragma unroll 1
        for (int i = threadIdx.x; i < d; i += ATT_THREADS) {
            float t = 0.0f;
#pragma unroll 4
            for (int k = 0; k < nrg; ++k) t += red[(k * ATT_HB + g) * d + i];  // loads in flight together
            po[i] = t;
        }
    }
    if (threadIdx.x < nh) {
        const size_t slot = ((size_t)r * hq + h0 + threadIdx.x) * splits + sp;
        part_ml[2 * slot] = ml[threadIdx.x];
        part_ml[2 * slot + 1] = ml[ATT_HB + threadIdx.x];
    }
}

// Grid (hkv·c, rows, splits) with c = ⌈(hq/hkv) / hb⌉; block ATT_THREADS threads. Block (x, r, s)
// attends query row r of the hb (≤ ATT_HB) query heads (x mod c)·hb .. of KV head x / c's group (fewer
// in the group's last chunk) to span s of the row's context; lanes split each K/V row in 16-byte
// chunks, the rest of the block takes successive rows. Row r's query is q + r·hq·d (bf16, normed and
// roped). Row r sees positions 0 .. len − 1 where len = lens[r] (decode, lens non-null) or
// pos0 + r + 1 (causal prefill of one sequence, lens null), capped at max_blocks·bs; its block table is
// table + r·table_stride (table_stride 0: every row shares row 0). A block id ≥ num_blocks masks the
// position. The row's span size is ⌈len / splits⌉ rounded up to ATT_MIN_SPLIT, at most max_split
// (≤ ATT_MAX_SPLIT; splits·max_split covers the longest row); spans starting at or past len write
// only (−inf, 0) to part_ml and exit. Writes part_o [rows, hq, splits, d] (unnormalised Σ e·v) and
// part_ml [.., 2] (max, Σ e). d ≤ ATT_MAX_D; d a multiple of 8 takes 16-byte loads.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_paged_partial(
    const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
    const u32* __restrict__ table, int table_stride, int max_blocks, const u32* __restrict__ lens, int pos0,
    float* __restrict__ part_o, float* __restrict__ part_ml, int hq, int hkv, int d, int bs, u32 num_blocks,
    int splits, int max_split, int hb, float scale) {
    pdl_prologue();
    __shared__ __align__(16) float sc[ATT_MAX_SPLIT * ATT_HB];
    __shared__ __align__(16) float red[ATT_HB * ATT_THREADS * 8];
    __shared__ float ml[2 * ATT_HB];
    if (d > ATT_MAX_D || hb > ATT_HB || max_split > ATT_MAX_SPLIT || blockDim.x != ATT_THREADS) return;
    if (d % 8 == 0)
        attn_partial_impl<true>(q, k_pool, v_pool, table, table_stride, max_blocks, lens, pos0, part_o, part_ml, hq,
                                hkv, d, bs, num_blocks, splits, max_split, hb, scale, sc, red, ml);
    else
        attn_partial_impl<false>(q, k_pool, v_pool, table, table_stride, max_blocks, lens, pos0, part_o, part_ml, hq,
                                 hkv, d, bs, num_blocks, splits, max_split, hb, scale, sc, red, ml);
}

#define ATT_RED_CHUNK 256

// Grid (hq, rows); block a multiple of 32 threads, at least d. Merges the splits of
// attn_paged_partial: o = Σ_s exp(m_s − M)·o_s / Σ_s exp(m_s − M)·l_s (zero when nothing was visible;
// splits with m_s = −inf are skipped, their part_o never read), times sigmoid(gate) when gate is
// non-null (gate and out: [rows, hq·d]), rounded once to bf16.
extern "C" __global__ void attn_paged_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             const bf16* __restrict__ gate, bf16* __restrict__ out, int hq, int d,
                                             int splits) {
    pdl_prologue();
    __shared__ float w[ATT_RED_CHUNK], wl[ATT_RED_CHUNK];
    __shared__ float scratch[32];
    const int h = blockIdx.x, r = blockIdx.y;
    const size_t slot0 = ((size_t)r * hq + h) * splits;
    float M = NEG_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) M = fmaxf(M, part_ml[2 * (slot0 + s)]);
    M = block_max(M, scratch);
    // Thread i sums output element i over the splits, a chunk of split weights at a time.
    const int i = threadIdx.x;
    float num = 0.0f, den = 0.0f;
    for (int c0 = 0; c0 < splits; c0 += ATT_RED_CHUNK) {
        const int nc = min(ATT_RED_CHUNK, splits - c0);
        for (int s = threadIdx.x; s < nc; s += blockDim.x) {
            const float m = part_ml[2 * (slot0 + c0 + s)];
            const float e = m == NEG_INF ? 0.0f : expf(m - M);
            w[s] = e;
            wl[s] = e * part_ml[2 * (slot0 + c0 + s) + 1];
        }
        __syncthreads();
        // Eight splits' loads issued before their sums (a loop that loaded inside its skip test waited
        // for each load in turn); the sums in split order, skipped splits adding nothing, as before.
#pragma unroll 1
        for (int s0 = 0; s0 < nc; s0 += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int s = s0 + u;
                v[u] = s < nc && w[s] != 0.0f && i < d ? part_o[(slot0 + c0 + s) * d + i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int s = s0 + u;
                if (s >= nc || w[s] == 0.0f) continue;
                den += wl[s];
                if (i < d) num += w[s] * v[u];
            }
        }
        __syncthreads();
    }
    if (i < d) {
        const size_t at = ((size_t)r * hq + h) * d + i;
        float o = den > 0.0f ? num / den : 0.0f;
        if (gate) o *= sigmoid_f(bf2f(gate[at]));
        out[at] = f2bf(o);
    }
}
