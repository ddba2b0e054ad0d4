//! Time per sampled token on a full-width row (248,320 lm_head outputs, 248,077 real tokens).
//!
//! `cargo bench -p sanmai-engine --bench sampler`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use sanmai_engine::sampler::{
    sample_row, Rng, SampleRequest, Sampler, SamplerState, SamplingParams, Scratch,
};

const WIDTH: usize = 248_320;
const VALID: usize = 248_077;

/// Gaussian logits (σ = 2.5) with a handful of strong candidates, roughly the shape of an LM's output.
fn logits(seed: u64) -> Vec<f32> {
    let mut rng = Rng::seeded(seed);
    let mut row: Vec<f32> = (0..WIDTH)
        .map(|_| {
            let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 2.5) as f32
        })
        .collect();
    for (i, boost) in [
        (1_000usize, 14.0f32),
        (52_000, 13.0),
        (170_001, 12.5),
        (9, 11.0),
    ] {
        row[i] += boost;
    }
    row
}

fn bench_single(c: &mut Criterion) {
    let row = logits(1);
    let cases = [
        ("greedy", SamplingParams::greedy()),
        (
            "top_p0.9_top_k50_t0.7",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 50,
                seed: Some(1),
                ..SamplingParams::default()
            },
        ),
        (
            "top_p0.9_t1.0",
            SamplingParams {
                top_p: 0.9,
                seed: Some(1),
                ..SamplingParams::default()
            },
        ),
        (
            "t1.0_plain",
            SamplingParams {
                seed: Some(1),
                ..SamplingParams::default()
            },
        ),
        (
            "min_p0.05_t0.8_logprobs5",
            SamplingParams {
                temperature: 0.8,
                min_p: 0.05,
                logprobs: Some(5),
                seed: Some(1),
                ..SamplingParams::default()
            },
        ),
    ];
    let mut group = c.benchmark_group("sample_row_248k");
    for (name, params) in cases {
        let mut state = SamplerState::new(&params, &[]);
        let mut scratch = Scratch::new();
        // Without penalties, bias or mask the row is left as it was, so one copy serves every iteration.
        let mut work = row.clone();
        group.bench_function(name, |b| {
            b.iter(|| {
                sample_row(&mut work, VALID, &params, &mut state, None, &mut scratch).unwrap()
            })
        });
    }
    let params = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 50,
        repetition_penalty: 1.1,
        frequency_penalty: 0.5,
        presence_penalty: 0.5,
        seed: Some(1),
        ..SamplingParams::default()
    };
    let prompt: Vec<u32> = (0..4096u32).map(|i| (i * 7919) % VALID as u32).collect();
    let mut state = SamplerState::new(&params, &prompt);
    for t in prompt.iter().take(512) {
        state.accept(*t);
    }
    let mut scratch = Scratch::new();
    group.bench_function("penalties_4k_prompt_plus_copy", |b| {
        b.iter_batched_ref(
            || row.clone(),
            |work| sample_row(work, VALID, &params, &mut state, None, &mut scratch).unwrap(),
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

fn bench_batch(c: &mut Criterion) {
    const ROWS: usize = 16;
    let mut batch: Vec<f32> = (0..ROWS as u64).flat_map(logits).collect();
    let params = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 50,
        ..SamplingParams::default()
    };
    let mut states: Vec<SamplerState> =
        (0..ROWS).map(|_| SamplerState::new(&params, &[])).collect();
    let sampler = Sampler::new(VALID);
    c.bench_function("sample_batch_16x248k_top_p0.9_top_k50_t0.7", |b| {
        b.iter(|| {
            let mut reqs: Vec<SampleRequest<'_>> = states
                .iter_mut()
                .map(|state| SampleRequest {
                    params: &params,
                    state,
                    allowed: None,
                })
                .collect();
            sampler.sample_batch(&mut batch, WIDTH, &mut reqs).unwrap()
        })
    });
}

criterion_group!(benches, bench_single, bench_batch);
criterion_main!(benches);
