//! Top-N of a row of logits: the alternatives a response reports with each token.

use super::math::{block, max, BLOCK};

/// Puts the `n` largest `(id, logit)` of `row` into `out`, largest first, lower id first among equals.
///
/// `maxima` are the row's block maxima when known; a block whose maximum cannot enter the list is
/// skipped whole.
pub fn top_n(row: &[f32], maxima: Option<&[f32]>, n: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    if n == 0 {
        return;
    }
    for b in 0..row.len().div_ceil(BLOCK) {
        let values = block(row, b);
        if out.len() == n {
            let bm = maxima
                .and_then(|m| m.get(b).copied())
                .unwrap_or_else(|| max(values));
            if bm <= out[n - 1].1 {
                continue;
            }
        }
        for (j, &x) in values.iter().enumerate() {
            if out.len() == n {
                if x.is_nan() || x <= out[n - 1].1 {
                    continue;
                }
                out.pop();
            } else if x.is_nan() {
                continue;
            }
            // After every entry at least as large: equal values keep their (lower) earlier ids first.
            let at = out.partition_point(|e| e.1 >= x);
            out.insert(at, ((b * BLOCK + j) as u32, x));
        }
    }
}

/// The `n` most likely tokens of `row` as `(id, logprob)`, given its log-normaliser and block maxima.
pub(crate) fn top_logprobs(
    row: &[f32],
    maxima: Option<&[f32]>,
    n: usize,
    log_z: f32,
) -> Vec<(u32, f32)> {
    let mut out = Vec::with_capacity(n + 1);
    top_n(row, maxima, n, &mut out);
    for e in &mut out {
        e.1 -= log_z;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_n_matches_a_full_sort_with_ties() {
        let row: Vec<f32> = (0..3000).map(|i| ((i * 7919) % 613) as f32 * 0.5).collect();
        for n in [1, 2, 5, 20] {
            let mut want: Vec<(u32, f32)> = row
                .iter()
                .enumerate()
                .map(|(i, &x)| (i as u32, x))
                .collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            want.truncate(n);
            let mut got = Vec::new();
            top_n(&row, None, n, &mut got);
            assert_eq!(got, want, "n={n}");
            let mut maxima = Vec::new();
            crate::sample::math::block_maxima(&row, &mut maxima);
            top_n(&row, Some(&maxima), n, &mut got);
            assert_eq!(got, want, "n={n} with block maxima");
        }
        let mut got = Vec::new();
        top_n(&[1.0, f32::NAN, 2.0], None, 5, &mut got);
        assert_eq!(got, vec![(2, 2.0), (0, 1.0)]);
    }
}
