// The entry points of attn_layer.cuh's persistent launch (what it computes: there).
#include "attn_layer.cuh"

// Entry points: projections of BITS bits (q|gate, k, v and o_proj of one width), 2 units of 32 values
// a lane in the h-wide dots (h ≤ 2048), 4 in the o_proj dots (hq · d ≤ 4096). Grid: blocks_per_sm ·
// multiprocessors blocks of ML_THREADS threads, launched cooperatively; dynamic shared memory
// AL_STAGES · 16 KiB (4 stages from sm_90 on, else 2).
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) attn_layer_m1_p8_u2_o4(const AttnLayerArgs a) { pdl_prologue_prefetch(al_first_rows<8>(a)); attn_layer_m1<8, 2, 4>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) attn_layer_m1_p6_u2_o4(const AttnLayerArgs a) { pdl_prologue_prefetch(al_first_rows<6>(a)); attn_layer_m1<6, 2, 4>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
extern "C" __global__ void __launch_bounds__(ML_THREADS, 2) attn_layer_m1_p4_u2_o4(const AttnLayerArgs a) { pdl_prologue_prefetch(al_first_rows<4>(a)); attn_layer_m1<4, 2, 4>(a, 0, nullptr); ml_finish(a.sync, a.trace); }
