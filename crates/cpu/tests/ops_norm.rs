//! Norms and activations against their formulas written out in f64.

mod ops_util;

use ops_util::{max_elem_rel, Rng};
use sanmai_cpu::ops::{gated_rms_norm, l2_norm, rms_norm, sigmoid, silu, softplus, swiglu};

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn rms_ref(x: &[f32], w: &[f32], d: usize, eps: f32, offset: f32) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for (v, w) in row.iter().zip(w) {
            out.push(*v as f64 * r * (offset as f64 + *w as f64));
        }
    }
    out
}

#[test]
fn rms_norm_zero_centred_and_plain() {
    let mut rng = Rng::new(1);
    // One small row, a few odd rows, and enough rows to run in parallel.
    for (rows, d) in [(1, 5), (3, 64), (7, 33), (300, 512)] {
        let x = rng.vec(rows * d, -3.0, 3.0);
        let w = rng.vec(d, -0.5, 0.5);
        for offset in [1.0f32, 0.0] {
            let mut y = x.clone();
            rms_norm(&mut y, &w, d, 1e-6, offset);
            let r = rms_ref(&x, &w, d, 1e-6, offset);
            let e = max_elem_rel(&y, &r, 1e-3);
            assert!(e < 2e-6, "rows={rows} d={d} offset={offset}: error {e:e}");
        }
    }
}

#[test]
fn rms_norm_eps_dominates_a_zero_row() {
    let mut x = vec![0f32; 8];
    rms_norm(&mut x, &[0.5; 8], 8, 1e-6, 1.0);
    assert!(x.iter().all(|&v| v == 0.0));
}

#[test]
fn gated_rms_norm_matches_formula() {
    let mut rng = Rng::new(2);
    for (rows, d) in [(1, 24), (5, 128), (200, 256)] {
        let x = rng.vec(rows * d, -2.0, 2.0);
        let z = rng.vec(rows * d, -6.0, 6.0);
        let w = rng.vec(d, 0.5, 1.5);
        let mut y = x.clone();
        gated_rms_norm(&mut y, &z, &w, d, 1e-6);
        let mut r = Vec::new();
        for (row, zr) in x.chunks(d).zip(z.chunks(d)) {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for ((v, z), w) in row.iter().zip(zr).zip(&w) {
                r.push(*w as f64 * (*v as f64 * inv) * silu64(*z as f64));
            }
        }
        let e = max_elem_rel(&y, &r, 1e-3);
        assert!(e < 4e-6, "rows={rows} d={d}: error {e:e}");
    }
}

#[test]
fn l2_norm_matches_formula() {
    let mut rng = Rng::new(3);
    for (rows, d) in [(1, 3), (4, 16), (9, 128), (400, 128)] {
        let x = rng.vec(rows * d, -1.0, 1.0);
        let mut y = x.clone();
        l2_norm(&mut y, d, 1e-6);
        let mut r = Vec::new();
        for row in x.chunks(d) {
            let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
            let inv = 1.0 / (ss + 1e-6).sqrt();
            r.extend(row.iter().map(|&v| v as f64 * inv));
        }
        let e = max_elem_rel(&y, &r, 1e-3);
        assert!(e < 2e-6, "rows={rows} d={d}: error {e:e}");
        // Unit length (up to eps).
        for row in y.chunks(d) {
            let n: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
            assert!((n - 1.0).abs() < 1e-4, "row norm² {n}");
        }
    }
}

#[test]
fn activations_match_formulas() {
    let mut rng = Rng::new(4);
    for _ in 0..2000 {
        let x = rng.range(-30.0, 30.0);
        let xd = x as f64;
        let sg = 1.0 / (1.0 + (-xd).exp());
        assert!(
            (sigmoid(x) as f64 - sg).abs() <= 2e-7 * sg.max(1e-30) + 1e-45,
            "sigmoid({x})"
        );
        assert!(
            (silu(x) as f64 - xd * sg).abs() <= 3e-7 * (xd * sg).abs() + 1e-45,
            "silu({x})"
        );
        let sp = if xd > 20.0 { xd } else { xd.exp().ln_1p() };
        assert!(
            (softplus(x) as f64 - sp).abs() <= 3e-7 * sp,
            "softplus({x})"
        );
    }
    // torch's threshold: above 20 softplus is the identity, at 20 it is still log1p(exp(x)) (20 in f32).
    assert_eq!(softplus(25.0), 25.0);
    assert_eq!(softplus(20.5), 20.5);
    assert!((softplus(20.0) as f64 - 20f64.exp().ln_1p()).abs() < 1e-5);
    assert_eq!(softplus(-200.0), 0.0);
    // Saturation is finite, not NaN.
    assert_eq!(sigmoid(-200.0), 0.0);
    assert_eq!(sigmoid(200.0), 1.0);
    assert_eq!(silu(-200.0), 0.0);
    assert_eq!(silu(200.0), 200.0);
    assert!(silu(f32::NAN).is_nan());
}

#[test]
fn swiglu_matches_formula() {
    let mut rng = Rng::new(5);
    for (t, i) in [(1, 7), (3, 64), (257, 640)] {
        let gu = rng.vec(t * 2 * i, -5.0, 5.0);
        let mut out = vec![f32::NAN; t * i];
        swiglu(&gu, t, i, &mut out);
        let mut r = Vec::new();
        for row in gu.chunks(2 * i) {
            for j in 0..i {
                r.push(silu64(row[j] as f64) * row[i + j] as f64);
            }
        }
        let e = max_elem_rel(&out, &r, 1e-3);
        assert!(e < 1e-6, "t={t} i={i}: error {e:e}");
    }
}
