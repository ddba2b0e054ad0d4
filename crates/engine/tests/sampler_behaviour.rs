//! Deterministic behaviour of the sampler: greedy, penalties, bias, masks, padding, seeds, logprobs,
//! batches and validation.

mod common;

use common::{naive_edited, naive_log_softmax};
use sanmai_engine::sampler::penalties::{apply_logit_bias, apply_penalties};
use sanmai_engine::sampler::{
    sample_row, token_logprob, ParamError, Rng, RowLogprobs, SampleError, SampleRequest, Sampled,
    Sampler, SamplerState, SamplingParams, Scratch, TokenCounts,
};

fn sample(
    row: &[f32],
    valid: usize,
    params: &SamplingParams,
    state: &mut SamplerState,
) -> Result<Sampled, SampleError> {
    let mut work = row.to_vec();
    sample_row(&mut work, valid, params, state, None, &mut Scratch::new())
}

fn sample_masked(
    row: &[f32],
    valid: usize,
    params: &SamplingParams,
    mask: &[u32],
) -> Result<Sampled, SampleError> {
    let mut work = row.to_vec();
    let mut state = SamplerState::new(params, &[]);
    sample_row(
        &mut work,
        valid,
        params,
        &mut state,
        Some(mask),
        &mut Scratch::new(),
    )
}

/// A reproducible row of `n` logits, roughly normal with spread `sigma`.
fn noisy_row(n: usize, sigma: f64, seed: u64) -> Vec<f32> {
    let mut rng = Rng::seeded(seed);
    (0..n)
        .map(|_| {
            let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * sigma) as f32
        })
        .collect()
}

fn seeded(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

#[test]
fn greedy_takes_the_argmax_with_lowest_id_on_ties() {
    let mut row = noisy_row(5000, 2.0, 1);
    row[3000] = 40.0;
    row[1234] = 40.0;
    row[4999] = 40.0;
    let greedy = SamplingParams::greedy();
    let mut state = SamplerState::new(&greedy, &[]);
    assert_eq!(sample(&row, 5000, &greedy, &mut state).unwrap().id, 1234);
    // Temperatures under the greedy cut-off behave the same.
    assert_eq!(
        sample(&row, 5000, &seeded(1e-6, 9), &mut state).unwrap().id,
        1234
    );
    // Padding past valid_vocab is never chosen, however large.
    row[4999] = 1000.0;
    assert_eq!(sample(&row, 4999, &greedy, &mut state).unwrap().id, 1234);
}

#[test]
fn penalties_produce_the_vllm_logits_exactly() {
    let logits = [2.0f32, -1.0, 0.5, 3.0, -2.0, 0.0];
    let mut counts = TokenCounts::from_prompt(&[0, 1]);
    for t in [2, 2, 3] {
        counts.add_output_token(t);
    }
    let params = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..SamplingParams::default()
    };
    let mut row = logits;
    let mut edits = Vec::new();
    assert!(apply_penalties(&mut row, &counts, &params, &mut edits));
    // 0: prompt only, positive -> halved. 1: prompt only, negative -> doubled.
    // 2: output twice -> 0.5/2 - (0.5·2 + 0.25). 3: output once -> 3/2 - (0.5 + 0.25). 4, 5 untouched.
    assert_eq!(row, [1.0, -2.0, -1.0, 0.75, -2.0, 0.0]);
    let want = naive_edited(&logits, &params, &[0, 1], &[2, 2, 3]);
    for (got, want) in row.iter().zip(&want) {
        assert_eq!(*got as f64, *want);
    }
    // Frequency and presence alone leave prompt-only tokens alone.
    let mut row = logits;
    let fp = SamplingParams {
        frequency_penalty: 1.0,
        presence_penalty: 1.0,
        ..SamplingParams::default()
    };
    apply_penalties(&mut row, &counts, &fp, &mut edits);
    assert_eq!(row, [2.0, -1.0, -2.5, 1.0, -2.0, 0.0]);
    // Negative penalties reward repetition.
    let mut row = logits;
    let neg = SamplingParams {
        presence_penalty: -1.5,
        ..SamplingParams::default()
    };
    apply_penalties(&mut row, &counts, &neg, &mut edits);
    assert_eq!(row, [2.0, -1.0, 2.0, 4.5, -2.0, 0.0]);
}

