//! `matmul_t` against a plain triple loop in f64, over sizes that are not multiples of any block.

mod ops_util;

use ops_util::Rng;
use sanmai_cpu::ops::matmul_t;

/// Checks `matmul_t` on random `[t, k] · [n, k]ᵀ` against f64, element by element, with an error bound
/// proportional to `Σ|x·w|` (the scale of the rounding error of any summation order).
fn check(t: usize, k: usize, n: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let x = rng.vec(t * k, -1.0, 1.0);
    let w = rng.vec(n * k, -1.0, 1.0);
    let mut y = vec![f32::NAN; t * n];
    matmul_t(&x, &w, t, k, n, &mut y);
    for s in 0..t {
        for o in 0..n {
            let mut exact = 0f64;
            let mut mag = 0f64;
            for i in 0..k {
                let p = x[s * k + i] as f64 * w[o * k + i] as f64;
                exact += p;
                mag += p.abs();
            }
            let err = (y[s * n + o] as f64 - exact).abs();
            assert!(
                err <= 2e-6 * mag + 1e-30,
                "t={t} k={k} n={n}: y[{s},{o}] = {} vs {exact} (err {err:e}, scale {mag:e})",
                y[s * n + o]
            );
        }
    }
}

#[test]
fn matches_triple_loop_on_odd_sizes() {
    let shapes = [
        (1, 1, 1),
        (1, 1, 9),
        (3, 1, 5),
        (1, 7, 13),
        (1, 64, 203),
        (2, 9, 11),
        (3, 17, 25),
        (4, 8, 3),
        (5, 33, 10),
        (6, 15, 49),
        (9, 100, 31),
    ];
    for (i, &(t, k, n)) in shapes.iter().enumerate() {
        check(t, k, n, 100 + i as u64);
    }
}

#[test]
fn matches_triple_loop_across_blocks_and_threads() {
    // t > 64 rows per task, n > the 48 weight rows per task at k = 1000, and large enough to run in parallel.
    check(70, 1000, 101, 7);
    // GEMV shape with many weight blocks.
    check(1, 37, 5000, 8);
}

#[test]
fn rows_are_batch_invariant() {
    // Row s of a batched product is bit-identical to the product of row s alone: every output is
    // reduced in the same order whatever tile or task computes it.
    let (t, k, n) = (67, 45, 130);
    let mut rng = Rng::new(11);
    let x = rng.vec(t * k, -1.0, 1.0);
    let w = rng.vec(n * k, -1.0, 1.0);
    let mut y = vec![0f32; t * n];
    matmul_t(&x, &w, t, k, n, &mut y);
    let mut row = vec![0f32; n];
    for s in 0..t {
        matmul_t(&x[s * k..(s + 1) * k], &w, 1, k, n, &mut row);
        assert_eq!(
            &y[s * n..(s + 1) * n],
            &row[..],
            "row {s} differs from its batched value"
        );
    }
    let mut pair = vec![0f32; 2 * n];
    matmul_t(&x[5 * k..7 * k], &w, 2, k, n, &mut pair);
    assert_eq!(&y[5 * n..7 * n], &pair[..]);
}

#[test]
fn empty_reduction_gives_zeros() {
    let mut y = vec![f32::NAN; 6];
    matmul_t(&[], &[], 2, 0, 3, &mut y);
    assert!(y.iter().all(|&v| v == 0.0));
}
