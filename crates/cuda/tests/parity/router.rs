//! The MoE router (softmax, top-k, renormalise) against `sanmai_cpu::ops::route_topk`, and the fused
//! decode routing (router GEMV, top-k and grouping by expert in one launch) against the CPU oracle and
//! the two-launch path.

use sanmai_cpu::ops;
use sanmai_cuda::{DecodeRouting, RouteDims};

use crate::common::{check_f32, gpu, to_bf16, Rng};
use crate::moe::check_grouping;

/// Softmax of one row as the CPU oracle computes it.
fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
    row.iter().map(|&x| (x - max).exp() / sum).collect()
}

#[test]
fn router_topk_matches_cpu() {
    let Some(g) = gpu("router_topk_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(20);
    // (tokens, experts, k, renormalise, logits rounded to bf16 so that exact ties occur). Up to 1024
    // experts and k ≤ 16 one block sorts a token's experts (1 to 32 warps); larger k up to 1024
    // experts one warp routes a token (8, 16 or 32 values a lane); beyond, one block per token with
    // k arg-max rounds. 512 experts top 10 at batch 1 and 8 is the decode shape of both target models.
    for &(t, e, k, renorm, rounded) in &[
        (16, 512, 10, true, false),
        (16, 512, 10, true, true),
        (8, 64, 8, false, false),
        (33, 128, 8, true, true),
        (4, 8, 8, true, false),
        (3, 1000, 1, false, false),
        (1, 512, 10, true, false),
        (8, 512, 10, true, false),
        (8, 512, 10, true, true),
        (5, 256, 10, true, true),
        (6, 1024, 10, true, false),
        (7, 200, 40, true, true),
        (2, 64, 64, true, false),
        (3, 2000, 10, true, false),
        (3, 3000, 6, false, true),
        (300, 512, 10, true, false),
        (4, 300, 16, true, true),
        (5, 33, 3, false, false),
        (3, 32, 16, true, true),
        (2, 1024, 16, false, true),
        (4, 512, 20, true, true),
        (3, 1024, 17, false, false),
    ] {
        let mut logits = rng.normals(t * e, 0.0, if rounded { 0.5 } else { 2.0 });
        if rounded {
            // Coarse logits: many exact ties, decided by the lower expert id on both sides.
            logits
                .iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        let mut want_ids = vec![0u32; t * k];
        let mut want_w = vec![0f32; t * k];
        ops::route_topk(&logits, t, e, k, renorm, &mut want_ids, &mut want_w);
        let lg = g.upload(&logits).unwrap();
        let mut ids = g.zeros::<u32>(t * k).unwrap();
        let mut w = g.zeros::<f32>(t * k).unwrap();
        g.route_topk(
            &lg,
            RouteDims {
                tokens: t,
                experts: e,
                top_k: k,
                renormalize: renorm,
            },
            &mut ids,
            &mut w,
        )
        .unwrap();
        let got_ids = g.download(&ids).unwrap();
        let got_w = g.download(&w).unwrap();
        let mut near_ties = 0;
        for tok in 0..t {
            let p = softmax(&logits[tok * e..(tok + 1) * e]);
            for r in 0..k {
                let (a, b) = (
                    got_ids[tok * k + r] as usize,
                    want_ids[tok * k + r] as usize,
                );
                if a != b {
                    let rel = (p[a] - p[b]).abs() / p[a].max(p[b]);
                    assert!(
                        rel <= 1e-6,
                        "token {tok} rank {r}: gpu expert {a} (p {}) vs cpu {b} (p {})",
                        p[a],
                        p[b]
                    );
                    near_ties += 1;
                }
            }
        }
        let shape = format!("t{t}_e{e}_k{k}_renorm{renorm}_bf16logits{rounded}");
        println!("PARITY op=router_ids shape={shape} near_tie_swaps={near_ties}");
        check_f32("router_weights", &shape, &got_w, &want_w);
    }
}

#[test]
fn router_rejects_bad_k() {
    let Some(g) = gpu("router_rejects_bad_k") else {
        return;
    };
    let lg = g.zeros::<f32>(4 * 8).unwrap();
    let mut ids = g.zeros::<u32>(4 * 100).unwrap();
    let mut w = g.zeros::<f32>(4 * 100).unwrap();
    assert!(g
        .route_topk(
            &lg,
            RouteDims {
                tokens: 4,
                experts: 8,
                top_k: 9,
                renormalize: true
            },
            &mut ids,
            &mut w
        )
        .is_err());
    assert!(g
        .route_topk(
            &lg,
            RouteDims {
                tokens: 4,
                experts: 8,
                top_k: 0,
                renormalize: true
            },
            &mut ids,
            &mut w
        )
        .is_err());
    assert!(g
        .route_topk(
            &lg,
            RouteDims {
                tokens: 5,
                experts: 8,
                top_k: 2,
                renormalize: true
            },
            &mut ids,
            &mut w
        )
        .is_err());
}

/// The inputs of one launch of the fused decode routing.
#[derive(Clone, Copy, Debug)]
enum Inputs {
    /// x and the router random: logits about N(0, 1).
    Random,
    /// Every odd expert's router row equals the row before it: exact logit ties in every path, which
    /// the lower id must win.
    DuplicateRows,
    /// Token 0 is all zeros: every one of its logits is 0, so its top k are experts 0..k.
    ZeroToken,
}

/// A decode step's routing shape: tokens, hidden size, experts, top k, renormalisation.
#[derive(Clone, Copy)]
struct RouteShape {
    t: usize,
    h: usize,
    e: usize,
    k: usize,
    renorm: bool,
}

/// The ids of `got` against `want` (`[t, k]`): where they differ, the two experts' `logits` must lie
/// within `tol[token]` of each other (a near-tie). Returns how many ranks differ.
fn near_tie_swaps(
    what: &str,
    got: &[u32],
    want: &[u32],
    logits: &[f32],
    tol: &[f32],
    s: RouteShape,
) -> usize {
    let mut swaps = 0;
    for tok in 0..s.t {
        for r in 0..s.k {
            let (a, b) = (got[tok * s.k + r] as usize, want[tok * s.k + r] as usize);
            if a != b {
                let (la, lb) = (logits[tok * s.e + a], logits[tok * s.e + b]);
                assert!(
                    (la - lb).abs() <= tol[tok],
                    "{what}: token {tok} rank {r}: expert {a} (logit {la}) vs {b} (logit {lb}), \
                     more than the near-tie bound {}",
                    tol[tok]
                );
                swaps += 1;
            }
        }
    }
    swaps
}

/// Per token, the logit distance within which two experts may swap between two computations of the
/// logits `a` and `b` (`[t, e]`): an expert can only overtake another whose logit is within twice the
/// largest difference between `a` and `b`, plus 1e-6 for the rounding of the probabilities.
fn near_tie_bound(a: &[f32], b: &[f32], e: usize) -> Vec<f32> {
    a.chunks_exact(e)
        .zip(b.chunks_exact(e))
        .map(|(x, y)| {
            let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            2.0 * d + 1e-6
        })
        .collect()
}

/// The pairs of `ids` (all `< e`) grouped by expert, each expert's pairs in ascending order.
fn stable_grouping(ids: &[u32]) -> Vec<u32> {
    let mut perm: Vec<u32> = (0..ids.len() as u32).collect();
    perm.sort_by_key(|&p| (ids[p as usize], p));
    perm
}

/// The exact ties of `inputs` in the ids `got` (`[t, k]`): a zero token takes experts 0..k in order;
/// with duplicated rows an odd expert is only ever chosen right after its even twin.
fn check_exact_ties(got: &[u32], inputs: Inputs, s: RouteShape) {
    for (tok, row) in got.chunks_exact(s.k).enumerate() {
        match inputs {
            Inputs::ZeroToken if tok == 0 => {
                assert_eq!(row, (0..s.k as u32).collect::<Vec<_>>(), "zero token");
            }
            Inputs::DuplicateRows => {
                for (r, &x) in row.iter().enumerate() {
                    if x % 2 == 1 {
                        assert!(
                            r > 0 && row[r - 1] == x - 1,
                            "token {tok}: expert {x} at rank {r} without its twin {} before it: {row:?}",
                            x - 1
                        );
                    }
                }
            }
            _ => {}
        }
    }
}

/// One launch of `moe_route_decode` (through `ticket`) on fresh inputs, against the CPU oracle
/// (logits by `matmul_t`, then `route_topk`), the two-launch kernels on its own logits (exact) and
/// the two-launch path from the same inputs (router GEMV, `route_topk`, `moe_sort`).
fn route_decode_case(
    g: &sanmai_cuda::Gpu,
    rng: &mut Rng,
    ticket: &mut sanmai_cuda::cudarc::driver::CudaSlice<u32>,
    s: RouteShape,
    inputs: Inputs,
    shape: &str,
) {
    let RouteShape { t, h, e, k, renorm } = s;
    let n = t * k;
    let mut xs = rng.normals(t * h, 0.0, 1.0);
    let mut rs = rng.normals(e * h, 0.0, (h as f32).powf(-0.5));
    match inputs {
        Inputs::Random => {}
        Inputs::DuplicateRows => {
            for j in (1..e).step_by(2) {
                rs.copy_within((j - 1) * h..j * h, j * h);
            }
        }
        Inputs::ZeroToken => xs[..h].fill(0.0),
    }
    let (xb, xf) = to_bf16(&xs);
    let (rb, rf) = to_bf16(&rs);
    let mut want_logits = vec![0f32; t * e];
    ops::matmul_t(&xf, &rf, t, h, e, &mut want_logits);
    let mut want_ids = vec![0u32; n];
    let mut want_w = vec![0f32; n];
    ops::route_topk(&want_logits, t, e, k, renorm, &mut want_ids, &mut want_w);

    let (x, r) = (g.upload(&xb).unwrap(), g.upload(&rb).unwrap());
    let max_tiles = sanmai_cuda::moe_max_tiles(n, e);
    let mut logits = g.zeros::<f32>(t * e).unwrap();
    let (mut ids, mut w) = (g.zeros::<u32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
    let mut perm = g.zeros::<u32>(n).unwrap();
    let mut tiles = g.zeros::<u32>(3 * max_tiles).unwrap();
    g.moe_route_decode(
        &r,
        &x,
        h,
        RouteDims {
            tokens: t,
            experts: e,
            top_k: k,
            renormalize: renorm,
        },
        DecodeRouting {
            logits: &mut logits,
            ids: &mut ids,
            weights: &mut w,
            perm: &mut perm,
            tiles: &mut tiles,
        },
        ticket,
    )
    .unwrap();
    let got_logits = g.download(&logits).unwrap();
    let got_ids = g.download(&ids).unwrap();
    let got_w = g.download(&w).unwrap();
    let got_perm = g.download(&perm).unwrap();
    let got_tiles = g.download(&tiles).unwrap();

    // The router GEMV against the CPU linear.
    check_f32("moe_route_logits", shape, &got_logits, &want_logits);

    // Top-k and grouping are exact: the two-launch kernels on the fused launch's own logits give the
    // same ids, the same weights bit for bit and the same tiles; the fused perm keeps each expert's
    // pairs in ascending order.
    let (mut ids2, mut w2) = (g.zeros::<u32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
    g.route_topk(
        &logits,
        RouteDims {
            tokens: t,
            experts: e,
            top_k: k,
            renormalize: renorm,
        },
        &mut ids2,
        &mut w2,
    )
    .unwrap();
    assert_eq!(got_ids, g.download(&ids2).unwrap(), "{shape}: top-k ids");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&got_w),
        bits(&g.download(&w2).unwrap()),
        "{shape}: top-k weights"
    );
    let (mut perm2, mut tiles2) = (
        g.zeros::<u32>(n).unwrap(),
        g.zeros::<u32>(3 * max_tiles).unwrap(),
    );
    g.moe_sort(&ids, n, e, &mut perm2, &mut tiles2).unwrap();
    assert_eq!(got_tiles, g.download(&tiles2).unwrap(), "{shape}: tiles");
    check_grouping(&got_ids, e, &got_perm, &got_tiles);
    check_grouping(&got_ids, e, &g.download(&perm2).unwrap(), &got_tiles);
    assert_eq!(got_perm, stable_grouping(&got_ids), "{shape}: perm order");
    check_exact_ties(&got_ids, inputs, s);
    println!("PARITY op=moe_route_exact shape={shape} topk_bits_equal=true tiles_equal=true");

    // Against the CPU oracle: ids equal up to near-ties of the logits' summation order.
    let tol = near_tie_bound(&got_logits, &want_logits, e);
    let swaps = near_tie_swaps("cpu", &got_ids, &want_ids, &want_logits, &tol, s);
    println!("PARITY op=moe_route_ids shape={shape} near_tie_swaps={swaps}");
    check_f32("moe_route_weights", shape, &got_w, &want_w);

    // Against the two-launch path (router GEMV, top-k, sort) from the same inputs.
    let mut old_logits = g.zeros::<f32>(t * e).unwrap();
    g.gemv_bf16_f32(&r, &x, &mut old_logits, t, e, h).unwrap();
    let (mut old_ids, mut old_w) = (g.zeros::<u32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
    g.route_topk(
        &old_logits,
        RouteDims {
            tokens: t,
            experts: e,
            top_k: k,
            renormalize: renorm,
        },
        &mut old_ids,
        &mut old_w,
    )
    .unwrap();
    let (mut old_perm, mut old_tiles) = (
        g.zeros::<u32>(n).unwrap(),
        g.zeros::<u32>(3 * max_tiles).unwrap(),
    );
    g.moe_sort(&old_ids, n, e, &mut old_perm, &mut old_tiles)
        .unwrap();
    let old_logits = g.download(&old_logits).unwrap();
    let old_ids = g.download(&old_ids).unwrap();
    let tol = near_tie_bound(&got_logits, &old_logits, e);
    let swaps = near_tie_swaps("two-launch", &got_ids, &old_ids, &old_logits, &tol, s);
    check_f32(
        "moe_route_vs_two_launch_weights",
        shape,
        &got_w,
        &g.download(&old_w).unwrap(),
    );
    // At batch 1 both GEMVs usually cut a row alike (one 256-thread slot a row): the same logits.
    let same_logits = bits(&got_logits) == bits(&old_logits);
    let same_tiles = swaps == 0;
    if same_tiles {
        assert_eq!(
            got_tiles,
            g.download(&old_tiles).unwrap(),
            "{shape}: tiles of the same ids"
        );
    }
    println!(
        "PARITY op=moe_route_vs_two_launch shape={shape} logits_equal={same_logits} near_tie_swaps={swaps} tiles_equal={same_tiles}"
    );
}

/// The fused decode routing (`moe_route_decode`: router GEMV, softmax top-k and grouping by expert in
/// one launch, one token) at the models' shapes and odd ones, three consecutive launches per shape
/// through one ticket (which must come back to 0 each time).
///
/// Routing flips: the fused launch's logits differ from the CPU's and from the two-launch GEMV's only
/// in summation order, so where two experts' logits are that close their order may differ. A differing
/// rank is accepted only when the two experts' logits (as the other side computed them) lie within
/// twice the largest logit difference of the token between the two computations, plus 1e-6; the
/// number of such ranks is printed (`near_tie_swaps`). The top-k and the grouping themselves are
/// exact: on the fused launch's own logits the two-launch kernels give the same ids, bitwise the same
/// weights and the same tiles; exact ties (duplicated router rows, an all-zero token) go to the lower
/// id.
#[test]
fn moe_route_decode_matches_cpu_and_two_launch_path() {
    let Some(g) = gpu("moe_route_decode_matches_cpu_and_two_launch_path") else {
        return;
    };
    let mut rng = Rng::new(21);
    let mut ticket = g.zeros::<u32>(1).unwrap();
    // (label, hidden, experts, k, renormalise): Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B,
    // qwen4-exp-125b-a6b, the tiny fixtures (hidden 64, 8 experts, top 2), then odd shapes: 33
    // experts (a partial list), the largest e and k the kernel takes, 1000 experts, e = k = 32.
    for &(label, h, e, k, renorm) in &[
        ("qwen3-next-80b", 2048usize, 512usize, 10usize, true),
        ("qwen3.5-35b-a3b", 2048, 256, 8, false),
        ("qwen4-exp-125b-a6b", 2560, 512, 10, false),
        ("tiny", 64, 8, 2, false),
        ("tiny_renorm", 64, 8, 2, true),
        ("odd", 72, 33, 3, true),
        ("max", 256, 1024, 16, true),
        ("e1000", 136, 1000, 16, false),
        ("e32_k16", 40, 32, 16, true),
    ] {
        let t = 1;
        let s = RouteShape { t, h, e, k, renorm };
        for inputs in [Inputs::Random, Inputs::DuplicateRows, Inputs::ZeroToken] {
            let shape = format!("{label}_t{t}_h{h}_e{e}_k{k}_renorm{renorm}_{inputs:?}");
            route_decode_case(g, &mut rng, &mut ticket, s, inputs, &shape);
            assert_eq!(g.download(&ticket).unwrap(), [0], "{shape}: ticket");
        }
    }
}

#[test]
fn moe_route_decode_rejects_bad_shapes() {
    let Some(g) = gpu("moe_route_decode_rejects_bad_shapes") else {
        return;
    };
    let (h, e) = (64usize, 8usize);
    let r = g.zeros::<half::bf16>(e * h).unwrap();
    let x = g.zeros::<half::bf16>(9 * h).unwrap();
    let mut lg = g.zeros::<f32>(9 * e).unwrap();
    let (mut ids, mut w) = (
        g.zeros::<u32>(9 * 17).unwrap(),
        g.zeros::<f32>(9 * 17).unwrap(),
    );
    let mut perm = g.zeros::<u32>(9 * 17).unwrap();
    let mut tiles = g.zeros::<u32>(3 * 9 * 17).unwrap();
    let mut ticket = g.zeros::<u32>(1).unwrap();
    // (t, h, k): 2 tokens, k = 9 > e, k = 0, h not a multiple of 8.
    for (t, hh, k) in [(2, h, 2), (1, h, 9), (1, h, 0), (1, 60, 2)] {
        assert!(g
            .moe_route_decode(
                &r,
                &x,
                hh,
                RouteDims {
                    tokens: t,
                    experts: e,
                    top_k: k,
                    renormalize: true
                },
                DecodeRouting {
                    logits: &mut lg,
                    ids: &mut ids,
                    weights: &mut w,
                    perm: &mut perm,
                    tiles: &mut tiles
                },
                &mut ticket
            )
            .is_err());
    }
}