#[test]
fn penalties_steer_greedy_through_accepted_tokens() {
    let row = [5.0f32, 4.0, 3.0, 1.0];
    let params = SamplingParams {
        frequency_penalty: 0.6,
        ..SamplingParams::greedy()
    };
    let mut state = SamplerState::new(&params, &[]);
    // Each accepted token is penalised 0.6 per occurrence: the argmax rotates as counts grow.
    let mut got = Vec::new();
    for _ in 0..6 {
        let id = sample(&row, 4, &params, &mut state).unwrap().id;
        state.accept(id);
        got.push(id);
    }
    // Adjusted logits per step: 5,4 | 4.4,4 | 3.8,4 | 3.8,3.4 | 3.2,3.4,3 | 3.2,2.8,3.
    assert_eq!(got, [0, 0, 1, 0, 1, 0]);
    assert_eq!(
        (
            state.counts().output_count(0),
            state.counts().output_count(1)
        ),
        (4, 2)
    );
    // Repetition penalty counts prompt tokens too: 5/3 < 4, so token 1 wins.
    let rep = SamplingParams {
        repetition_penalty: 3.0,
        ..SamplingParams::greedy()
    };
    let mut state = SamplerState::new(&rep, &[0, 0]);
    assert_eq!(sample(&row, 4, &rep, &mut state).unwrap().id, 1);
    // Without a penalty nothing is tracked.
    let mut plain = SamplerState::new(&SamplingParams::greedy(), &[0, 1]);
    plain.accept(0);
    assert_eq!(plain.counts().distinct(), 0);
}

#[test]
fn logit_bias_moves_the_choice_but_not_the_reported_logprob() {
    let row = noisy_row(3000, 1.0, 2);
    let raw = naive_log_softmax(&row);
    let params = SamplingParams {
        logit_bias: vec![(2222, 100.0)],
        logprobs: Some(3),
        ..SamplingParams::greedy()
    };
    let mut state = SamplerState::new(&params, &[]);
    let s = sample(&row, 3000, &params, &mut state).unwrap();
    assert_eq!(s.id, 2222);
    assert!(
        (s.logprob as f64 - raw[2222]).abs() < 1e-5,
        "{} vs {}",
        s.logprob,
        raw[2222]
    );
    // Top alternatives come from the raw distribution: the biased token is not among them.
    assert!(s.top_logprobs.iter().all(|&(id, _)| id != 2222));
    // A strong negative bias excludes a token from sampling.
    let top = (0..3000)
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap() as u32;
    let params = SamplingParams {
        logit_bias: vec![(top, -100.0)],
        temperature: 0.3,
        seed: Some(4),
        ..SamplingParams::default()
    };
    let mut state = SamplerState::new(&params, &[]);
    for _ in 0..2000 {
        assert_ne!(sample(&row, 3000, &params, &mut state).unwrap().id, top);
    }
    let mut edits = Vec::new();
    let mut r = [1.0f32, 2.0];
    apply_logit_bias(&mut r, &[(1, -0.5), (7, 3.0)], &mut edits);
    assert_eq!(r, [1.0, 1.5]);
}

