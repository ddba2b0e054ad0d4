//! Row-wide numeric passes over logits: max, argmax, sum of exponentials, softmax weights.
//!
//! A row is ~250k values per token, so each pass is written as fixed-width lane loops the compiler
//! vectorises, with a branch-free `exp` (Cody–Waite reduction and a degree-6 polynomial, ~1 ulp on the
//! range used here) instead of the scalar libm call.

/// Lane width of the accumulating loops.
const LANES: usize = 8;
/// Values per partial sum kept by [`exp_weights`] (the draw first walks these, then one chunk).
pub(crate) const CHUNK: usize = 1024;

/// `e^x` for `x <= 0`; values below `-87` (where `e^x` is under `f32::MIN_POSITIVE`), `-inf` and NaN give 0.
#[inline(always)]
pub(crate) fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5·2^23 rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = if x > -87.0 { x } else { -87.0 };
    let xc = if xc < 0.0 { xc } else { 0.0 };
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    let y = p * scale;
    if x > -87.0 {
        y
    } else {
        0.0
    }
}

/// The largest value (NaN ignored); `-inf` for an empty row.
pub(crate) fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(rest) {
        m = if v > m { v } else { m };
    }
    m
}

/// Index of the first occurrence of `m` in `xs`.
pub(crate) fn position_of(xs: &[f32], m: f32) -> Option<usize> {
    xs.iter().position(|&x| x == m)
}

/// `Σ e^(x - shift)` over the row, with `shift >= max(xs)`.
pub(crate) fn sum_exp(xs: &[f32], shift: f32) -> f64 {
    let mut total = 0.0f64;
    for chunk in xs.chunks(CHUNK) {
        let mut acc = [0.0f32; LANES];
        let lanes = chunk.chunks_exact(LANES);
        let rest = lanes.remainder();
        for c in lanes {
            for j in 0..LANES {
                acc[j] += exp_nonpos(c[j] - shift);
            }
        }
        let mut s: f32 = acc.iter().sum();
        for &x in rest {
            s += exp_nonpos(x - shift);
        }
        total += s as f64;
    }
    total
}

/// `ln Σ e^x` over the row; `None` when no value is finite or above `-inf` (nothing to normalise).
pub(crate) fn log_sum_exp(xs: &[f32]) -> Option<f32> {
    let m = max(xs);
    if !m.is_finite() {
        return None;
    }
    Some(m + sum_exp(xs, m).ln() as f32)
}

/// Writes the unnormalised softmax weights `out[i] = e^((xs[i] - shift) · scale)` and returns their sum;
/// `chunk_sums` receives the sum of every [`CHUNK`] consecutive weights.
///
/// With `shift = max(xs)` and `scale = 1 / temperature` the largest weight is exactly 1.
pub(crate) fn exp_weights(
    xs: &[f32],
    shift: f32,
    scale: f32,
    out: &mut [f32],
    chunk_sums: &mut Vec<f64>,
) -> f64 {
    chunk_sums.clear();
    let mut total = 0.0f64;
    for (src, dst) in xs.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
        let mut acc = [0.0f32; LANES];
        let lanes = src.chunks_exact(LANES);
        let rest = lanes.remainder();
        let mut dst_lanes = dst.chunks_exact_mut(LANES);
        for (c, d) in lanes.zip(&mut dst_lanes) {
            for j in 0..LANES {
                let w = exp_nonpos((c[j] - shift) * scale);
                d[j] = w;
                acc[j] += w;
            }
        }
        let mut s: f32 = acc.iter().sum();
        for (&x, d) in rest.iter().zip(dst_lanes.into_remainder()) {
            let w = exp_nonpos((x - shift) * scale);
            *d = w;
            s += w;
        }
        chunk_sums.push(s as f64);
        total += s as f64;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm_to_a_few_ulp() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = (x as f64).exp();
            let got = exp_nonpos(x) as f64;
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "x={x} got={got} want={want}"
            );
            x -= 0.001_37;
        }
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-0.0), 1.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos(f32::NAN), 0.0);
        assert_eq!(exp_nonpos(-1000.0), 0.0);
    }

    #[test]
    fn max_skips_nan_and_position_finds_the_first() {
        let mut xs: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32).collect();
        xs[5] = f32::NAN;
        assert_eq!(max(&xs), 100.0);
        let first = xs.iter().position(|&x| x == 100.0).unwrap();
        assert_eq!(position_of(&xs, max(&xs)), Some(first));
        assert_eq!(max(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
        assert_eq!(max(&[f32::NAN; 9]), f32::NEG_INFINITY);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn weights_and_sums_agree_with_direct_evaluation() {
        let xs: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.01 - 3.0)
            .collect();
        let m = max(&xs);
        let mut out = vec![0.0; xs.len()];
        let mut chunks = Vec::new();
        let total = exp_weights(&xs, m, 1.0 / 0.7, &mut out, &mut chunks);
        let want: f64 = xs.iter().map(|&x| ((x - m) as f64 / 0.7).exp()).sum();
        assert!((total - want).abs() / want < 1e-5);
        assert_eq!(chunks.len(), xs.len().div_ceil(CHUNK));
        assert!((chunks.iter().sum::<f64>() - total).abs() < 1e-9 * total);
        for (&x, &w) in xs.iter().zip(&out) {
            assert!((w as f64 - ((x - m) as f64 / 0.7).exp()).abs() < 1e-6);
        }
        let lse = log_sum_exp(&xs).unwrap();
        let want_lse = m as f64 + xs.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
        assert!((lse as f64 - want_lse).abs() < 1e-5);
    }
}
