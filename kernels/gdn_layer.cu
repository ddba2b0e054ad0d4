// The entry points of gdn_layer.cuh's persistent launch (what it computes: there).
#include "gdn_layer.cuh"

// Entry points: projections of BITS bits (q|k|v, z and out_proj of one width), GU units of 32 values a
// lane in the h-wide dots (h ≤ 1024 · GU), OU in the out_proj dots (hv · dv ≤ 1024 · OU). Grid:
// blocks_per_sm · multiprocessors blocks of ML_THREADS threads, launched cooperatively.
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p8_u2_o4(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<8>(a)); gdn_layer_m1<8, 2, 4>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p8_u3_o6(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<8>(a)); gdn_layer_m1<8, 3, 6>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p6_u2_o4(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<6>(a)); gdn_layer_m1<6, 2, 4>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p6_u3_o6(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<6>(a)); gdn_layer_m1<6, 3, 6>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p4_u2_o4(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<4>(a)); gdn_layer_m1<4, 2, 4>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) gdn_layer_m1_p4_u3_o6(const GdnLayerArgs a) { pdl_prologue_prefetch(gl_first_rows<4>(a)); gdn_layer_m1<4, 3, 6>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
