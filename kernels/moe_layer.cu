// The entry points of moe_layer.cuh's persistent launch (what it computes: there).
#include "moe_layer.cuh"

// Entry points: routed experts of EB bits (INT4), the shared expert of SB bits (INT4, INT6, INT8), GU
// units of 32 values a lane in the h-wide dots (h ≤ 1024 · GU). Grid: blocks_per_sm · multiprocessors
// blocks of ML_THREADS threads, launched cooperatively; dynamic shared memory 2 · k · inter bytes
// (rounded up to 16).
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s4_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 4, 2>(a, 0, RowSpan{nullptr, 0}); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s6_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 6, 2>(a, 0, RowSpan{nullptr, 0}); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s8_u2(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 8, 2>(a, 0, RowSpan{nullptr, 0}); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s4_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 4, 3>(a, 0, RowSpan{nullptr, 0}); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s6_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 6, 3>(a, 0, RowSpan{nullptr, 0}); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) moe_layer_m1_q4_s8_u3(const MoeLayerArgs a) { pdl_prologue_prefetch(ml_router_span(a)); moe_layer_m1<4, 8, 3>(a, 0, RowSpan{nullptr, 0}); ml_finish(a.sync, a.trace); }
