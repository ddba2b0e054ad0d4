//! Router top-k: probabilities, selection order, ties and renormalisation.

mod ops_util;

use ops_util::Rng;
use sanmai_cpu::ops::route_topk;

fn route(logits: &[f32], e: usize, k: usize, renorm: bool) -> (Vec<u32>, Vec<f32>) {
    let t = logits.len() / e;
    let mut ids = vec![u32::MAX; t * k];
    let mut w = vec![f32::NAN; t * k];
    route_topk(logits, t, e, k, renorm, &mut ids, &mut w);
    (ids, w)
}

#[test]
fn matches_sorted_softmax() {
    let mut rng = Rng::new(1);
    for (t, e, k) in [(1, 4, 1), (5, 64, 8), (7, 512, 10), (3, 10, 10)] {
        let logits = rng.vec(t * e, -4.0, 4.0);
        for renorm in [false, true] {
            let (ids, w) = route(&logits, e, k, renorm);
            for s in 0..t {
                let row = &logits[s * e..(s + 1) * e];
                let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
                let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                let p: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp() / sum).collect();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                let top = &order[..k];
                let norm: f64 = if renorm {
                    top.iter().map(|&i| p[i]).sum()
                } else {
                    1.0
                };
                for (j, &ex) in top.iter().enumerate() {
                    assert_eq!(
                        ids[s * k + j],
                        ex as u32,
                        "t={t} e={e} k={k} row {s} slot {j}"
                    );
                    let want = p[ex] / norm;
                    let got = w[s * k + j] as f64;
                    assert!((got - want).abs() <= 2e-6 * want, "weight {got} vs {want}");
                }
                if renorm {
                    let total: f32 = w[s * k..(s + 1) * k].iter().sum();
                    assert!((total - 1.0).abs() < 1e-6);
                }
            }
        }
    }
}

#[test]
fn ties_go_to_the_lower_expert_id() {
    let logits = [1.0f32, 3.0, 3.0, 0.0, 3.0, -1.0];
    let (ids, w) = route(&logits, 6, 2, false);
    assert_eq!(ids, [1, 2]);
    assert_eq!(w[0], w[1]);
    let (ids, _) = route(&logits, 6, 4, false);
    assert_eq!(ids, [1, 2, 4, 0]);
    // All equal: the first k ids, each 1/e, or 1/k once renormalised.
    let flat = [0.5f32; 8];
    let (ids, w) = route(&flat, 8, 3, false);
    assert_eq!(ids, [0, 1, 2]);
    assert!(w.iter().all(|&x| x == 0.125));
    let (_, w) = route(&flat, 8, 3, true);
    assert!(w.iter().all(|&x| (x - 1.0 / 3.0).abs() < 1e-7));
    // A tie at the cut: the lower id enters, the higher stays out.
    let (ids, _) = route(&[2.0, 5.0, 2.0, 2.0], 4, 2, false);
    assert_eq!(ids, [1, 0]);
}

#[test]
fn renorm_keeps_ratios() {
    let logits = [0.1f32, 2.0, -1.0, 1.0, 0.5];
    let (ids, raw) = route(&logits, 5, 3, false);
    let (ids2, norm) = route(&logits, 5, 3, true);
    assert_eq!(ids, [1, 3, 4]);
    assert_eq!(ids, ids2);
    let s: f32 = raw.iter().sum();
    for (a, b) in raw.iter().zip(&norm) {
        assert!((a / s - b).abs() < 1e-7);
    }
    // Weights descend.
    assert!(norm[0] >= norm[1] && norm[1] >= norm[2]);
}

#[test]
fn extreme_logits_stay_finite() {
    let (ids, w) = route(&[1e30, -1e30, 0.0, f32::MAX], 4, 2, true);
    assert_eq!(ids[0], 3);
    assert!(w.iter().all(|x| x.is_finite()));
    // NaN logits do not panic.
    let _ = route(&[f32::NAN, 1.0, 2.0], 3, 2, true);
}
