//! Sampling through the backend's op (`Backend::sample`, here the CPU backend's host implementation of
//! it) gives the tokens host sampling gives: the engine reserves each draw's uniform when it plans the
//! step, so seeded requests draw the same tokens whichever side samples them. A step mixing rows the op
//! can draw with rows it cannot (top-N logprobs) samples the former through the op and returns only the
//! latter's logits.

#[macro_use]
mod wrap;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, StopParams};
use sanmai_engine::executor::{StepLogits, StepPlan};
use sanmai_engine::sampler::{
    row_sampling, sample_row, Rng, SamplerState, SamplingParams, Scratch,
};
use sanmai_engine::{start, EngineConfig, Executor, ModelExecutor};
use sanmai_model::{builtin, Backend, Model, SampleCall};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::Dummy;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::builtin().unwrap())
}

fn config() -> EngineConfig {
    EngineConfig {
        model_name: "test".into(),
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 4096,
        max_waiting: 100,
        default_max_tokens: Some(64),
        valid_vocab: tokenizer().backend().get_vocab_size(true),
        eos_ids: vec![248046, 248044],
        block_size: 16,
        kv_cache_memory_bytes: 1 << 30,
        enable_prefix_caching: true,
        state_checkpoint_interval: Some(64),
        num_speculative_tokens: 0,
    }
}

/// The model executor, counting the steps in which it sampled rows itself, and of those the steps that
/// also returned logits.
struct Probe {
    inner: ModelExecutor<CpuBackend>,
    sampled_steps: Arc<AtomicUsize>,
    mixed_steps: Arc<AtomicUsize>,
}

impl Executor for Probe {
    hand_on_cache_ops!();
    fn alloc_state(&mut self) -> Result<usize, String> {
        self.inner.alloc_state()
    }
    fn free_state(&mut self, slot: usize) {
        self.inner.free_state(slot)
    }
    fn submit(&mut self, plan: StepPlan) {
        self.inner.submit(plan)
    }
    fn wait(&mut self) -> (StepPlan, Result<StepLogits, String>) {
        let (plan, out) = self.inner.wait();
        if let Ok(o) = &out {
            if o.sampled.iter().any(Option::is_some) {
                self.sampled_steps.fetch_add(1, Ordering::Relaxed);
                if !o.host.is_empty() {
                    self.mixed_steps.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        (plan, out)
    }
}

fn executor(device: bool) -> (Probe, [Arc<AtomicUsize>; 2]) {
    let mut inner = ModelExecutor::new(
        Model::load(
            builtin::config(),
            &Dummy::new(builtin::SEED),
            CpuBackend::new(),
        )
        .unwrap(),
    );
    inner.set_device_sampling(device);
    let counts = [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))];
    (
        Probe {
            inner,
            sampled_steps: counts[0].clone(),
            mixed_steps: counts[1].clone(),
        },
        counts,
    )
}

/// One seeded request per parameter kind (and one of everything at once).
fn cases() -> Vec<(SamplingParams, StopParams)> {
    let seeded = |seed: u64| SamplingParams {
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let free = StopParams {
        max_tokens: Some(24),
        ignore_eos: true,
        ..Default::default()
    };
    let sampling = vec![
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.7,
            ..seeded(1)
        },
        SamplingParams {
            temperature: 1.3,
            ..seeded(2)
        },
        SamplingParams {
            top_k: 5,
            ..seeded(3)
        },
        SamplingParams {
            top_p: 0.6,
            temperature: 0.9,
            ..seeded(4)
        },
        SamplingParams {
            min_p: 0.2,
            ..seeded(5)
        },
        SamplingParams {
            top_k: 40,
            top_p: 0.8,
            temperature: 0.6,
            ..seeded(6)
        },
        SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.4,
            presence_penalty: 0.3,
            ..seeded(7)
        },
        SamplingParams {
            logit_bias: vec![(11, 2.0), (220, -3.0), (11, 0.5)],
            ..seeded(8)
        },
        SamplingParams {
            temperature: 0.8,
            top_k: 30,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            frequency_penalty: 0.2,
            presence_penalty: 0.1,
            logit_bias: vec![(13, 1.0)],
            logprobs: Some(0),
            ..seeded(9)
        },
        SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::greedy()
        },
        // Top-N logprobs: sampled on the host, beside the rows the op draws.
        SamplingParams {
            temperature: 0.9,
            logprobs: Some(3),
            ..seeded(11)
        },
    ];
    let mut out: Vec<_> = sampling.into_iter().map(|s| (s, free.clone())).collect();
    // End tokens are masked until min_tokens (they may end the request afterwards).
    out.push((
        seeded(10),
        StopParams {
            max_tokens: Some(24),
            min_tokens: 12,
            stop_token_ids: vec![11, 13],
            ..Default::default()
        },
    ));
    out
}

/// A request's token ids and their logprobs.
type Generated = (Vec<u32>, Vec<f32>);