#[test]
fn padding_ids_are_never_sampled() {
    let width = 1000;
    let valid = 937;
    let mut row = noisy_row(width, 1.0, 3);
    for z in &mut row[valid..] {
        *z = 30.0;
    }
    for params in [
        seeded(1.5, 5),
        SamplingParams {
            top_k: 40,
            top_p: 0.9,
            ..seeded(1.0, 6)
        },
        SamplingParams {
            top_p: 0.5,
            ..seeded(2.0, 7)
        },
        SamplingParams {
            min_p: 0.1,
            ..seeded(1.0, 8)
        },
        SamplingParams {
            logprobs: Some(20),
            ..SamplingParams::greedy()
        },
    ] {
        let mut state = SamplerState::new(&params, &[]);
        let mut scratch = Scratch::new();
        let mut work = row.clone();
        for _ in 0..3000 {
            work.copy_from_slice(&row);
            let s = sample_row(&mut work, valid, &params, &mut state, None, &mut scratch).unwrap();
            assert!(
                (s.id as usize) < valid,
                "{params:?} sampled padding id {}",
                s.id
            );
            assert!(s.top_logprobs.iter().all(|&(id, _)| (id as usize) < valid));
        }
    }
}

#[test]
fn allowed_mask_restricts_the_choice() {
    let row = noisy_row(200, 1.0, 4);
    let allowed_ids = [3u32, 64, 65, 150, 199];
    let mut mask = vec![0u32; 7];
    for &i in &allowed_ids {
        mask[i as usize / 32] |= 1 << (i % 32);
    }
    let mut state = SamplerState::new(&seeded(2.0, 10), &[]);
    let mut seen = std::collections::BTreeSet::new();
    let mut scratch = Scratch::new();
    for _ in 0..2000 {
        let mut work = row.clone();
        let s = sample_row(
            &mut work,
            200,
            &seeded(2.0, 10),
            &mut state,
            Some(&mask),
            &mut scratch,
        )
        .unwrap();
        assert!(allowed_ids.contains(&s.id));
        seen.insert(s.id);
    }
    assert_eq!(seen.len(), allowed_ids.len());
    let best = *allowed_ids
        .iter()
        .max_by(|&&a, &&b| row[a as usize].total_cmp(&row[b as usize]))
        .unwrap();
    assert_eq!(
        sample_masked(&row, 200, &SamplingParams::greedy(), &mask)
            .unwrap()
            .id,
        best
    );
    assert_eq!(
        sample_masked(&row, 200, &SamplingParams::greedy(), &[0; 7]),
        Err(SampleError::NoCandidates)
    );
}

#[test]
fn seeds_reproduce_and_unseeded_requests_differ() {
    let row = noisy_row(50_000, 1.5, 5);
    let run = |params: &SamplingParams| -> Vec<u32> {
        let mut state = SamplerState::new(params, &[1, 2, 3]);
        (0..100)
            .map(|_| {
                let id = sample(&row, 50_000, params, &mut state).unwrap().id;
                state.accept(id);
                id
            })
            .collect()
    };
    for base in [
        seeded(1.0, 42),
        SamplingParams {
            top_k: 20,
            top_p: 0.8,
            ..seeded(0.7, 42)
        },
        SamplingParams {
            top_p: 0.95,
            presence_penalty: 0.5,
            ..seeded(1.2, 42)
        },
    ] {
        let a = run(&base);
        assert_eq!(a, run(&base), "same seed, same tokens under {base:?}");
        let other = SamplingParams {
            seed: Some(43),
            ..base.clone()
        };
        assert_ne!(a, run(&other));
        let unseeded = SamplingParams { seed: None, ..base };
        assert_ne!(run(&unseeded), run(&unseeded));
    }
}

