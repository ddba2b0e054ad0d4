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
// The granule of a block's span of context positions.
#define ATT_MIN_SPLIT 32
// Rows of one K/V tile a thread copies (its row group's share), and the tiles a block holds: a tile is
// ATT_R·nrg consecutive positions; while one is summed the next ATT_STAGES − 1 are on their way.
#define ATT_R 4
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ATT_STAGES 4  // 64 KiB: two blocks in a Hopper multiprocessor's 228 KiB
#else
#define ATT_STAGES 2  // 32 KiB: two blocks in the 100 KiB of sm_86 / sm_89
#endif
// The dynamic shared buffer of a partial block (attn_paged_partial's launch passes its size), in
// floats: the tiles (ATT_STAGES · 2 (K, V) · ATT_R · ATT_THREADS 16-byte slots), reused at the end for
// the row groups' sums (ATT_HB · nrg · d ≤ ATT_HB · 8 · ATT_THREADS floats, since 8·tpr ≥ d).
#define ATT_BUF (ATT_STAGES * 2 * ATT_R * ATT_THREADS * 4)
static_assert(ATT_HB * 8 * ATT_THREADS <= ATT_BUF, "the row groups' sums fit the tile buffer");
// Row groups of a block at most (tpr ≥ 8).
#define ATT_MAX_RG (ATT_THREADS / 8)

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
// Waits until at most the newest ATT_STAGES − 1 groups of this thread's copies are in flight.
__device__ __forceinline__ void att_cp_wait_stages() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(ATT_STAGES - 1) : "memory");
}

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