/// What every case generated, run concurrently on one engine, and the steps in which the executor
/// sampled rows (of them, the steps that also returned logits).
fn run(device: bool) -> (Vec<Generated>, usize, usize) {
    let (exec, [sampled_steps, mixed_steps]) = executor(device);
    let h = start(exec, Some(tokenizer().clone()), config()).unwrap();
    let streams: Vec<_> = cases()
        .into_iter()
        .enumerate()
        .map(|(i, (sampling, stop))| {
            let req = EngineRequest {
                id: format!("r{i}"),
                prompt: tokenizer()
                    .encode(&format!("Sampling case {i}: the quick brown fox"), false)
                    .unwrap(),
                sampling: sampling.validated(h.info().valid_vocab).unwrap(),
                stop,
                prompt_logprobs: false,
                cache_salt: Vec::new(),
                checkpoint_at: Vec::new(),
                images: None,
            };
            h.submit(req).unwrap()
        })
        .collect();
    let outs = streams
        .into_iter()
        .map(|mut s| {
            let (mut ids, mut lps) = (Vec::new(), Vec::new());
            while let Some(ev) = s.blocking_recv() {
                if let EngineEvent::Tokens {
                    ids: t, logprobs, ..
                } = ev
                {
                    ids.extend(t);
                    lps.extend(logprobs.iter().map(|l| l.logprob));
                }
            }
            (ids, lps)
        })
        .collect();
    (
        outs,
        sampled_steps.load(Ordering::Relaxed),
        mixed_steps.load(Ordering::Relaxed),
    )
}

#[test]
fn the_backend_op_samples_the_tokens_host_sampling_does() {
    let (host, host_steps, _) = run(false);
    let (device, device_steps, mixed_steps) = run(true);
    assert_eq!(host_steps, 0);
    assert!(device_steps > 10, "{device_steps} steps sampled by the op");
    assert!(
        mixed_steps > 10,
        "{mixed_steps} steps sampled rows by the op and returned the top-N row's logits"
    );
    for (i, (h, d)) in host.iter().zip(&device).enumerate() {
        assert!(!h.0.is_empty(), "case {i} produced nothing");
        assert_eq!(h.0, d.0, "case {i}: token ids");
        assert_eq!(h.1, d.1, "case {i}: logprobs");
    }
}

#[test]
fn the_op_matches_sample_row_with_a_mask_and_every_filter() {
    let (width, valid) = (3000usize, 2990usize);
    let mut rng = Rng::seeded(17);
    let rows: Vec<Vec<f32>> = (0..6)
        .map(|_| {
            (0..width)
                .map(|_| (rng.next_f64() * 12.0 - 6.0) as f32)
                .collect()
        })
        .collect();
    let mut mask = vec![0u32; valid.div_ceil(32)];
    for i in (0..valid).filter(|i| i % 3 != 1) {
        mask[i / 32] |= 1 << (i % 32);
    }
    let params: Vec<SamplingParams> = (0..6)
        .map(|i| SamplingParams {
            temperature: [0.0, 0.7, 1.0, 1.4, 0.9, 1.1][i],
            top_k: [0, 0, 20, 0, 300, 0][i],
            top_p: [1.0, 0.9, 1.0, 0.5, 0.95, 1.0][i],
            min_p: [0.0, 0.0, 0.0, 0.0, 0.01, 0.1][i],
            repetition_penalty: [1.0, 1.5, 1.0, 0.8, 1.2, 1.0][i],
            frequency_penalty: [0.0, 0.3, 0.0, 0.0, 0.5, 0.0][i],
            logit_bias: vec![(7, 1.5)],
            seed: Some(i as u64),
            ..SamplingParams::default()
        })
        .collect();
    let backend = CpuBackend::new();
    let mut host_states: Vec<SamplerState> = params
        .iter()
        .map(|p| {
            let mut s = SamplerState::new(p, &[1, 2, 3, 7]);
            s.accept(5);
            s.accept(5);
            s
        })
        .collect();
    let mut op_states = host_states.clone();
    for step in 0..50 {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let uniforms: Vec<f64> = op_states
            .iter_mut()
            .zip(&params)
            .map(|(s, p)| if p.is_greedy() { 0.0 } else { s.take_uniform() })
            .collect();
        let specs: Vec<_> = (0..6)
            .map(|i| {
                let allowed = (i % 2 == 1).then_some(mask.as_slice());
                row_sampling(&params[i], op_states[i].counts(), allowed, uniforms[i])
            })
            .collect();
        let call = SampleCall {
            valid_vocab: valid,
            rows: &specs,
        };
        let got = backend
            .sample(backend.upload(6, width, flat).unwrap(), &call)
            .unwrap();
        for i in 0..6 {
            let mut row = rows[i].clone();
            let allowed = (i % 2 == 1).then_some(mask.as_slice());
            let want = sample_row(
                &mut row,
                valid,
                &params[i],
                &mut host_states[i],
                allowed,
                &mut Scratch::new(),
            )
            .unwrap();
            let g = got[i].unwrap();
            assert_eq!(
                (g.id, g.logprob),
                (want.id, want.logprob),
                "step {step} row {i}"
            );
            if allowed.is_some() {
                assert_ne!(g.id % 3, 1, "a masked token was drawn");
            }
            host_states[i].accept(want.id);
            op_states[i].accept(g.id);
        }
    }
}