#[test]
fn logprobs_match_a_naive_log_softmax() {
    let width = 20_000;
    let valid = 19_900;
    let mut row = noisy_row(width, 3.0, 6);
    // Exact ties among the leaders: lower ids must come first.
    row[700] = 15.0;
    row[90] = 15.0;
    row[15_000] = 14.0;
    let raw = naive_log_softmax(&row[..valid]);
    let mut ranked: Vec<usize> = (0..valid).collect();
    ranked.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let params = SamplingParams {
        logprobs: Some(20),
        temperature: 0.6,
        top_k: 30,
        repetition_penalty: 1.4,
        frequency_penalty: 0.3,
        seed: Some(11),
        ..SamplingParams::default()
    };
    let mut state = SamplerState::new(&params, &[90, 700]);
    state.accept(15_000);
    for _ in 0..200 {
        let s = sample(&row, valid, &params, &mut state).unwrap();
        assert!((s.logprob as f64 - raw[s.id as usize]).abs() < 2e-5);
        assert_eq!(s.top_logprobs.len(), 20);
        for (k, &(id, lp)) in s.top_logprobs.iter().enumerate() {
            assert_eq!(id as usize, ranked[k], "rank {k}");
            assert!((lp as f64 - raw[id as usize]).abs() < 2e-5);
        }
    }
    assert_eq!(ranked[0..3], [90, 700, 15_000]);
    // Without a request for alternatives, none are returned, but the chosen logprob still is.
    let mut state = SamplerState::new(&seeded(1.0, 12), &[]);
    let s = sample(&row, valid, &seeded(1.0, 12), &mut state).unwrap();
    assert!(s.top_logprobs.is_empty());
    assert!((s.logprob as f64 - raw[s.id as usize]).abs() < 2e-5);
    // The stand-alone helpers agree (prompt logprobs / echo).
    let lp = RowLogprobs::new(&row, valid).unwrap();
    for t in [0u32, 90, 700, 12_345, valid as u32 - 1] {
        assert!((lp.logprob(t).unwrap() as f64 - raw[t as usize]).abs() < 2e-5);
        assert_eq!(
            token_logprob(&row, valid, t).unwrap(),
            lp.logprob(t).unwrap()
        );
    }
    let top = lp.top(5);
    assert_eq!(
        top.iter().map(|e| e.0 as usize).collect::<Vec<_>>(),
        ranked[..5]
    );
    assert_eq!(
        token_logprob(&row, valid, valid as u32),
        Err(SampleError::TokenOutOfRange {
            token: valid as u32,
            valid_vocab: valid
        })
    );
}

#[test]
fn batches_match_single_rows_and_check_their_shape() {
    let width = 4096;
    let valid = 4000;
    let rows: Vec<Vec<f32>> = (0..9).map(|i| noisy_row(width, 2.0, 100 + i)).collect();
    let params: Vec<SamplingParams> = (0..9)
        .map(|i| SamplingParams {
            temperature: [0.0, 0.7, 1.0][i % 3],
            top_k: [0, 50, 5][i % 3],
            top_p: [1.0, 0.9, 0.8][(i / 3) % 3],
            logprobs: Some(i % 4),
            seed: Some(i as u64),
            ..SamplingParams::default()
        })
        .collect();
    let sampler = Sampler::new(valid);
    let mut batch_states: Vec<SamplerState> =
        params.iter().map(|p| SamplerState::new(p, &[])).collect();
    let mut single_states = batch_states.clone();
    for _step in 0..20 {
        let mut flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let mut reqs: Vec<SampleRequest<'_>> = params
            .iter()
            .zip(batch_states.iter_mut())
            .map(|(params, state)| SampleRequest {
                params,
                state,
                allowed: None,
            })
            .collect();
        let got = sampler.sample_batch(&mut flat, width, &mut reqs).unwrap();
        for i in 0..9 {
            let want = sample(&rows[i], valid, &params[i], &mut single_states[i]);
            assert_eq!(got[i], want, "row {i}");
        }
    }
    let mut reqs: Vec<SampleRequest<'_>> = params
        .iter()
        .zip(batch_states.iter_mut())
        .map(|(params, state)| SampleRequest {
            params,
            state,
            allowed: None,
        })
        .collect();
    let mut short = vec![0.0; width * 9 - 1];
    assert!(matches!(
        sampler.sample_batch(&mut short, width, &mut reqs),
        Err(SampleError::BatchShape { .. })
    ));
    assert!(matches!(
        sampler.sample_batch(&mut [], 0, &mut reqs),
        Err(SampleError::BatchShape { .. })
    ));
    assert_eq!(sampler.sample_batch(&mut [], width, &mut []), Ok(vec![]));
}

