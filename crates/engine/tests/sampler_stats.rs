//! Statistical tests: empirical token frequencies against the filtered, renormalised distribution.
//!
//! Each case draws 20k tokens with a fixed seed and requires (a) that no excluded token is ever drawn and
//! (b) a chi-square statistic below the value a correct sampler exceeds with probability ~3e-7. Each case
//! also checks the same counts *fail* against the unfiltered distribution, so the bound can tell filters
//! apart.

mod common;

use common::{chi_square, chi_square_critical, naive_distribution, sample_counts};
use sanmai_engine::sampler::{Rng, SamplingParams};

const DRAWS: usize = 20_000;
/// Ten real tokens plus two padding slots holding huge logits that must never be drawn.
const ROW: [f32; 12] = [
    2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, 50.0, 60.0,
];
const VALID: usize = 10;

fn params(temperature: f32, top_k: i32, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

fn kept(p: &[f64]) -> Vec<usize> {
    (0..p.len()).filter(|&i| p[i] > 0.0).collect()
}

/// Draws, then checks support, goodness of fit, and that the fit test rejects `unfiltered` (if given).
fn check(
    row: &[f32],
    valid: usize,
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    unfiltered: Option<&SamplingParams>,
) {
    let want = naive_distribution(&row[..valid], params, prompt, output);
    let counts = sample_counts(row, valid, params, prompt, output, DRAWS);
    for (i, &c) in counts.iter().enumerate() {
        if i >= valid || want[i] == 0.0 {
            assert_eq!(c, 0, "excluded token {i} drawn {c} times under {params:?}");
        }
    }
    let (stat, df) = chi_square(&counts[..valid], &want);
    let crit = chi_square_critical(df);
    assert!(
        stat < crit,
        "chi2 {stat:.1} >= {crit:.1} (df {df}) under {params:?}: {counts:?} vs {want:?}"
    );
    if let Some(other) = unfiltered {
        let wrong = naive_distribution(&row[..valid], other, prompt, output);
        let (stat, df) = chi_square(&counts[..valid], &wrong);
        // Tokens the filter removed have zero counts against positive expectations: a large statistic.
        assert!(
            stat > chi_square_critical(df),
            "fit test cannot tell {params:?} from {other:?}"
        );
    }
}

#[test]
fn reference_filters_keep_the_expected_sets() {
    // Hand-derived kept sets of the naive reference for ROW (guards the reference itself).
    let row = &ROW[..VALID];
    let set = |p: SamplingParams| kept(&naive_distribution(row, &p, &[], &[]));
    assert_eq!(set(params(1.0, 3, 1.0, 0.0, 0)), vec![0, 1, 2]);
    // Cumulative mass reaches 0.70 after three tokens and 0.82 after four.
    assert_eq!(set(params(1.0, 0, 0.8, 0.0, 0)), vec![0, 1, 2, 3]);
    // e^(0.5 - 2) = 0.223 >= 0.2, e^(0 - 2) = 0.135 < 0.2.
    assert_eq!(set(params(1.0, 0, 1.0, 0.2, 0)), vec![0, 1, 2, 3, 4]);
    // top-k 6, then top-p 0.9 of those keeps 4, then min-p 0.3 drops token 3 (ratio 0.24).
    assert_eq!(set(params(0.7, 6, 0.9, 0.3, 0)), vec![0, 1, 2]);
    assert_eq!(set(params(1.0, 0, 1.0, 0.0, 0)).len(), 10);
}

#[test]
fn temperature_scales_the_distribution() {
    for (t, seed) in [(1.0, 1), (0.5, 2), (2.0, 3)] {
        let p = params(t, 0, 1.0, 0.0, seed);
        let other = (t != 1.0).then(|| params(1.0, 0, 1.0, 0.0, 0));
        check(&ROW, VALID, &p, &[], &[], other.as_ref());
    }
}

#[test]
fn top_k_keeps_the_k_most_likely() {
    for (k, seed) in [(1, 4), (3, 5), (7, 6)] {
        check(
            &ROW,
            VALID,
            &params(1.0, k, 1.0, 0.0, seed),
            &[],
            &[],
            Some(&params(1.0, k + 1, 1.0, 0.0, 0)),
        );
    }
}

#[test]
fn top_p_keeps_the_nucleus() {
    for (p, seed) in [(0.8, 7), (0.5, 8), (0.95, 9)] {
        check(
            &ROW,
            VALID,
            &params(1.0, 0, p, 0.0, seed),
            &[],
            &[],
            Some(&params(1.0, 0, 1.0, 0.0, 0)),
        );
    }
    // A tiny top-p keeps only the most likely token.
    let counts = sample_counts(&ROW, VALID, &params(1.0, 0, 0.01, 0.0, 10), &[], &[], 2000);
    assert_eq!(counts[0], 2000);
}

#[test]
fn min_p_drops_tokens_below_the_ratio() {
    for (m, seed) in [(0.2, 11), (0.05, 12), (0.5, 13)] {
        check(
            &ROW,
            VALID,
            &params(1.0, 0, 1.0, m, seed),
            &[],
            &[],
            Some(&params(1.0, 0, 1.0, 0.0, 0)),
        );
    }
}

#[test]
fn filters_combine_in_order() {
    let p = params(0.7, 6, 0.9, 0.3, 14);
    check(
        &ROW,
        VALID,
        &p,
        &[],
        &[],
        Some(&params(0.7, 6, 0.9, 0.0, 0)),
    );
    check(
        &ROW,
        VALID,
        &params(0.7, 6, 0.9, 0.05, 15),
        &[],
        &[],
        Some(&params(0.7, 6, 1.0, 0.05, 0)),
    );
    check(
        &ROW,
        VALID,
        &params(1.3, 5, 0.97, 0.0, 16),
        &[],
        &[],
        Some(&params(1.3, 0, 0.97, 0.0, 0)),
    );
}

#[test]
fn penalties_and_bias_shift_the_distribution() {
    let p = SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.2,
        presence_penalty: 0.3,
        logit_bias: vec![(5, 2.0), (1, -0.7)],
        top_p: 0.95,
        seed: Some(17),
        ..SamplingParams::default()
    };
    let plain = SamplingParams {
        top_p: 0.95,
        ..SamplingParams::default()
    };
    check(&ROW, VALID, &p, &[0, 6], &[1, 1, 2], Some(&plain));
}

/// A wider row with a realistic spread exercises the bucketed selection of top-k and top-p.
#[test]
fn wide_rows_match_the_reference() {
    let mut rng = Rng::seeded(2024);
    let n = 8_192;
    let mut row: Vec<f32> = (0..n)
        .map(|_| {
            let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 2.0) as f32
        })
        .collect();
    for (i, b) in [(17usize, 9.0f32), (4000, 8.5), (5432, 8.0), (8191, 7.0)] {
        row[i] += b;
    }
    let valid = n - 100;
    for p in [
        params(0.7, 50, 1.0, 0.0, 21),
        params(0.7, 50, 0.9, 0.0, 22),
        params(0.8, 0, 0.6, 0.0, 23),
    ] {
        let want = naive_distribution(&row[..valid], &p, &[], &[]);
        let counts = sample_counts(&row, valid, &p, &[], &[], DRAWS);
        for (i, &c) in counts.iter().enumerate() {
            assert!(
                c == 0 || (i < valid && want[i] > 0.0),
                "token {i} drawn outside the kept set under {p:?}"
            );
        }
        let (stat, df) = chi_square(&counts[..valid], &want);
        assert!(
            stat < chi_square_critical(df),
            "chi2 {stat:.1} (df {df}) under {p:?}"
        );
    }
}
