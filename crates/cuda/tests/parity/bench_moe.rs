//! Timing (ignored by default; `--ignored` runs it) of the MoE decode path: router top-k, sort, grouped
//! expert GEMVs, combine, and the one-launch routing against the launches it replaces, at the shapes
//! of a full-size decode step (512 experts, top 10; Qwen3-Next-80B: hidden 2048, intermediate 512;
//! qwen4-exp-125b: hidden 2560, intermediate 768), batch 1 and 8.
//! Prints `BENCH` lines: microseconds per call and GB/s of the bytes the kernel must move (for the
//! grouped GEMV: the chosen experts' weights, words and scales, plus its inputs and outputs).
//!
//! Every expert has its own weights, and the GEMV calls cycle through several routings, so that a
//! call does not find the previous call's experts in L2 (as in a real step, where the other layers'
//! weights pass through L2 between two MoE layers).

use half::bf16;
use sanmai_cuda::cudarc::driver::{CudaSlice, DevicePtr};
use sanmai_cuda::{CombineInto, DecodeRouting, Gpu, NormRows, RouteDims, Routed};

use crate::bench::{pattern, time};
use crate::common::{gpu, Rng};
use crate::launch::{expert_proj, packed_scheme, pair_groups, pair_rows};
use crate::moe_gemm::{route, Routing};

pub const E: usize = 512;
const TOP_K: usize = 10;
/// Routings the GEMV calls cycle through.
const ROUTINGS: usize = 8;

/// One projection's `E` experts (`n` rows of `k`) in one allocation of words and one of scales, and
/// their address tables. `bits` 16 is bf16 (finite values in (-2, 2), no scales), else packed.
pub struct ExpertSet {
    _words: CudaSlice<u32>,
    _scales: CudaSlice<f32>,
    pub w_ptrs: CudaSlice<u64>,
    pub s_ptrs: CudaSlice<u64>,
    /// Bytes (words and scales) of one expert.
    pub bytes: usize,
}

pub fn experts(g: &Gpu, bits: u32, group: usize, n: usize, k: usize, salt: u32) -> ExpertSet {
    let wpr = match bits {
        16 => k / 2,
        6 => k.div_ceil(32) * 6,
        b => k / (32 / b as usize),
    };
    let sc = match (bits, group) {
        (16, _) => 0,
        (_, 0) => 1,
        _ => k.div_ceil(group),
    };
    // bf16 pairs with the exponent's top bit clear: finite values.
    let mask = if bits == 16 { 0xbfff_bfffu32 } else { !0 };
    let words: Vec<u32> = (0..E * n * wpr)
        .map(|i| ((i as u32 ^ salt).wrapping_mul(2_654_435_761)) & mask)
        .collect();
    let scales: Vec<f32> = pattern((E * n * sc).max(1), salt)
        .iter()
        .map(|v| 1e-3 * (1.0 + v.to_f32()))
        .collect();
    let (dw, ds) = (g.upload(&words).unwrap(), g.upload(&scales).unwrap());
    let s = g.stream();
    let (w0, s0) = (dw.device_ptr(s).0, ds.device_ptr(s).0);
    let wp: Vec<u64> = (0..E).map(|x| w0 + (x * n * wpr * 4) as u64).collect();
    let sp: Vec<u64> = (0..E).map(|x| s0 + (x * n * sc * 4) as u64).collect();
    ExpertSet {
        w_ptrs: g.upload(&wp).unwrap(),
        s_ptrs: g.upload(&sp).unwrap(),
        _words: dw,
        _scales: ds,
        bytes: n * wpr * 4 + n * sc * 4,
    }
}

/// One step's routing on the device: ids, the sort's perm and tiles, and its count of distinct experts.
struct Step {
    ids: CudaSlice<u32>,
    perm: CudaSlice<u32>,
    tiles: CudaSlice<u32>,
    chosen: usize,
}

