//! Time to first token over an agent-shaped conversation (each turn re-sends the whole history: the previous
//! prompt, the model's reply, a tool result and a new instruction), with and without prefix caching, on the
//! built-in model. Prints numbers; asserts nothing.
//!
//! `cargo bench -p sanmai-engine --bench prefix_cache`

use std::time::Instant;

use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, StopParams};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, EngineHandle, ModelExecutor};
use sanmai_model::{builtin, Model};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::Dummy;

fn engine(tok: &Tokenizer, prefix_caching: bool) -> EngineHandle {
    let model = Model::load(
        builtin::config(),
        &Dummy::new(builtin::SEED),
        CpuBackend::new(),
    )
    .unwrap();
    start(
        ModelExecutor::new(model),
        Some(tok.clone()),
        EngineConfig {
            model_name: "bench".into(),
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            max_model_len: 65_536,
            max_waiting: 100,
            default_max_tokens: None,
            valid_vocab: tok.backend().get_vocab_size(true),
            eos_ids: vec![],
            block_size: 16,
            kv_cache_memory_bytes: 1 << 30,
            enable_prefix_caching: prefix_caching,
            state_checkpoint_interval: None,
            num_speculative_tokens: 0,
        },
    )
    .unwrap()
}

/// Runs one turn; returns (TTFT seconds, generated ids, cached prompt tokens).
fn turn(h: &EngineHandle, prompt: Vec<u32>, id: usize) -> (f64, Vec<u32>, usize) {
    let t0 = Instant::now();
    let mut s = h
        .submit(EngineRequest {
            id: format!("turn{id}"),
            prompt,
            sampling: SamplingParams::greedy()
                .validated(h.info().valid_vocab)
                .unwrap(),
            stop: StopParams {
                max_tokens: Some(48),
                ignore_eos: true,
                ..Default::default()
            },
            prompt_logprobs: false,
            cache_salt: vec![],
            checkpoint_at: Vec::new(),
            images: None,
        })
        .unwrap();
    let (mut ttft, mut ids, mut cached) = (None, Vec::new(), 0);
    while let Some(ev) = s.blocking_recv() {
        match ev {
            EngineEvent::Tokens { ids: new, .. } => {
                ttft.get_or_insert(t0.elapsed().as_secs_f64());
                ids.extend(new);
            }
            EngineEvent::Finished { usage, .. } => cached = usage.cached_tokens,
            EngineEvent::PromptLogprobs(_) => {}
        }
    }
    (ttft.unwrap_or_default(), ids, cached)
}

fn main() {
    let tok = Tokenizer::builtin().unwrap();
    let tool_output: String = (0..60)
        .map(|i| format!("line {i}: fn item_{i}() {{}}\n"))
        .collect();
    for caching in [false, true] {
        let h = engine(&tok, caching);
        let mut history = tok
            .encode("<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\nFix the build.<|im_end|>\n<|im_start|>assistant\n", false)
            .unwrap();
        let mut line = Vec::new();
        for t in 0..6 {
            let (ttft, reply, cached) = turn(&h, history.clone(), t);
            line.push(format!(
                "turn {t}: {} tokens, {cached} cached, TTFT {:.1} ms",
                history.len(),
                ttft * 1e3
            ));
            history.extend(reply);
            let next = format!("<|im_end|>\n<|im_start|>user\n<tool_response>\n{tool_output}</tool_response><|im_end|>\n<|im_start|>assistant\n");
            history.extend(tok.encode(&next, false).unwrap());
        }
        println!(
            "prefix caching {}:\n  {}",
            if caching { "on" } else { "off" },
            line.join("\n  ")
        );
        h.shutdown();
    }
}
