//! Causal depthwise conv1d + SiLU: the formula, prefill vs token-by-token, and the rolling state.

mod ops_util;

use ops_util::{max_elem_rel, Rng};
use sanmai_cpu::ops::causal_conv1d_silu;

/// `out[s, ch] = silu(Σ_j w[ch, j]·xx[s + j, ch])`, `xx = state ++ x`, in f64.
fn conv_ref(x: &[f32], w: &[f32], state: &[f32], t: usize, c: usize, k: usize) -> Vec<f64> {
    let mut xx: Vec<f64> = state.iter().map(|&v| v as f64).collect();
    xx.extend(x.iter().map(|&v| v as f64));
    let mut out = vec![0f64; t * c];
    for s in 0..t {
        for ch in 0..c {
            let mut acc = 0f64;
            for j in 0..k {
                acc += w[ch * k + j] as f64 * xx[(s + j) * c + ch];
            }
            out[s * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    out
}

fn setup(t: usize, c: usize, k: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    (
        rng.vec(t * c, -2.0, 2.0),
        rng.vec(c * k, -1.0, 1.0),
        rng.vec((k - 1) * c, -2.0, 2.0),
    )
}

#[test]
fn prefill_matches_formula_and_keeps_last_inputs() {
    for (t, c, k, seed) in [
        (1, 5, 4, 1),
        (2, 7, 4, 2),
        (9, 33, 4, 3),
        (40, 1000, 4, 4),
        (6, 3, 2, 5),
        (3, 4, 1, 6),
    ] {
        let (x, w, state0) = setup(t, c, k, seed);
        let mut state = state0.clone();
        let mut out = vec![f32::NAN; t * c];
        causal_conv1d_silu(&x, &w, &mut state, t, c, k, &mut out);
        let r = conv_ref(&x, &w, &state0, t, c, k);
        let e = max_elem_rel(&out, &r, 0.5);
        assert!(e < 2e-6, "t={t} c={c} k={k}: error {e:e}");
        let mut xx = state0.clone();
        xx.extend_from_slice(&x);
        assert_eq!(
            state[..],
            xx[xx.len() - (k - 1) * c..],
            "t={t} c={c} k={k}: state"
        );
    }
}

#[test]
fn prefill_equals_token_by_token_and_split_calls() {
    let (t, c, k) = (11, 24, 4);
    let (x, w, state0) = setup(t, c, k, 9);
    let mut st_all = state0.clone();
    let mut out_all = vec![0f32; t * c];
    causal_conv1d_silu(&x, &w, &mut st_all, t, c, k, &mut out_all);

    let mut st = state0.clone();
    let mut out = vec![0f32; t * c];
    for s in 0..t {
        causal_conv1d_silu(
            &x[s * c..(s + 1) * c],
            &w,
            &mut st,
            1,
            c,
            k,
            &mut out[s * c..(s + 1) * c],
        );
    }
    assert_eq!(out, out_all);
    assert_eq!(st, st_all);

    // Calls shorter than k − 1 (state partly shifted) and longer ones, mixed.
    let mut st = state0.clone();
    let mut out = vec![0f32; t * c];
    let mut s0 = 0;
    for len in [2, 1, 5, 3] {
        let r = s0 * c..(s0 + len) * c;
        causal_conv1d_silu(&x[r.clone()], &w, &mut st, len, c, k, &mut out[r]);
        s0 += len;
    }
    assert_eq!(out, out_all);
    assert_eq!(st, st_all);
}

#[test]
fn fresh_sequence_is_zero_padded() {
    let (t, c, k) = (5, 6, 4);
    let (x, w, _) = setup(t, c, k, 12);
    let mut state = vec![0f32; (k - 1) * c];
    let mut out = vec![0f32; t * c];
    causal_conv1d_silu(&x, &w, &mut state, t, c, k, &mut out);
    // The first token only meets the last tap.
    for ch in 0..c {
        let a = w[ch * k + k - 1] as f64 * x[ch] as f64;
        let want = a / (1.0 + (-a).exp());
        assert!((out[ch] as f64 - want).abs() < 1e-6, "channel {ch}");
    }
}
