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
