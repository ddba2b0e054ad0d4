//! The MoE router (softmax, top-k, renormalise) against `sanmai_cpu::ops::route_topk`.

use sanmai_cpu::ops;

use crate::common::{check_f32, gpu, Rng};

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
        g.route_topk(&lg, &mut ids, &mut w, t, e, k, renorm)
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
    assert!(g.route_topk(&lg, &mut ids, &mut w, 4, 8, 9, true).is_err());
    assert!(g.route_topk(&lg, &mut ids, &mut w, 4, 8, 0, true).is_err());
    assert!(g.route_topk(&lg, &mut ids, &mut w, 5, 8, 2, true).is_err());
}
