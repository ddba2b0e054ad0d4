//! Depthwise causal conv1d + SiLU of the GDN mixer, with its rolling state of the last `k − 1` inputs.

use rayon::prelude::*;

use super::{act::silu, multiversion, PAR_MIN_WORK};

multiversion! {
    /// Output rows `s0 .. s0 + out.len()/c`: `out[s, ch] = silu(Σ_j w_t[j, ch] · xx[s + j, ch])`, summed in
    /// order of `j`, where `xx` row `r` is `state` row `r` for `r < k − 1`, else `x` row `r − (k − 1)`.
    fn conv_rows(x: &[f32], w_t: &[f32], state: &[f32], c: usize, k: usize, s0: usize, out: &mut [f32]) {
        for (i, o) in out.chunks_exact_mut(c).enumerate() {
            let s = s0 + i;
            for j in 0..k {
                let r = s + j;
                let src = if r < k - 1 {
                    &state[r * c..(r + 1) * c]
                } else {
                    let xr = r + 1 - k;
                    &x[xr * c..(xr + 1) * c]
                };
                let wj = &w_t[j * c..(j + 1) * c];
                if j == 0 {
                    for ((o, w), v) in o.iter_mut().zip(wj).zip(src) {
                        *o = w * v;
                    }
                } else {
                    for ((o, w), v) in o.iter_mut().zip(wj).zip(src) {
                        *o += w * v;
                    }
                }
            }
            for v in o.iter_mut() {
                *v = silu(*v);
            }
        }
    }
}

/// Depthwise causal conv1d over channels (kernel `k`, no bias), then SiLU.
///
/// `x`: `[t, c]` token-major; `w`: `[c, k]` (`conv1d.weight [c, 1, k]` squeezed, `w[ch, k−1]` multiplies
/// the current token); `state`: `[k−1, c]`, the `k − 1` inputs preceding `x` (zeros for a fresh
/// sequence), replaced by the last `k − 1` rows of `state ++ x`; `out`: `[t, c]`.
/// `out[s, ch] = silu(Σ_j w[ch, j] · xx[s + j, ch])` with `xx = state ++ x`.
pub fn causal_conv1d_silu(
    x: &[f32],
    w: &[f32],
    state: &mut [f32],
    t: usize,
    c: usize,
    k: usize,
    out: &mut [f32],
) {
    assert!(k >= 1, "causal_conv1d_silu: kernel size must be at least 1");
    assert_eq!(x.len(), t * c, "causal_conv1d_silu: x must be [t, c]");
    assert_eq!(w.len(), c * k, "causal_conv1d_silu: w must be [c, k]");
    assert_eq!(
        state.len(),
        (k - 1) * c,
        "causal_conv1d_silu: state must be [k-1, c]"
    );
    assert_eq!(out.len(), t * c, "causal_conv1d_silu: out must be [t, c]");
    if t == 0 || c == 0 {
        return;
    }
    // Tap-major weights, so the inner loop runs over contiguous channels.
    let mut w_t = vec![0f32; k * c];
    for ch in 0..c {
        for j in 0..k {
            w_t[j * c + ch] = w[ch * k + j];
        }
    }
    if t * c * k < PAR_MIN_WORK || t == 1 {
        conv_rows(x, &w_t, state, c, k, 0, out);
    } else {
        let rows = (PAR_MIN_WORK / (c * k)).max(1);
        let st: &[f32] = state;
        out.par_chunks_mut(rows * c)
            .enumerate()
            .for_each(|(b, o)| conv_rows(x, &w_t, st, c, k, b * rows, o));
    }
    // New state: the last k − 1 rows of state ++ x.
    let keep = k - 1;
    if t >= keep {
        state.copy_from_slice(&x[(t - keep) * c..]);
    } else {
        state.copy_within(t * c.., 0);
        state[(keep - t) * c..].copy_from_slice(x);
    }
}
