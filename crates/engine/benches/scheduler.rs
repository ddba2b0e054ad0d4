//! Engine overhead with many running sequences: the time each step spends outside the model (scheduling,
//! block bookkeeping, sampling, detokenizing, events), on the built-in model. Prints numbers; asserts nothing.
//!
//! `cargo bench -p sanmai-engine --bench scheduler`

use std::time::Instant;

use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, StopParams};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, ModelExecutor};
use sanmai_model::{builtin, Model};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::Dummy;

fn main() {
    let tok = Tokenizer::builtin().unwrap();
    for &(seqs, sampled) in &[(256usize, false), (256, true)] {
        let model = Model::load(
            builtin::config(),
            &Dummy::new(builtin::SEED),
            CpuBackend::new(),
        )
        .unwrap();
        let h = start(
            ModelExecutor::new(model),
            Some(tok.clone()),
            EngineConfig {
                model_name: "bench".into(),
                max_num_seqs: seqs,
                max_num_batched_tokens: 8192,
                max_model_len: 4096,
                max_waiting: 10_000,
                default_max_tokens: None,
                valid_vocab: tok.backend().get_vocab_size(true),
                eos_ids: vec![],
                block_size: 16,
                kv_cache_memory_bytes: 1 << 30,
                enable_prefix_caching: true,
                state_checkpoint_interval: None,
                num_speculative_tokens: 0,
            },
        )
        .unwrap();
        let gen = 32;
        let streams: Vec<_> = (0..seqs)
            .map(|i| {
                let sampling = if sampled {
                    SamplingParams {
                        temperature: 0.8,
                        top_p: 0.95,
                        top_k: 50,
                        seed: Some(i as u64),
                        ..Default::default()
                    }
                } else {
                    SamplingParams::greedy()
                }
                .validated(h.info().valid_vocab)
                .unwrap();
                h.submit(EngineRequest {
                    id: format!("r{i}"),
                    prompt: tok
                        .encode(&format!("request number {i}: tell me something"), false)
                        .unwrap(),
                    sampling,
                    stop: StopParams {
                        max_tokens: Some(gen),
                        ignore_eos: true,
                        ..Default::default()
                    },
                    prompt_logprobs: false,
                    cache_salt: vec![],
                    checkpoint_at: Vec::new(),
                    images: None,
                })
                .unwrap()
            })
            .collect();
        let t0 = Instant::now();
        for mut s in streams {
            while let Some(ev) = s.blocking_recv() {
                if let EngineEvent::Finished { .. } = ev {
                    break;
                }
            }
        }
        let wall = t0.elapsed().as_secs_f64();
        let m = h.metrics();
        let overhead = m.overhead_seconds_total;
        let step = m.overhead_seconds_total + m.execute_seconds_total;
        println!(
            "{seqs} sequences × {gen} tokens ({}): {} steps, {:.1} ms/step in total, of which engine overhead \
             {:.2} ms/step ({:.1} µs per sequence-step, {:.1}% of the step); {:.0} tok/s overall",
            if sampled { "top-k/top-p sampling" } else { "greedy" },
            m.steps_total,
            step / m.steps_total as f64 * 1e3,
            overhead / m.steps_total as f64 * 1e3,
            overhead / m.generation_tokens_total.max(1) as f64 * 1e6,
            100.0 * overhead / step,
            m.generation_tokens_total as f64 / wall
        );
        h.shutdown();
    }
}