#[test]
fn validation_names_the_field() {
    let ok = SamplingParams::default();
    assert_eq!(ok.validate(100), Ok(()));
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                temperature: -0.1,
                ..ok.clone()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..ok.clone()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::INFINITY,
                ..ok.clone()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..ok.clone()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.01,
                ..ok.clone()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_k: -2,
                ..ok.clone()
            },
            "top_k",
        ),
        (
            SamplingParams {
                min_p: -0.01,
                ..ok.clone()
            },
            "min_p",
        ),
        (
            SamplingParams {
                min_p: 1.5,
                ..ok.clone()
            },
            "min_p",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..ok.clone()
            },
            "repetition_penalty",
        ),
        (
            SamplingParams {
                repetition_penalty: -1.0,
                ..ok.clone()
            },
            "repetition_penalty",
        ),
        (
            SamplingParams {
                presence_penalty: 2.5,
                ..ok.clone()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                presence_penalty: f32::NAN,
                ..ok.clone()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: -2.01,
                ..ok.clone()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                logprobs: Some(21),
                ..ok.clone()
            },
            "logprobs",
        ),
        (
            SamplingParams {
                logit_bias: vec![(100, 1.0)],
                ..ok.clone()
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                logit_bias: vec![(5, f32::INFINITY)],
                ..ok.clone()
            },
            "logit_bias",
        ),
    ];
    for (params, field) in cases {
        let err = params.validate(100).unwrap_err();
        assert_eq!(err.field(), field, "{params:?}");
        // No request can carry them: the engine takes only what `validated` gives, and it refuses them.
        let refused = params.clone().validated(100).unwrap_err();
        assert_eq!(refused.field(), field, "{params:?}");
    }
    assert_eq!(
        SamplingParams {
            logit_bias: vec![(100, 1.0)],
            ..ok.clone()
        }
        .validate(100),
        Err(ParamError::LogitBiasToken {
            token: 100,
            vocab_size: 100
        })
    );
    // Boundary values are accepted.
    for params in [
        SamplingParams {
            top_p: 1.0,
            top_k: -1,
            min_p: 1.0,
            ..ok.clone()
        },
        SamplingParams {
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logprobs: Some(20),
            ..ok.clone()
        },
        SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(99, -100.0)],
            ..ok.clone()
        },
    ] {
        assert_eq!(params.validate(100), Ok(()), "{params:?}");
        assert_eq!(*params.clone().validated(100).unwrap(), params);
    }
}

#[test]
fn degenerate_rows_are_errors_not_panics() {
    let mut state = SamplerState::new(&SamplingParams::default(), &[]);
    let p = SamplingParams::default();
    assert_eq!(
        sample(&[f32::NEG_INFINITY; 8], 8, &p, &mut state),
        Err(SampleError::NoCandidates)
    );
    assert_eq!(
        sample(&[f32::NAN; 8], 8, &p, &mut state),
        Err(SampleError::NoCandidates)
    );
    assert_eq!(
        sample(&[0.0, f32::INFINITY], 2, &p, &mut state),
        Err(SampleError::InfiniteLogit)
    );
    assert!(matches!(
        sample(&[0.0; 8], 9, &p, &mut state),
        Err(SampleError::Vocab { .. })
    ));
    assert!(matches!(
        sample(&[0.0; 8], 0, &p, &mut state),
        Err(SampleError::Vocab { .. })
    ));
    // NaN entries are skipped, the rest still sample.
    let row = [f32::NAN, 1.0, f32::NAN, 2.0];
    for _ in 0..100 {
        let s = sample(&row, 4, &p, &mut state).unwrap();
        assert!(s.id == 1 || s.id == 3);
        assert!(s.logprob.is_finite());
    }
}
