//! Scalar activations as torch computes them in f32, and the fused SwiGLU of the MoE experts.

use rayon::prelude::*;

use super::{multiversion, PAR_MIN_WORK};

/// `x · sigmoid(x)`, computed as torch does: `x / (1 + exp(-x))`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `1 / (1 + exp(-x))`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + exp(x))`, returning `x` itself above 20 (torch's default `beta = 1, threshold = 20`).
#[inline(always)]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

multiversion! {
    fn swiglu_rows(gate_up: &[f32], i: usize, out: &mut [f32]) {
        for (gu, o) in gate_up.chunks_exact(2 * i).zip(out.chunks_exact_mut(i)) {
            let (gate, up) = gu.split_at(i);
            for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
                *o = silu(*g) * u;
            }
        }
    }
}

/// SwiGLU on a fused gate|up buffer: `out[s, j] = silu(gate_up[s, j]) · gate_up[s, i + j]`.
///
/// `gate_up`: `[t, 2i]` (gate first, then up, as the experts' `gate_up_proj` produces); `out`: `[t, i]`.
pub fn swiglu(gate_up: &[f32], t: usize, i: usize, out: &mut [f32]) {
    assert_eq!(gate_up.len(), t * 2 * i, "swiglu: gate_up must be [t, 2i]");
    assert_eq!(out.len(), t * i, "swiglu: out must be [t, i]");
    if t == 0 || i == 0 {
        return;
    }
    if t * i < PAR_MIN_WORK / 8 || t == 1 {
        swiglu_rows(gate_up, i, out);
    } else {
        let rows = (PAR_MIN_WORK / 8).div_ceil(i).max(1);
        gate_up
            .par_chunks(rows * 2 * i)
            .zip(out.par_chunks_mut(rows * i))
            .for_each(|(gu, o)| swiglu_rows(gu, i, o));
    }
}