fn steps(g: &Gpu, rng: &mut Rng, t: usize) -> Vec<Step> {
    let n = t * TOP_K;
    (0..ROUTINGS)
        .map(|_| {
            let ids = route(rng, Routing::Uniform, t, TOP_K, E);
            let mut used = ids.clone();
            used.sort_unstable();
            used.dedup();
            let di = g.upload(&ids).unwrap();
            let mut perm = g.zeros::<u32>(n).unwrap();
            let mut tiles = g
                .zeros::<u32>(3 * sanmai_cuda::moe_max_tiles(n, E))
                .unwrap();
            g.moe_sort(&di, n, E, &mut perm, &mut tiles).unwrap();
            Step {
                ids: di,
                perm,
                tiles,
                chosen: used.len(),
            }
        })
        .collect()
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_moe_decode() {
    let Some(g) = gpu("bench_moe_decode") else {
        return;
    };
    let mut rng = Rng::new(64);

    // Router: softmax + top 10 of 512 + renormalise, one block per token (sort and merge).
    for t in [1usize, 8] {
        let logits = g.upload(&rng.normals(t * E, 0.0, 2.0)).unwrap();
        let mut ids = g.zeros::<u32>(t * TOP_K).unwrap();
        let mut w = g.zeros::<f32>(t * TOP_K).unwrap();
        let tr = time(g, 5, 200, || {
            g.route_topk(
                &logits,
                RouteDims {
                    tokens: t,
                    experts: E,
                    top_k: TOP_K,
                    renormalize: true,
                },
                &mut ids,
                &mut w,
            )
            .unwrap()
        });
        let bytes = t * E * 4 + t * TOP_K * 8;
        println!(
            "BENCH router_topk t={t} e={E} k={TOP_K} bytes={bytes} time_us={:.2} GB/s={:.1}",
            tr * 1e6,
            bytes as f64 / tr / 1e9
        );
    }

    // Sort: counts, a block-wide scan over the experts, tile slots, scatter.
    for t in [1usize, 8, 64] {
        let n = t * TOP_K;
        let st = steps(g, &mut rng, t);
        let max_tiles = sanmai_cuda::moe_max_tiles(n, E);
        let (mut perm, mut tiles) = (
            g.zeros::<u32>(n).unwrap(),
            g.zeros::<u32>(3 * max_tiles).unwrap(),
        );
        let ts = time(g, 5, 200, || {
            g.moe_sort(&st[0].ids, n, E, &mut perm, &mut tiles).unwrap()
        });
        let bytes = n * 8 + max_tiles * 12;
        println!(
            "BENCH moe_sort t={t} pairs={n} e={E} bytes={bytes} time_us={:.2} GB/s={:.1}",
            ts * 1e6,
            bytes as f64 / ts / 1e9
        );
    }

    // Combine: each token's 10 f32 expert rows times their weights, to bf16; then the residual add
    // and the next norm in a launch of their own, against both in the combine's launch.
    for (h, t) in [(2048usize, 1usize), (2560, 1), (2048, 8)] {
        let n = t * TOP_K;
        let y = g.upload(&rng.normals(n * h, 0.0, 1.0)).unwrap();
        let w = g.upload(&rng.normals(n, 0.1, 0.01)).unwrap();
        let ids = g
            .upload(&route(&mut rng, Routing::Uniform, t, TOP_K, E))
            .unwrap();
        let routed = Routed {
            ids: &ids,
            weights: &w,
            experts: E,
            top_k: TOP_K,
            tokens: t,
        };
        let mut out = g.zeros::<bf16>(t * h).unwrap();
        let mut acc = g.zeros::<bf16>(t * h).unwrap();
        let mut normed = g.zeros::<bf16>(t * h).unwrap();
        let nw = g.zeros::<bf16>(h).unwrap();
        let rows = NormRows {
            rows: t,
            d: h,
            eps: 1e-6,
        };
        let tc = time(g, 5, 200, || {
            g.moe_combine(&routed, &y, None, CombineInto::Rows(&mut out), h)
                .unwrap()
        });
        let tn = time(g, 5, 200, || {
            g.moe_combine(&routed, &y, None, CombineInto::Rows(&mut out), h)
                .unwrap();
            g.add_rms_norm(&mut acc, &out, &nw, &mut normed, rows, 1.0)
                .unwrap()
        });
        let tf = time(g, 5, 200, || {
            let into = CombineInto::AddNorm {
                acc: &mut acc,
                w: &nw,
                normed: &mut normed,
                eps: 1e-6,
                offset: 1.0,
            };
            g.moe_combine(&routed, &y, None, into, h).unwrap()
        });
        let bytes = n * h * 4 + t * h * 2 + n * 8;
        println!(
            "BENCH moe_combine t={t} k={TOP_K} h={h} bytes={bytes} time_us={:.2} GB/s={:.0} \
             then_add_rms_norm_us={:.2} fused_add_rms_norm_us={:.2}",
            tc * 1e6,
            bytes as f64 / tc / 1e9,
            tn * 1e6,
            tf * 1e6
        );
    }

    // Grouped GEMVs: gate|up (bf16 out, token rows) and down (f32 out, pair rows); INT4 g128 runs on
    // tensor cores (moe_gemv_q4_mma_*), and its down projection also with SwiGLU fused.
    // (label, bits (16 = bf16), group, hidden, intermediate)
    let formats = [
        ("q4_g128", 4u32, 128usize, 2048usize, 512usize),
        ("q8_ch", 8, 0, 2048, 512),
        ("q6_ch", 6, 0, 2048, 512),
        ("bf16", 16, 0, 2048, 512),
        ("q4_g128", 4, 128, 2560, 768),
    ];
    for (label, bits, group, h, i) in formats {
        let gu = experts(g, bits, group, 2 * i, h, 1);
        let dn = experts(g, bits, group, h, i, 2);
        // Batch 1, 2, 4, 8: where the fused SwiGLU stops paying (SWIGLU_FUSED_MAX_PAIRS).
        for t in [1usize, 2, 4, 8] {
            let n = t * TOP_K;
            let st = steps(g, &mut rng, t);
            let chosen = st.iter().map(|s| s.chosen).sum::<usize>() as f64 / ROUTINGS as f64;
            let x = g.upload(&pattern(t * h, 5)).unwrap();
            let act = g.upload(&pattern(n * i, 6)).unwrap();
            let mut y_gu = g.zeros::<bf16>(n * 2 * i).unwrap();
            let mut y_dn = g.zeros::<f32>(n * h).unwrap();
            let shape = format!("{label} h={h} i={i} e={E} k={TOP_K} t={t} pairs={n}");
            // (what, n, k, expert bytes, x bytes, y bytes)
            let projections = [
                ("gate_up", 2 * i, h, gu.bytes, t * h * 2, n * 2 * i * 2),
                ("down", h, i, dn.bytes, n * i * 2, n * h * 4),
            ];
            let mut total = 0.0;
            for (what, nn, kk, eb, xb, yb) in projections {
                let mut call = 0usize;
                let tv = time(g, ROUTINGS, 25 * ROUTINGS, || {
                    let s = &st[call % ROUTINGS];
                    call += 1;
                    match (bits, what) {
                        (16, "gate_up") => g
                            .moe_gemv(
                                &expert_proj(&gu.w_ptrs, &gu.w_ptrs, None, nn, kk),
                                &pair_rows(&x, t, TOP_K),
                                &pair_groups(&s.perm, &s.tiles, n),
                                &mut y_gu,
                            )
                            .unwrap(),
                        (16, _) => g
                            .moe_gemv(
                                &expert_proj(&dn.w_ptrs, &dn.w_ptrs, None, nn, kk),
                                &pair_rows(&act, n, 1),
                                &pair_groups(&s.perm, &s.tiles, n),
                                &mut y_dn,
                            )
                            .unwrap(),
                        (_, "gate_up") => g
                            .moe_gemv_packed(
                                &expert_proj(
                                    &gu.w_ptrs,
                                    &gu.s_ptrs,
                                    packed_scheme(bits, group),
                                    nn,
                                    kk,
                                ),
                                &pair_rows(&x, t, TOP_K),
                                &pair_groups(&s.perm, &s.tiles, n),
                                &mut y_gu,
                            )
                            .unwrap(),
                        _ => g
                            .moe_gemv_packed(
                                &expert_proj(
                                    &dn.w_ptrs,
                                    &dn.s_ptrs,
                                    packed_scheme(bits, group),
                                    nn,
                                    kk,
                                ),
                                &pair_rows(&act, n, 1),
                                &pair_groups(&s.perm, &s.tiles, n),
                                &mut y_dn,
                            )
                            .unwrap(),
                    }
                });
                total += tv;
                let bytes = chosen * eb as f64 + (xb + yb) as f64;
                let out = if what == "gate_up" { "bf16" } else { "f32" };
                println!(
                    "BENCH moe_gemv {what} {shape} n={nn} k={kk} out={out} experts={chosen:.1} bytes={bytes:.0} time_us={:.2} GB/s={:.0}",
                    tv * 1e6,
                    bytes / tv / 1e9
                );
            }
            println!(
                "BENCH moe_gemv gate_up+down {shape} time_us={:.2}",
                total * 1e6
            );
            // The decode step's down projection with SwiGLU fused into its input (reads the gate|up
            // rows; replaces the swiglu launch plus the down GEMV).
            if bits != 16 && Gpu::moe_gemv_fuses_swiglu(bits, group, i) {
                let down = expert_proj(&dn.w_ptrs, &dn.s_ptrs, packed_scheme(bits, group), h, i);
                let mut act_s = g.zeros::<bf16>(n * i).unwrap();
                // `fused`: the kernel staging silu(g) · u itself; else what it replaces, the swiglu
                // launch, then the down GEMV on its output.
                let mut timed = |fused: bool| {
                    let mut call = 0usize;
                    time(g, ROUTINGS, 25 * ROUTINGS, || {
                        let s = &st[call % ROUTINGS];
                        call += 1;
                        let groups = pair_groups(&s.perm, &s.tiles, n);
                        if fused {
                            g.moe_gemv_packed_swiglu(
                                &down,
                                &pair_rows(&y_gu, n, 1),
                                &groups,
                                &mut y_dn,
                            )
                        } else {
                            g.swiglu(&y_gu, &mut act_s, n, i).unwrap();
                            g.moe_gemv_packed(&down, &pair_rows(&act_s, n, 1), &groups, &mut y_dn)
                        }
                        .unwrap()
                    })
                };
                let (tv, tu) = (timed(true), timed(false));
                let bytes = chosen * dn.bytes as f64 + (n * 2 * i * 2 + n * h * 4) as f64;
                println!(
                    "BENCH moe_gemv down_swiglu {shape} n={h} k={i} out=f32 experts={chosen:.1} bytes={bytes:.0} time_us={:.2} GB/s={:.0} swiglu_then_down_us={:.2}",
                    tv * 1e6,
                    bytes / tv / 1e9,
                    tu * 1e6
                );
            }
        }
    }
}

/// Router copies the routing benches cycle through (2 MB each at the 80B's shape: 96 MB, more than
/// L2, as the 48 layers' routers are in a real step).
const ROUTERS: usize = 48;

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_moe_route_decode() {
    let Some(g) = gpu("bench_moe_route_decode") else {
        return;
    };
    // A decode step's routing at Qwen3-Next-80B-A3B's shape (hidden 2048, 512 experts, top 10) and
    // qwen4-exp-125b-a6b's (hidden 2560): the two-launch path (router GEMV, the ids' memset, top-k,
    // sort: four graph nodes) against the fused launch.
    for (h, t) in [(2048usize, 1usize), (2560, 1)] {
        let n = t * TOP_K;
        let max_tiles = sanmai_cuda::moe_max_tiles(n, E);
        let routers: Vec<CudaSlice<bf16>> = (0..ROUTERS)
            .map(|i| g.upload(&pattern(E * h, 7 + i as u32)).unwrap())
            .collect();
        let x = g.upload(&pattern(t * h, 5)).unwrap();
        let mut logits = g.zeros::<f32>(t * E).unwrap();
        let mut ids = g.zeros::<u32>(n).unwrap();
        let mut w = g.zeros::<f32>(n).unwrap();
        let mut perm = g.zeros::<u32>(n).unwrap();
        let mut tiles = g.zeros::<u32>(3 * max_tiles).unwrap();
        let mut ticket = g.zeros::<u32>(1).unwrap();
        let mut call = 0usize;
        let t_old = time(g, ROUTERS, 10 * ROUTERS, || {
            let r = &routers[call % ROUTERS];
            call += 1;
            g.gemv_bf16_f32(r, &x, &mut logits, t, E, h).unwrap();
            g.stream().memset_zeros(&mut ids).unwrap();
            g.route_topk(
                &logits,
                RouteDims {
                    tokens: t,
                    experts: E,
                    top_k: TOP_K,
                    renormalize: true,
                },
                &mut ids,
                &mut w,
            )
            .unwrap();
            g.moe_sort(&ids, n, E, &mut perm, &mut tiles).unwrap();
        });
        let mut call = 0usize;
        let t_fused = time(g, ROUTERS, 10 * ROUTERS, || {
            let r = &routers[call % ROUTERS];
            call += 1;
            g.moe_route_decode(
                r,
                &x,
                h,
                RouteDims {
                    tokens: t,
                    experts: E,
                    top_k: TOP_K,
                    renormalize: true,
                },
                DecodeRouting {
                    logits: &mut logits,
                    ids: &mut ids,
                    weights: &mut w,
                    perm: &mut perm,
                    tiles: &mut tiles,
                },
                &mut ticket,
            )
            .unwrap();
        });
        let bytes = E * h * 2 + t * h * 2;
        println!(
            "BENCH moe_route t={t} h={h} e={E} k={TOP_K} bytes={bytes} two_launch_us={:.2} fused_us={:.2} fused_GB/s={:.0} speedup={:.2}",
            t_old * 1e6,
            t_fused * 1e6,
            bytes as f64 / t_fused / 1e9,
            t_old / t_fused
        );
    }
}
