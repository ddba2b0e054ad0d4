//! QSA's lightning indexer and the attention restricted to its selection (spec §2): the key
//! LayerNorm, the index scores, the exact top-k with ties to the larger position, and the gated
//! attention of one query row over gathered K/V rows.

use super::Heads;

/// LayerNorm per row in place (`[rows, d]`): `(x − mean) / sqrt(var + eps) · w + b`, biased variance,
/// in f32 summed in order.
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], d: usize, eps: f32) {
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "layer_norm: x must be [rows, d]"
    );
    assert!(
        w.len() == d && b.len() == d,
        "layer_norm: w and b must be [d]"
    );
    for row in x.chunks_exact_mut(d) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let r = 1.0 / (var + eps).sqrt();
        for ((v, w), b) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * r * w + b;
        }
    }
}

/// Index scores of one query against `keys` (`[n, dI]`, dequantised): `q` `[nI, dI]` (roped),
/// `w` `[nI]` (already scaled by `nI^-0.5 · dI^-0.5`); `out[s] = Σ_h w_h · ReLU(q_h · k_s)`.
pub fn index_scores(q: &[f32], w: &[f32], keys: &[f32], d: usize, out: &mut [f32]) {
    let nh = w.len();
    assert_eq!(q.len(), nh * d, "index_scores: q must be [nI, dI]");
    assert_eq!(
        keys.len(),
        out.len() * d,
        "index_scores: keys must be [n, dI]"
    );
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(d)) {
        let mut acc = 0f32;
        for (wh, qh) in w.iter().zip(q.chunks_exact(d)) {
            let dot: f32 = qh.iter().zip(k).map(|(a, b)| a * b).sum();
            acc += wh * dot.max(0.0);
        }
        *o = acc;
    }
}

/// The `min(k, scores.len())` positions of largest score, ties going to the larger position,
/// returned in increasing position order. NaN scores rank below every number.
pub fn topk_positions(scores: &[f32], k: usize) -> Vec<usize> {
    let n = scores.len();
    if k >= n {
        return (0..n).collect();
    }
    // "a ranks before b": larger score, then larger position.
    let key = |i: usize| {
        let s = scores[i];
        (if s.is_nan() { f32::NEG_INFINITY } else { s }, i)
    };
    let mut idx: Vec<usize> = (0..n).collect();
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        let (sa, ia) = key(a);
        let (sb, ib) = key(b);
        sb.total_cmp(&sa).then(ib.cmp(&ia))
    });
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// Gated attention of one query row over gathered rows: `q` `[hq, d]` (normed, roped), `gate`
/// `[hq, d]`, `k`/`v` `[n, hkv·d]` (the selected positions in increasing order), with `heads`'
/// sizes and scale; query head `h` reads KV head `h / (hq / hkv)`.
/// `out[h] = sigmoid(gate_h) ⊙ Σ_j softmax_j(q_h·k_j·scale) v_j`, the softmax in f32 with max
/// subtraction.
pub fn attend_rows(q: &[f32], gate: &[f32], k: &[f32], v: &[f32], heads: &Heads, out: &mut [f32]) {
    let Heads { hq, hkv, d, scale } = *heads;
    let row = hkv * d;
    let n = k.len() / row;
    assert_eq!(v.len(), n * row, "attend_rows: k and v must be [n, hkv*d]");
    let group = hq / hkv;
    let mut p = vec![0f32; n];
    for h in 0..hq {
        let kvh = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let mut max = f32::NEG_INFINITY;
        for (j, pj) in p.iter_mut().enumerate() {
            let kj = &k[j * row + kvh * d..j * row + (kvh + 1) * d];
            *pj = qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
            max = max.max(*pj);
        }
        let mut sum = 0f32;
        for pj in p.iter_mut() {
            *pj = (*pj - max).exp();
            sum += *pj;
        }
        let o = &mut out[h * d..(h + 1) * d];
        o.fill(0.0);
        for (j, pj) in p.iter().enumerate() {
            let vj = &v[j * row + kvh * d..j * row + (kvh + 1) * d];
            let w = pj / sum;
            o.iter_mut().zip(vj).for_each(|(o, x)| *o += w * x);
        }
        for (o, g) in o.iter_mut().zip(&gate[h * d..(h + 1) * d]) {
            *o *= super::sigmoid(*g);
        }
    }
}
