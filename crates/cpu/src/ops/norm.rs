//! Row normalisations: RMSNorm (zero-centred or plain), the gated RMSNorm of the GDN output, and the
//! l2norm applied to GDN queries and keys. Each follows transformers' f32 formula term by term.

use rayon::prelude::*;

use super::{act::silu, multiversion, sum_sq, PAR_MIN_WORK};

/// Runs `f` on every row of `x` (`[rows, d]`), in parallel when the buffer is large.
fn for_rows(x: &mut [f32], d: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if x.len() < PAR_MIN_WORK / 4 || x.len() <= d {
        x.chunks_exact_mut(d)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
    } else {
        let rows = (PAR_MIN_WORK / 4).div_ceil(d).max(1);
        x.par_chunks_mut(rows * d).enumerate().for_each(|(b, blk)| {
            blk.chunks_exact_mut(d)
                .enumerate()
                .for_each(|(r, row)| f(b * rows + r, row))
        });
    }
}

/// `1 / sqrt(mean(x²) + eps)` as torch's `rsqrt(x.pow(2).mean(-1) + eps)`.
#[inline(always)]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean = sum_sq(x) / x.len() as f32;
    1.0 / (mean + eps).sqrt()
}

multiversion! {
    fn rms_row(x: &mut [f32], w: &[f32], eps: f32, offset: f32) {
        let r = inv_rms(x, eps);
        for (v, w) in x.iter_mut().zip(w) {
            *v = (*v * r) * (offset + w);
        }
    }
}

/// RMSNorm per row, in place: `y = x · rsqrt(mean(x²) + eps) · (offset + w)`.
///
/// `offset = 1.0` is Qwen3-Next's zero-centred RMSNorm (weights stored around 0); `offset = 0.0` the plain
/// one. `x`: `[rows, d]`; `w`: `[d]`.
pub fn rms_norm(x: &mut [f32], w: &[f32], d: usize, eps: f32, offset: f32) {
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "rms_norm: x must be [rows, d]"
    );
    assert_eq!(w.len(), d, "rms_norm: w must be [d]");
    for_rows(x, d, |_, row| rms_row(row, w, eps, offset));
}

multiversion! {
    fn gated_row(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
        let r = inv_rms(x, eps);
        for ((v, w), z) in x.iter_mut().zip(w).zip(z) {
            *v = (w * (*v * r)) * silu(*z);
        }
    }
}

/// The GDN output norm, in place per row: `y = w · (x · rsqrt(mean(x²) + eps)) · silu(z)` (plain weight).
///
/// `x`, `z`: `[rows, d]`; `w`: `[d]`.
pub fn gated_rms_norm(x: &mut [f32], z: &[f32], w: &[f32], d: usize, eps: f32) {
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "gated_rms_norm: x must be [rows, d]"
    );
    assert_eq!(z.len(), x.len(), "gated_rms_norm: z must be shaped like x");
    assert_eq!(w.len(), d, "gated_rms_norm: w must be [d]");
    for_rows(x, d, |r, row| {
        gated_row(row, &z[r * d..(r + 1) * d], w, eps)
    });
}

/// `x · rsqrt(Σx² + eps)` for one row, as FLA's / transformers' `l2norm`.
#[inline(always)]
pub(crate) fn l2_row(x: &mut [f32], eps: f32) {
    let r = 1.0 / (sum_sq(x) + eps).sqrt();
    for v in x.iter_mut() {
        *v *= r;
    }
}

multiversion! {
    fn l2_row_mv(x: &mut [f32], eps: f32) {
        l2_row(x, eps)
    }
}

/// l2norm per row, in place: `y = x · rsqrt(Σx² + eps)`. `x`: `[rows, d]`.
pub fn l2_norm(x: &mut [f32], d: usize, eps: f32) {
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "l2_norm: x must be [rows, d]"
    );
    for_rows(x, d, |_, row| l2_row_mv(row, eps));
}
