// A MoE layer's one-token decode step and the next layer's mixer in one persistent launch: the phases
// of moe_layer.cuh (the routed and shared experts, the combine, the residual add and the next layer's
// input norm) and then those of gdn_layer.cuh or attn_layer.cuh (the mixer, its residual add and the
// norm after it) in one cooperative grid, where two launches run them one after the other. The mixer stages its
// input row from the residual and the norm's partial sums (ml_stage_normed) as soon as the norm's
// barrier is passed, so the seam costs neither a launch boundary nor a barrier; the MoE step's normed
// row is not written out (its args' normed is null). The arithmetic is the two launches' bit for bit
// (the same bodies; the staged values are ml_norm_rows's). The mixer's first weight rows are asked of L2 before the MoE's
// norm barrier, as the mixer launch's prologue asks for them while the MoE launch drains.
#include "attn_layer.cuh"
#include "gdn_layer.cuh"
#include "moe_layer.cuh"

// The kernels' arguments (`PairArgs` in crates/cuda/src/ops/layer_pair.rs): the two launches' argument
// structs. Both halves name the same partials and sync buffers.
struct MoeGdnArgs {
    MoeLayerArgs m;
    GdnLayerArgs g;
};
struct MoeAttnArgs {
    MoeLayerArgs m;
    AttnLayerArgs t;
};

// The MoE step's norm as the mixer's input.
__device__ __forceinline__ MlNormIn lp_norm_in(const MoeLayerArgs& m) {
    return MlNormIn{m.acc, m.norm_w, m.partials, m.eps, m.offset};
}

// The MoE step as a function of its own: inlined, the two bodies need more than the 128
// registers two blocks a multiprocessor leave and spill (ptxas); called, each fits (its arguments read
// through a pointer to the launch's parameters: __grid_constant__).
template <int SB, int GU>
__device__ __noinline__ void lp_moe(const MoeLayerArgs& m, RowSpan next) {
    moe_layer_m1<4, SB, GU>(m, 0, next);
}

// MoE barriers 1–3, the mixer's 4–6 (GDN) or 4–7 (attention).
template <int SB, int PB, int GU, int OU>
__device__ __forceinline__ void moe_gdn_m1(const MoeGdnArgs& a) {
    lp_moe<SB, GU>(a.m, gl_first_rows<PB>(a.g));
    const MlNormIn in = lp_norm_in(a.m);
    gdn_layer_m1<PB, GU, OU>(a.g, 3, &in);
    ml_finish(a.m.sync, nullptr);
}

// Inlined: the two bodies fit the registers without spilling (ptxas).
template <int SB, int PB>
__device__ __forceinline__ void moe_attn_m1(const MoeAttnArgs& a) {
    moe_layer_m1<4, SB, 2>(a.m, 0, al_first_rows<PB>(a.t));
    const MlNormIn in = lp_norm_in(a.m);
    attn_layer_m1<PB, 2, 4>(a.t, 3, &in);
    ml_finish(a.m.sync, nullptr);
}

// Entry points: INT4 routed experts, the shared expert of SB bits, the mixer's projections of PB bits (8:
// the served mixes' dense width; other widths take the two launches), GU and OU as in gdn_layer.cu and
// attn_layer.cu. Grid: as those launches (blocks_per_sm · multiprocessors, cooperative); dynamic shared
// memory the larger of the two halves' (they use it in turn).
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_gdn_m1_s4_p8_u2_o4(const __grid_constant__ MoeGdnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_gdn_m1<4, 8, 2, 4>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_gdn_m1_s6_p8_u2_o4(const __grid_constant__ MoeGdnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_gdn_m1<6, 8, 2, 4>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_gdn_m1_s8_p8_u2_o4(const __grid_constant__ MoeGdnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_gdn_m1<8, 8, 2, 4>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_gdn_m1_s4_p8_u3_o6(const __grid_constant__ MoeGdnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_gdn_m1<4, 8, 3, 6>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_gdn_m1_s6_p8_u3_o6(const __grid_constant__ MoeGdnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_gdn_m1<6, 8, 3, 6>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_gdn_m1_s8_p8_u3_o6(const __grid_constant__ MoeGdnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_gdn_m1<8, 8, 3, 6>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_attn_m1_s4_p8_u2_o4(const MoeAttnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_attn_m1<4, 8>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_attn_m1_s6_p8_u2_o4(const MoeAttnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_attn_m1<6, 8>(a); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_attn_m1_s8_p8_u2_o4(const MoeAttnArgs a) { pdl_prologue_prefetch(ml_router_span(a.m)); moe_attn_m1<8, 8>(a); }
