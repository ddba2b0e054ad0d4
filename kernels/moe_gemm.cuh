// What the grouped expert GEMMs share (moe_gemm.cu: bf16 tiles of every weight format; moe_gemm_f8.cu:
// FP8 experts on the FP8 tensor cores): their tile shape and the PTX helpers of their pipelines.
#pragma once
#include "common.cuh"

// Pairs a tile holds, weight rows a block multiplies, k per pipeline stage.
#define MG_TILE 64
#define MG_BM 128
#define MG_KC 64

// ---- PTX helpers (sm_80+) ----
__device__ __forceinline__ u32 mg_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// 16 bytes global -> shared, bypassing L1; src_bytes 0 fills zeros (src must still be a valid address).
__device__ __forceinline__ void mg_cp16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void mg_cp4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void mg_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void mg_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The block's tile (row blockIdx.y of tiles: expert, start in perm, count): its pairs' numbers (s_pair, the
// y rows) and x rows (s_xrow) in shared memory and its expert in ex, for the whole block (every thread calls
// it). Returns the count; 0 (an unused tile) writes nothing and does not synchronise.
__device__ __forceinline__ u32 mg_tile(const u32* __restrict__ tiles, const u32* __restrict__ perm, int x_div,
                                       u32 x_tail, u32* s_pair, u32* s_xrow, u32& ex) {
    const u32 cnt = tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return 0;
    ex = tiles[3 * blockIdx.y];
    const u32 start = tiles[3 * blockIdx.y + 1];
    if (threadIdx.x < cnt) {
        const u32 p = perm[start + threadIdx.x];
        s_pair[threadIdx.x] = p;
        s_xrow[threadIdx.x] = moe_x_row(p, x_div, x_tail);
    }
    __syncthreads();
    return cnt;
}

// Stores a block's accumulators: (j, i) is weight row r + 8·(i / 2) (r = the thread's first row) and pair
// m = 8j + 2t + i % 2 of the tile, whose y row is s_pair[m]; rows from n on and pairs from cnt on are not
// stored.
template <typename OUT>
__device__ __forceinline__ void mg_store(OUT* __restrict__ Y, const float (&tot)[8][4], const u32* s_pair, u32 cnt,
                                         int nch, int r, int t, int n) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (j < nch) {
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
                const int m = 8 * j + 2 * t + e2;
                if (m < (int)cnt) {
                    const size_t yrow = (size_t)s_pair[m] * n;
                    if (r < n) store_out<OUT>(Y, yrow + r, tot[j][e2]);
                    if (r + 8 < n) store_out<OUT>(Y, yrow + r + 8, tot[j][2 + e2]);
                }
            }
        }
    }
}
