//! The PLE mix's per-token gating and its dilated causal conv (spec §3.7), and the
//! hyper-connections' elementwise ops (spec §4).

use super::{rms_norm, sigmoid, silu};

/// Epsilon of every rmsnorm of the PLE mix.
pub const PLE_EPS: f32 = 1e-6;

/// `sign(σ)·sqrt(max(|σ|, 1e-6))` with `sign(0) = 0`.
pub fn signed_sqrt(s: f32) -> f32 {
    if s == 0.0 || s.is_nan() {
        return s;
    }
    s.signum() * s.abs().max(1e-6).sqrt()
}

/// The gate of one stream for one token: `u = sigmoid(⟨key, rmsnorm(r; qn)⟩/sqrt(H) ↦ signed_sqrt) · v`,
/// `key` already normed; writes `u` into `u_out` and returns nothing else.
pub fn ple_gate(key: &[f32], r: &[f32], qn: &[f32], v: &[f32], u_out: &mut [f32]) {
    let h = r.len();
    let mut q = r.to_vec();
    rms_norm(&mut q, qn, h, PLE_EPS, 0.0);
    let dot: f32 = key.iter().zip(&q).map(|(a, b)| a * b).sum();
    let g = sigmoid(signed_sqrt(dot / (h as f32).sqrt()));
    u_out.iter_mut().zip(v).for_each(|(u, v)| *u = g * v);
}

/// Depthwise causal dilated conv + SiLU over `c` channels: `x` `[t, c]`, `w` `[c, k]` (`w[ch, k−1]`
/// multiplies the current row), `state` `[(k−1)·dil, c]` the inputs preceding `x` (zeros for a new
/// sequence), replaced by the last `(k−1)·dil` rows of `state ++ x`. `out[s, ch] =
/// silu(Σ_j w[ch, j] · xx[s + j·dil, ch])` with `xx = state ++ x`, summed in order of j.
pub fn dilated_conv_silu(
    x: &[f32],
    w: &[f32],
    state: &mut [f32],
    c: usize,
    k: usize,
    dil: usize,
    out: &mut [f32],
) {
    let past = (k - 1) * dil;
    assert_eq!(
        state.len(),
        past * c,
        "dilated_conv_silu: state must be [(k-1)*dil, c]"
    );
    assert_eq!(w.len(), c * k, "dilated_conv_silu: w must be [c, k]");
    let t = x.len() / c;
    let mut xx = Vec::with_capacity((past + t) * c);
    xx.extend_from_slice(state);
    xx.extend_from_slice(x);
    for s in 0..t {
        let o = &mut out[s * c..(s + 1) * c];
        for (ch, o) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                acc += w[ch * k + j] * xx[(s + j * dil) * c + ch];
            }
            *o = silu(acc);
        }
    }
    state.copy_from_slice(&xx[t * c..]);
}

/// Softmax of the `S` pre-mix logits (f32, max subtracted).
pub fn hc_weights(pre: &[f32]) -> Vec<f32> {
    let max = pre.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let e: Vec<f32> = pre.iter().map(|x| (x - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}
