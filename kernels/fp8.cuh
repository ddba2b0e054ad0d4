// The e4m3 decoding the FP8 kernels share (fp8.cu, moe_gemm.cu).
//
// Decoding: sm_89 and later convert e4m3 pairs to f16 pairs in hardware (cvt.rn.f16x2.e4m3x2, exact).
// Older chips (sm_86) use that an e4m3 byte S.EEEE.MMM is the f16 S.0EEEE.MMM0000000 times 2^8 (both
// biases and the subnormals line up: code 1 = 2^-9 = f16 2^-17 · 2^8): two masks and shifts a pair, the 2^8
// folded into the scale (an exact product); there the NaN codes (S.1111.111) decode as ±480 (checkpoints
// hold none). Either way the f16 → f32 widening is exact and every weight is exactly fp8(q) · scale as the
// CPU oracle computes it; only summation order differs.
#pragma once
#include "common.cuh"
#include <cuda_fp16.h>

// The e4m3 pair in half `hi` (0: bytes 0, 1; 1: bytes 2, 3) of word w as f32 (first byte in .x), each
// value / F8_UNSCALE: sm_89 and later convert in hardware (the values); older chips place each byte's bits
// in an f16 (value · 2^-8). Exact either way.
__device__ __forceinline__ float2 f8two(u32 w, int hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const unsigned short s = (unsigned short)(hi ? (w >> 16) : (w & 0xffffu));
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(s));
#else
    const u32 t = __byte_perm(w, 0, hi ? 0x4342 : 0x4140);  // b0 | b1 << 16 of the half
    const u32 h = ((t & 0x00800080u) << 8) | ((t & 0x007f007fu) << 7);
#endif
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// The factor the decoding leaves out, applied to the scale (an exact product).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define F8_UNSCALE 1.0f
#else
#define F8_UNSCALE 256.0f
#endif

// The four e4m3 bytes of word w (LSB first) as f32, each value / F8_UNSCALE.
__device__ __forceinline__ void f8x4(u32 w, float q[4]) {
    const float2 lo = f8two(w, 0), hi = f8two(w, 1);
    q[0] = lo.x; q[1] = lo.y; q[2] = hi.x; q[3] = hi.y;
}

// The e4m3 pair in half `hi` of word w as a bf16 pair (low half first), each value / F8_UNSCALE: exact
// (every e4m3 value / F8_UNSCALE is a bf16), an MMA operand.
__device__ __forceinline__ u32 f8_pair_bf16x2(u32 w, int hi) {
    const float2 f = f8two(w, hi);
    return pack_bf16x2(f.x, f.y);
}
