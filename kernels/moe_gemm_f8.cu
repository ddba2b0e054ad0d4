// The routed FP8 experts' grouped GEMM on the FP8 tensor cores, for prefill steps (moe_gemm.cu's tiles,
// grid and pipeline; see moe_gemm_f8q_impl).
#include "moe_gemm.cuh"

// ---- FP8 experts on the FP8 tensor cores (sm_89 and later) ----
// moe_gemm_f8q_*: the grouped GEMM of FP8 experts with the input rows quantised as the format's dynamic
// scheme does (quant_f8_tokens: Xq e4m3 bytes [x_rows, k] and Xs [k / 128][x_rows] f32, one scale per row
// and 128 columns), the e4m3 operands multiplied by mma.sync m16n8k32 with f32 accumulation; at the end of
// each 128-column block the partial product is scaled by its weight row's block scale times its input
// row's scale. Tiles, grid (ceil(n / 128), max_tiles), 256 threads and the cp.async pipeline as
// moe_gemm_impl; a stage holds 128 weight rows and 64 input rows of a 64-byte k-chunk (MG_QROW = 80 shared
// bytes a row: the fragments' 32-bit loads, 8 rows by 4 lanes, fall on 32 distinct banks) and the weight
// rows' scales of its chunk: MG_QSTAGES·(128·80 + 64·80 + 512) bytes of dynamic shared memory. Needs
// k % 128 == 0 and one weight scale per row and 128 columns ([n, k / 128]), 16-byte aligned Xq and weights.
// Fragments of m16n8k32 with 8-bit types: a[0] = weight row g, bytes 4t..4t+3 of the k32 step; a[1] = row
// g + 8; a[2], a[3] the same 16 bytes on; b[0] = pair g, bytes 4t..4t+3; b[1] 16 bytes on; accumulators as
// m16n8k16's. Below sm_89 (no FP8 MMA) the kernels trap; the host launches them on sm_89 and later only.
#define MG_QROW 80
#define MG_QSTAGES 4
__device__ __forceinline__ void mg_mma_f8(float c[4], const u32 a[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <typename OUT>
__device__ __forceinline__ void moe_gemm_f8q_impl(const unsigned long long* __restrict__ w_ptrs,
                                                  const unsigned long long* __restrict__ s_ptrs,
                                                  const unsigned char* __restrict__ Xq, const float* __restrict__ Xs,
                                                  int x_rows, int x_div, u32 x_tail, const u32* __restrict__ perm,
                                                  const u32* __restrict__ tiles, OUT* __restrict__ Y, int n, int k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    __shared__ u32 s_pair[MG_TILE], s_xrow[MG_TILE];
    extern __shared__ uint4 mg_dyn[];
    u32 ex;
    const u32 cnt = mg_tile(tiles, perm, x_div, x_tail, s_pair, s_xrow, ex);
    if (cnt == 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * MG_BM;
    const int nch = (int)(cnt + 7) >> 3;  // active 8-pair column blocks
    const int nk = k / MG_KC;             // even: k % 128 == 0
    const int scols = k / 128;
    const unsigned char* W = (const unsigned char*)w_ptrs[ex];
    const float* S = (const float*)s_ptrs[ex];
    const int w_bytes = MG_BM * MG_QROW, x_bytes = MG_TILE * MG_QROW;
    const int stage_bytes = w_bytes + x_bytes + MG_BM * 4;
    unsigned char* smem = (unsigned char*)mg_dyn;
    const u32 smem0 = mg_smem(smem);

    // Queue the copies of k-chunk c (bytes c·64 .. c·64 + 63 of every row) into stage st.
    auto load = [&](int c, int st) {
        const u32 base = smem0 + st * stage_bytes;
        for (int i = tid; i < MG_BM * 4; i += blockDim.x) {
            const int r = i >> 2, pc = i & 3;
            const bool ok = row0 + r < n;
            const unsigned char* src = W + (ok ? (size_t)(row0 + r) * k + (size_t)c * MG_KC + pc * 16 : 0);
            mg_cp16(base + r * MG_QROW + pc * 16, src, ok ? 16 : 0);
        }
        for (int i = tid; i < nch * 8 * 4; i += blockDim.x) {
            const int m = i >> 2, pc = i & 3;
            const bool ok = m < (int)cnt;
            const unsigned char* src = Xq + (size_t)s_xrow[ok ? m : 0] * k + (size_t)c * MG_KC + pc * 16;
            mg_cp16(base + w_bytes + m * MG_QROW + pc * 16, src, ok ? 16 : 0);
        }
        for (int r = tid; r < MG_BM; r += blockDim.x) {
            const bool ok = row0 + r < n;
            const float* src = S + (ok ? (size_t)(row0 + r) * scols + (c >> 1) : 0);
            mg_cp4(base + w_bytes + x_bytes + 4 * r, src, ok ? 4 : 0);
        }
    };

    float acc[8][4], tot[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = tot[j][i] = 0.0f;

#pragma unroll
    for (int st = 0; st < MG_QSTAGES - 1; ++st) {
        if (st < nk) load(st, st);
        mg_commit();
    }
    const int wr = 16 * warp + g;  // the thread's first weight row in the block
#pragma unroll 1
    for (int c = 0; c < nk; ++c) {
        mg_wait<MG_QSTAGES - 2>();
        __syncthreads();
        if (c + MG_QSTAGES - 1 < nk) load(c + MG_QSTAGES - 1, (c + MG_QSTAGES - 1) % MG_QSTAGES);
        mg_commit();
        const unsigned char* ws = smem + (c % MG_QSTAGES) * stage_bytes;
        const unsigned char* xs = ws + w_bytes;
#pragma unroll
        for (int s = 0; s < MG_KC / 32; ++s) {
            const unsigned char* r0 = ws + wr * MG_QROW + 32 * s + 4 * t;
            const unsigned char* r1 = r0 + 8 * MG_QROW;
            const u32 a[4] = {*(const u32*)r0, *(const u32*)r1, *(const u32*)(r0 + 16), *(const u32*)(r1 + 16)};
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j < nch) {
                    const unsigned char* xr = xs + (8 * j + g) * MG_QROW + 32 * s + 4 * t;
                    mg_mma_f8(acc[j], a, *(const u32*)xr, *(const u32*)(xr + 16));
                }
            }
        }
        if (c & 1) {  // the end of 128-column block c / 2: scale and add its partial products
            const float* ss = (const float*)(xs + x_bytes);
            const float w0 = ss[wr], w1 = ss[wr + 8];
            const float* xsc = Xs + (size_t)(c >> 1) * x_rows;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j < nch) {
                    const int m0 = 8 * j + 2 * t, m1 = m0 + 1;
                    const float x0 = m0 < (int)cnt ? xsc[s_xrow[m0]] : 0.0f;
                    const float x1 = m1 < (int)cnt ? xsc[s_xrow[m1]] : 0.0f;
                    tot[j][0] = fmaf(w0 * x0, acc[j][0], tot[j][0]);
                    tot[j][1] = fmaf(w0 * x1, acc[j][1], tot[j][1]);
                    tot[j][2] = fmaf(w1 * x0, acc[j][2], tot[j][2]);
                    tot[j][3] = fmaf(w1 * x1, acc[j][3], tot[j][3]);
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
                }
            }
        }
    }
    mg_store<OUT>(Y, tot, s_pair, cnt, nch, row0 + wr, t, n);
#else
    __trap();
#endif
}

// Entry points moe_gemm_f8q_{bf16 | f32}: moe_gemm_f8's outputs from quantised input rows (see
// moe_gemm_f8q_impl).
#define MOE_GEMM_F8Q_ARGS const unsigned long long* w_ptrs, const unsigned long long* s_ptrs, const unsigned char* Xq, const float* Xs, int x_rows, int x_div, unsigned x_tail, const u32* perm, const u32* tiles
#define MOE_GEMM_F8Q_PASS w_ptrs, s_ptrs, Xq, Xs, x_rows, x_div, x_tail, perm, tiles, Y, n, k
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_f8q_bf16(MOE_GEMM_F8Q_ARGS, bf16* Y, int n, int k) { pdl_prologue(); moe_gemm_f8q_impl<bf16>(MOE_GEMM_F8Q_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_gemm_f8q_f32(MOE_GEMM_F8Q_ARGS, float* Y, int n, int k) { pdl_prologue(); moe_gemm_f8q_impl<float>(MOE_GEMM_F8Q_PASS); }