// One pass over the span, flash-decoding style: each row group (tpr lanes sharing a K/V row) keeps,
// per head, a running max and sum (in lane g for head g) and Σ e·v (its lanes' 8 elements each) over the
// rows it reads, rescaled when the max grows; the row groups are merged (log-sum-exp) at the end. K and V rows of a tile arrive together by cp.async, the
// next ATT_STAGES − 1 tiles already in flight while one is summed. A thread reads back only the 16-byte slots it
// copied, so the tiles need no barrier; the scores of a tile pass between the lanes of a row group
// (one warp or part of one) through shared memory.
template <bool VEC>
__device__ __forceinline__ void attn_partial_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_pool,
                                                  const bf16* __restrict__ v_pool, const u32* __restrict__ table,
                                                  int table_stride, int max_blocks, const u32* __restrict__ lens,
                                                  int pos0, float* __restrict__ part_o, float* __restrict__ part_ml,
                                                  int hq, int hkv, int d, int bs, u32 num_blocks, int splits,
                                                  int max_split, int hb, float scale, float* buf, float* scr,
                                                  float* alp, float* mlr) {
    const int group = hq / hkv, nchunk = (group + hb - 1) / hb;
    const int kh = blockIdx.x / nchunk, g0 = (blockIdx.x % nchunk) * hb;
    const int nh = min(hb, group - g0);
    const int h0 = kh * group + g0;  // the block's first query head
    const int r = blockIdx.y, sp = blockIdx.z;
    // Lanes per K/V row: a power of two ≥ 8 covering d in chunks of 8; row groups of the block.
    int tpr = 8;
    while (8 * tpr < d) tpr <<= 1;
    const int lt = threadIdx.x & (tpr - 1), rg = threadIdx.x / tpr, nrg = ATT_THREADS / tpr;
    const long long cap = (long long)max_blocks * bs;
    const u32* tab = table + (size_t)r * table_stride;
    const u32 mg = att_magic(bs);

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
    const size_t row = (size_t)hkv * d;
    const size_t koff = (size_t)kh * d;
    const int tile = ATT_R * nrg, ntiles = (n + tile - 1) / tile;
    uint4* slots = reinterpret_cast<uint4*>(buf);  // [stage][K, V][j][thread]
    const int me = threadIdx.x;

    // Copies this thread's chunks of tile t's rows (j·nrg + rg) into stage s; returns the rows' mask bits.
    auto issue = [&](int t, int s) -> u32 {
        u32 okm = 0;
        uint4* ks = slots + (size_t)(2 * s) * ATT_R * ATT_THREADS;
        uint4* vs = ks + ATT_R * ATT_THREADS;
#pragma unroll
        for (int j = 0; j < ATT_R; ++j) {
            const int i = t * tile + j * nrg + rg;
            const long long p = p0 + i;
            const u32 pq = att_div(p, bs, mg);
            const u32 blk = i < n ? tab[pq] : num_blocks;
            const bool ok = blk < num_blocks;
            okm |= (u32)ok << j;
            const size_t at = ok ? ((size_t)blk * bs + ((u32)p - pq * (u32)bs)) * row + koff : 0;
            if constexpr (VEC) {
                const bool in = ok && 8 * lt < d;
                att_cp16(ks + j * ATT_THREADS + me, k_pool + at + (in ? 8 * lt : 0), in);
                att_cp16(vs + j * ATT_THREADS + me, v_pool + at + (in ? 8 * lt : 0), in);
            } else {
                ks[j * ATT_THREADS + me] = ok ? att_ld8<false>(k_pool + at, lt, d) : make_uint4(0u, 0u, 0u, 0u);
                vs[j * ATT_THREADS + me] = ok ? att_ld8<false>(v_pool + at, lt, d) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        return okm;
    };

    // q of the block's heads, this thread's 8 elements, in registers (heads past nh: zero).
    float qf[ATT_HB][8];
#pragma unroll
    for (int g = 0; g < ATT_HB; ++g) {
        const uint4 raw = g < nh ? att_ld8<VEC>(q + ((size_t)r * hq + h0 + g) * d, lt, d) : make_uint4(0u, 0u, 0u, 0u);
        unpack8(raw, qf[g]);
    }

    const int hsel = att_head_of(lt, tpr);
    const bool writer = (lt & ((tpr >> 3) - 1)) == 0;
    float* my = scr + rg * (ATT_R * ATT_HB);  // this row group's scores of a tile, then their weights [j][head]
    float* al = alp + rg * ATT_HB;            // and each head's rescale factor
    float mh = NEG_INF, lh = 0.0f;            // lane lt < ATT_HB: head lt's running max and sum
    float acc[ATT_HB][8];
#pragma unroll
    for (int g = 0; g < ATT_HB; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;

    // Tile t is summed at step t, issued at step t − (ATT_STAGES − 1) into stage t mod ATT_STAGES (the
    // stage tile t − ATT_STAGES left at the step before); a step past the last tile commits an empty
    // group, so that "all but the newest ATT_STAGES − 1 groups" is always tile t.
    u32 okm = 0;  // bit ATT_R·s + j: row j of the tile in stage s is visible
#pragma unroll 1
    for (int t = 1 - ATT_STAGES; t < ntiles; ++t) {
        const int ti = t + ATT_STAGES - 1;
        if (ti < ntiles) {
            const int si = ti % ATT_STAGES;
            okm = (okm & ~(((1u << ATT_R) - 1u) << (ATT_R * si))) | issue(ti, si) << (ATT_R * si);
        }
        if constexpr (VEC) att_cp_commit();
        if (t < 0) continue;
        if constexpr (VEC) att_cp_wait_stages();
        const int s = t % ATT_STAGES;
        const uint4* ks = slots + (size_t)(2 * s) * ATT_R * ATT_THREADS;
        const uint4* vs = ks + ATT_R * ATT_THREADS;
        const u32 rows_ok = (okm >> (ATT_R * s)) & ((1u << ATT_R) - 1u);

        // Scores of the tile's rows: my[j·ATT_HB + g] = q_g·k·scale (NEG_INF for a masked row).
        __syncwarp();  // the lanes are done reading the last tile's weights
#pragma unroll 1
        for (int j = 0; j < ATT_R; ++j) {
            float kf[8], sc[8];
            unpack8(ks[j * ATT_THREADS + me], kf);
#pragma unroll
            for (int g = 0; g < ATT_HB; ++g) {
                float a = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) a += qf[g][e] * kf[e];
                sc[g] = a;
            }
            const float v = att_group_sum8(sc, tpr, threadIdx.x & 31);
            if (writer) my[j * ATT_HB + hsel] = (rows_ok >> j) & 1u ? v * scale : NEG_INF;
        }
        __syncwarp();
        // Lane g: head g's new max, the factor its sums are rescaled by (0 when the max was −inf, 1
        // when it did not grow), and the tile's weights e = exp(s − max) in place of the scores.
        if (lt < ATT_HB) {
            float mt = mh;
#pragma unroll
            for (int j = 0; j < ATT_R; ++j) mt = fmaxf(mt, my[j * ATT_HB + lt]);
            float a = 1.0f;
            if (mt != mh) {
                a = expf(mh - mt);
                mh = mt;
                lh *= a;
            }
#pragma unroll 1
            for (int j = 0; j < ATT_R; ++j) {
                const float x = my[j * ATT_HB + lt];
                const float e = x == NEG_INF ? 0.0f : expf(x - mt);  // x finite ⇒ mt finite
                my[j * ATT_HB + lt] = e;
                lh += e;
            }
            al[lt] = a;
        }
        __syncwarp();
        {
            const float4 a0 = *reinterpret_cast<const float4*>(al), a1 = *reinterpret_cast<const float4*>(al + 4);
            const float a[ATT_HB] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
            for (int g = 0; g < ATT_HB; ++g)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] *= a[g];
        }
#pragma unroll 1
        for (int j = 0; j < ATT_R; ++j) {
            if (!((rows_ok >> j) & 1u)) continue;
            const float4 ea = *reinterpret_cast<const float4*>(my + j * ATT_HB);
            const float4 eb = *reinterpret_cast<const float4*>(my + j * ATT_HB + 4);
            const float ev[ATT_HB] = {ea.x, ea.y, ea.z, ea.w, eb.x, eb.y, eb.z, eb.w};
            float vf[8];
            unpack8(vs[j * ATT_THREADS + me], vf);
#pragma unroll
            for (int g = 0; g < ATT_HB; ++g)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] += ev[g] * vf[e];
        }
    }

    // Merge the row groups: M = max over them, each one's sums scaled by exp(m − M) into the buffer
    // (free once every tile is read), then one thread per output element sums them.
    if constexpr (VEC) att_cp_wait_all();  // only empty groups are left
    __syncthreads();
    if (lt < ATT_HB) {
        mlr[rg * ATT_HB + lt] = mh;
        mlr[(ATT_MAX_RG + rg) * ATT_HB + lt] = lh;
    }
    __syncthreads();
    float* red = buf;
    if (8 * lt < d) {
#pragma unroll
        for (int g = 0; g < ATT_HB; ++g) {
            if (g >= nh) break;
            float mm = NEG_INF;
#pragma unroll 1
            for (int k = 0; k < nrg; ++k) mm = fmaxf(mm, mlr[k * ATT_HB + g]);
            const float mine = mlr[rg * ATT_HB + g];
            const float f = mine == NEG_INF ? 0.0f : expf(mine - mm);
            float* dst = red + ((size_t)rg * ATT_HB + g) * d + 8 * lt;
            if constexpr (VEC) {
                reinterpret_cast<float4*>(dst)[0] =
                    make_float4(acc[g][0] * f, acc[g][1] * f, acc[g][2] * f, acc[g][3] * f);
                reinterpret_cast<float4*>(dst)[1] =
                    make_float4(acc[g][4] * f, acc[g][5] * f, acc[g][6] * f, acc[g][7] * f);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (8 * lt + e < d) dst[e] = acc[g][e] * f;
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
        const int g = threadIdx.x;
        float mm = NEG_INF, ll = 0.0f;
        for (int k = 0; k < nrg; ++k) mm = fmaxf(mm, mlr[k * ATT_HB + g]);
        for (int k = 0; k < nrg; ++k) {
            const float mk = mlr[k * ATT_HB + g];
            if (mk != NEG_INF) ll += mlr[(ATT_MAX_RG + k) * ATT_HB + g] * expf(mk - mm);
        }
        const size_t slot = ((size_t)r * hq + h0 + g) * splits + sp;
        part_ml[2 * slot] = mm;
        part_ml[2 * slot + 1] = ll;
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
// (splits·max_split covers the longest row); spans starting at or past len write only (−inf, 0) to
// part_ml and exit. Writes part_o [rows, hq, splits, d] (unnormalised Σ e·v) and part_ml [.., 2]
// (max, Σ e). d ≤ ATT_MAX_D; d a multiple of 8 takes 16-byte loads. Dynamic shared memory: ATT_BUF
// floats.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_paged_partial(
    const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
    const u32* __restrict__ table, int table_stride, int max_blocks, const u32* __restrict__ lens, int pos0,
    float* __restrict__ part_o, float* __restrict__ part_ml, int hq, int hkv, int d, int bs, u32 num_blocks,
    int splits, int max_split, int hb, float scale) {
    pdl_prologue();
    extern __shared__ __align__(16) float buf[];  // ATT_BUF floats
    __shared__ __align__(16) float scr[ATT_MAX_RG * ATT_R * ATT_HB];
    __shared__ __align__(16) float alp[ATT_MAX_RG * ATT_HB];
    __shared__ float mlr[2 * ATT_MAX_RG * ATT_HB];
    if (d > ATT_MAX_D || hb > ATT_HB || blockDim.x != ATT_THREADS) return;
    if (d % 8 == 0)
        attn_partial_impl<true>(q, k_pool, v_pool, table, table_stride, max_blocks, lens, pos0, part_o, part_ml, hq,
                                hkv, d, bs, num_blocks, splits, max_split, hb, scale, buf, scr, alp, mlr);
    else
        attn_partial_impl<false>(q, k_pool, v_pool, table, table_stride, max_blocks, lens, pos0, part_o, part_ml, hq,
                                 hkv, d, bs, num_blocks, splits, max_split, hb, scale, buf, scr, alp, mlr);
}

#define ATT_RED_CHUNK 256
// Thread groups of a reduce block at most: each sums every ATT_RED_GROUPS-th split.
#define ATT_RED_GROUPS 4

// Grid (hq, rows); block ng·dp threads with dp a multiple of 32, at least d, and ng ≤ ATT_RED_GROUPS.
// Merges the splits of attn_paged_partial: o = Σ_s exp(m_s − M)·o_s / Σ_s exp(m_s − M)·l_s (zero when
// nothing was visible; splits with m_s = −inf are skipped, their part_o never read), times
// sigmoid(gate) when gate is non-null (gate and out: [rows, hq·d]), rounded once to bf16. Thread
// (group k, i) sums element i over splits k, k + ng, … (eight loads in flight), the groups' sums then
// added in group order.
extern "C" __global__ void attn_paged_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             const bf16* __restrict__ gate, bf16* __restrict__ out, int hq, int d,
                                             int splits) {
    pdl_prologue();
    __shared__ float w[ATT_RED_CHUNK], wl[ATT_RED_CHUNK];
    __shared__ float scratch[32];
    __shared__ float part[2 * ATT_RED_GROUPS * ATT_MAX_D];
    const int h = blockIdx.x, r = blockIdx.y;
    const int dp = (d + 31) / 32 * 32, ng = min(ATT_RED_GROUPS, (int)blockDim.x / dp);
    if (d > ATT_MAX_D || ng < 1) return;
    const size_t slot0 = ((size_t)r * hq + h) * splits;
    float M = NEG_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) M = fmaxf(M, part_ml[2 * (slot0 + s)]);
    M = block_max(M, scratch);
    const int k = threadIdx.x / dp, i = threadIdx.x - k * dp;
    const bool mine = k < ng && i < d;
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
        // Eight of the group's splits' loads issued before their sums; skipped splits add nothing.
#pragma unroll 1
        for (int s0 = k; s0 < nc; s0 += 8 * ng) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int s = s0 + u * ng;
                v[u] = mine && s < nc && w[s] != 0.0f ? part_o[(slot0 + c0 + s) * d + i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int s = s0 + u * ng;
                if (s >= nc || w[s] == 0.0f) continue;
                den += wl[s];
                num += w[s] * v[u];
            }
        }
        __syncthreads();
    }
    if (mine) {
        part[k * ATT_MAX_D + i] = num;
        part[(ATT_RED_GROUPS + k) * ATT_MAX_D + i] = den;
    }
    __syncthreads();
    if (k == 0 && i < d) {
        float nn = 0.0f, dd = 0.0f;
        for (int g = 0; g < ng; ++g) {
            nn += part[g * ATT_MAX_D + i];
            dd += part[(ATT_RED_GROUPS + g) * ATT_MAX_D + i];
        }
        const size_t at = ((size_t)r * hq + h) * d + i;
        float o = dd > 0.0f ? nn / dd : 0.0f;
        if (gate) o *= sigmoid_f(bf2f(gate[at]));
        out[at] = f2bf(o);
    }
}
