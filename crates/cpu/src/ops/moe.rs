//! The MoE router: softmax over the expert logits in f32, top-k, optional renormalisation.

use std::cmp::Ordering;

/// Routes every token to its `k` most probable experts.
///
/// `logits`: `[t, e]`. Per row, `p = softmax(logits)` in f32 (max subtracted); the `k` largest `p` are
/// kept, ties going to the lower expert id; with `renorm` they are divided by their sum. Writes
/// `ids`: `[t, k]` and `weights`: `[t, k]`, each row sorted by descending weight (ties: lower id first).
/// `k` must not exceed `e`. NaN logits never panic (their rows come out as NaN weights).
pub fn route_topk(
    logits: &[f32],
    t: usize,
    e: usize,
    k: usize,
    renorm: bool,
    ids: &mut [u32],
    weights: &mut [f32],
) {
    assert!(
        k <= e,
        "route_topk: k must not exceed the number of experts"
    );
    assert!(
        e <= u32::MAX as usize,
        "route_topk: too many experts for u32 ids"
    );
    assert_eq!(logits.len(), t * e, "route_topk: logits must be [t, e]");
    assert_eq!(ids.len(), t * k, "route_topk: ids must be [t, k]");
    assert_eq!(weights.len(), t * k, "route_topk: weights must be [t, k]");
    if k == 0 {
        return;
    }
    for ((row, id), wt) in logits
        .chunks_exact(e)
        .zip(ids.chunks_exact_mut(k))
        .zip(weights.chunks_exact_mut(k))
    {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
        // Insertion into the sorted top-k: a later expert passes an earlier one only when strictly larger,
        // so equal probabilities keep the lower id first. The first k experts always enter.
        let mut filled = 0;
        for (ex, &x) in row.iter().enumerate() {
            let p = (x - max).exp() / sum;
            if filled == k && p.partial_cmp(&wt[k - 1]) != Some(Ordering::Greater) {
                continue;
            }
            let mut pos = filled.min(k - 1);
            while pos > 0 && p > wt[pos - 1] {
                wt[pos] = wt[pos - 1];
                id[pos] = id[pos - 1];
                pos -= 1;
            }
            wt[pos] = p;
            id[pos] = ex as u32;
            filled = (filled + 1).min(k);
        }
        if renorm {
            let s: f32 = wt.iter().sum();
            for w in wt.iter_mut() {
                *w /= s;
            }
        }
    }
}
