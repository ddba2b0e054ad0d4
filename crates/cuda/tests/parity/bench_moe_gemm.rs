//! Timing (ignored by default; `--ignored` runs it) of the tensor-core grouped expert GEMM against the
//! grouped GEMV on prefill-sized steps: INT4 (group 128) experts with distinct weights for each of 512
//! experts, top-10 routing, at the Qwen3-Next-80B shape (hidden 2048, intermediate 512) for 64 and 512
//! tokens and the 125B shape (hidden 2560, intermediate 768) for 512 tokens. Prints `BENCH` lines:
//! microseconds per call, TFLOP/s of the pairs' useful products and GB/s of the chosen experts' packed
//! bytes (words and scales) plus the inputs and outputs.

use half::bf16;
use sanmai_cuda::Gpu;

use crate::bench::{pattern, time};
use crate::bench_moe::{experts, E};
use crate::common::{gpu, Rng};
use crate::launch::{expert_proj, packed_scheme, pair_groups, pair_rows};
use crate::moe_gemm::{route, Routing};

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_moe_gemm_prefill() {
    let Some(g) = gpu("bench_moe_gemm_prefill") else {
        return;
    };
    let (e, top_k, group) = (E, 10usize, 128usize);
    let scheme = Some((4u32, group));
    let mut rng = Rng::new(63);
    for (h, i, tokens) in [
        (2048usize, 512usize, &[64usize, 512][..]),
        (2560, 768, &[512][..]),
    ] {
        let gu = experts(g, 4, group, 2 * i, h, 1);
        let dn = experts(g, 4, group, h, i, 2);
        for &t in tokens {
            let n = t * top_k;
            let ids = route(&mut rng, Routing::Uniform, t, top_k, e);
            let mut used = ids.clone();
            used.sort_unstable();
            used.dedup();
            let chosen = used.len();
            let x = g.upload(&pattern(t * h, 5)).unwrap();
            let act = g.upload(&pattern(n * i, 6)).unwrap();
            let di = g.upload(&ids).unwrap();
            let mut perm = g.zeros::<u32>(n).unwrap();
            let mut tiles = g.zeros::<u32>(3 * Gpu::moe_gemm_max_tiles(n, e)).unwrap();
            let mut y_gu = g.zeros::<bf16>(n * 2 * i).unwrap();
            let mut y_dn = g.zeros::<f32>(n * h).unwrap();
            let shape = format!("h{h}_i{i}_e{e}_k{top_k}_t{t}_pairs{n}_experts{chosen}");

            let tp = time(g, 3, 20, || {
                g.moe_gemm_plan(&di, n, e, &mut perm, &mut tiles).unwrap()
            });
            println!("BENCH moe_gemm_plan {shape} time_us={:.1}", tp * 1e6);
            // (name, n, k, expert bytes, x bytes, y bytes)
            let projections = [
                ("gate_up", 2 * i, h, gu.bytes, t * h * 2, n * 2 * i * 2),
                ("down", h, i, dn.bytes, n * i * 2, n * h * 4),
            ];
            let mut gemm_total = tp;
            let mut gemv_total = 0.0;
            for (what, nn, kk, eb, xb, yb) in projections {
                let bytes = chosen * eb + xb + yb;
                let flops = 2.0 * (n * nn * kk) as f64;
                let tg = time(g, 3, 20, || {
                    if what == "gate_up" {
                        g.moe_gemm(
                            &expert_proj(
                                &gu.w_ptrs,
                                &gu.s_ptrs,
                                scheme.and_then(|(bits, group)| packed_scheme(bits, group)),
                                nn,
                                kk,
                            ),
                            &pair_rows(&x, t, top_k),
                            &pair_groups(&perm, &tiles, n),
                            &mut y_gu,
                        )
                        .unwrap()
                    } else {
                        g.moe_gemm(
                            &expert_proj(
                                &dn.w_ptrs,
                                &dn.s_ptrs,
                                scheme.and_then(|(bits, group)| packed_scheme(bits, group)),
                                nn,
                                kk,
                            ),
                            &pair_rows(&act, n, 1),
                            &pair_groups(&perm, &tiles, n),
                            &mut y_dn,
                        )
                        .unwrap()
                    }
                });
                gemm_total += tg;
                println!(
                    "BENCH moe_gemm_q4 {what} {shape} time_us={:.1} TFLOP/s={:.1} GB/s={:.0}",
                    tg * 1e6,
                    flops / tg / 1e12,
                    bytes as f64 / tg / 1e9
                );
                // The grouped GEMV on the same step (its own sort and tiles of 8 pairs).
                let mut sperm = g.zeros::<u32>(n).unwrap();
                let mut stiles = g
                    .zeros::<u32>(3 * sanmai_cuda::moe_max_tiles(n, e))
                    .unwrap();
                g.moe_sort(&di, n, e, &mut sperm, &mut stiles).unwrap();
                let tv = time(g, 1, 3, || {
                    if what == "gate_up" {
                        g.moe_gemv_packed(
                            &expert_proj(&gu.w_ptrs, &gu.s_ptrs, packed_scheme(4, group), nn, kk),
                            &pair_rows(&x, t, top_k),
                            &pair_groups(&sperm, &stiles, n),
                            &mut y_gu,
                        )
                        .unwrap()
                    } else {
                        g.moe_gemv_packed(
                            &expert_proj(&dn.w_ptrs, &dn.s_ptrs, packed_scheme(4, group), nn, kk),
                            &pair_rows(&act, n, 1),
                            &pair_groups(&sperm, &stiles, n),
                            &mut y_dn,
                        )
                        .unwrap()
                    }
                });
                gemv_total += tv;
                println!(
                    "BENCH moe_gemv_q4 {what} {shape} time_us={:.1} TFLOP/s={:.2} GB/s={:.0} gemm_speedup={:.1}x",
                    tv * 1e6,
                    flops / tv / 1e12,
                    bytes as f64 / tv / 1e9,
                    tv / tg
                );
            }
            println!(
                "BENCH moe_gemm_total {shape} plan+gate_up+down_us={:.1} gemv_gate_up+down_us={:.1} speedup={:.1}x",
                gemm_total * 1e6,
                gemv_total * 1e6,
                gemv_total / gemm_total
            );
        }
    }
}
