//! Grammar mask cost at batch 8 on the built-in Qwen vocabulary (248,320 ids), printed, not asserted:
//!
//! 1. the time to compute one step's masks for 8 sequences (each under its own constraint: JSON schemas,
//!    a forced XML tool call, a regex), one after another and on 2 threads;
//! 2. the engine's step time on the built-in model with 8 constrained sequences against 8 free ones,
//!    and the masks' share of the constrained step.
//!
//! Run with `cargo bench -p sanmai-structured --bench mask`.

use std::time::{Duration, Instant};

use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, OutputConstraint, StopParams};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, EngineHandle, ModelExecutor};
use sanmai_model::{builtin, Model};
use sanmai_structured::{mask_words, CompiledGrammar, Constraint, GrammarCompiler, ToolSyntax};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::Dummy;
use serde_json::json;

const BATCH: usize = 8;
const STEPS: usize = 40;

fn constraints() -> Vec<Constraint> {
    let person = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6}
    }, "required": ["name", "age", "tags"]});
    let tool = json!({"type": "function", "function": {"name": "respond_in_schema", "parameters": {
        "type": "object", "properties": {
            "reasoning": {"type": "string", "maxLength": 200},
            "next_speaker": {"type": "string", "enum": ["user", "model"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1}
        }, "required": ["reasoning", "next_speaker"]}}});
    vec![
        Constraint::JsonSchema(person.clone()),
        Constraint::JsonObject,
        Constraint::ToolCall {
            tools: vec![tool.clone()],
            syntax: ToolSyntax::Xml,
            name: None,
        },
        Constraint::ToolCall {
            tools: vec![tool],
            syntax: ToolSyntax::Json,
            name: None,
        },
        Constraint::Regex("[a-z]+( [a-z]+){0,12}\\.".into()),
        Constraint::JsonSchema(person),
        Constraint::Choice(vec!["alpha".into(), "beta".into(), "gamma".into()]),
        Constraint::JsonSchema(
            json!({"type": "array", "items": {"type": "integer"}, "maxItems": 30}),
        ),
    ]
}

/// A deterministic token picker: the n-th allowed id, n from a SplitMix64 stream.
struct Pick(u64);

impl Pick {
    fn pick(&mut self, mask: &[u32], vocab: usize) -> Option<u32> {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let allowed: Vec<u32> = (0..vocab as u32)
            .filter(|&t| mask[t as usize / 32] & (1 << (t % 32)) != 0)
            .collect();
        (!allowed.is_empty()).then(|| allowed[((z ^ (z >> 31)) % allowed.len() as u64) as usize])
    }
}

/// Mask time per step of the batch: one sequence after another (the CPU time of a step's masks, on even
/// steps) and spread over 2 threads (wall time, on odd steps).
fn mask_step_times(
    grammars: &[CompiledGrammar],
    vocab: usize,
    eos: &[u32],
) -> (Duration, Duration) {
    let words = mask_words(vocab);
    let (mut seq_total, mut par_total) = (Duration::ZERO, Duration::ZERO);
    let mut matchers: Vec<_> = grammars.iter().map(|g| g.matcher()).collect();
    let mut masks = vec![vec![0u32; words]; BATCH];
    let mut pick = Pick(5);
    for step in 0..2 * STEPS {
        let t = Instant::now();
        if step % 2 == 0 {
            for (m, mask) in matchers.iter_mut().zip(masks.iter_mut()) {
                m.fill_mask(mask).unwrap();
            }
            seq_total += t.elapsed();
        } else {
            std::thread::scope(|s| {
                for (ms, ks) in matchers
                    .chunks_mut(BATCH / 2)
                    .zip(masks.chunks_mut(BATCH / 2))
                {
                    s.spawn(move || {
                        for (m, k) in ms.iter_mut().zip(ks.iter_mut()) {
                            m.fill_mask(k).unwrap();
                        }
                    });
                }
            });
            par_total += t.elapsed();
        }
        for (i, m) in matchers.iter_mut().enumerate() {
            let next = pick.pick(&masks[i], vocab).filter(|t| !eos.contains(t));
            match next {
                Some(t) if !m.is_stopped() => m.advance(&[t]).unwrap(),
                // Done: start over.
                _ => *m = grammars[i].matcher(),
            }
        }
    }
    (seq_total / STEPS as u32, par_total / STEPS as u32)
}

fn engine(tok: &Tokenizer) -> EngineHandle {
    let cfg = EngineConfig {
        model_name: "bench".into(),
        max_num_seqs: BATCH,
        max_num_batched_tokens: 4096,
        max_model_len: 4096,
        max_waiting: 100,
        default_max_tokens: None,
        valid_vocab: tok.vocab_size(),
        eos_ids: tok.eos_token_ids().to_vec(),
        block_size: 16,
        kv_cache_memory_bytes: 1 << 30,
        enable_prefix_caching: false,
        state_checkpoint_interval: Some(64),
        num_speculative_tokens: 0,
    };
    let model = Model::load(
        builtin::config(),
        &Dummy::new(builtin::SEED),
        CpuBackend::new(),
    )
    .unwrap();
    start(ModelExecutor::new(model), Some(tok.clone()), cfg).unwrap()
}

/// Seconds per engine step for 8 concurrent sequences of `tokens` tokens (with or without constraints).
fn engine_step(
    h: &EngineHandle,
    tok: &Tokenizer,
    grammars: Option<&[CompiledGrammar]>,
    tokens: usize,
) -> f64 {
    let before = h.metrics().steps_total;
    let started = Instant::now();
    let streams: Vec<_> = (0..BATCH)
        .map(|i| {
            let req = EngineRequest {
                id: format!("b{i}-{}", grammars.is_some()),
                prompt: tok.encode("Benchmark prompt", false).unwrap(),
                sampling: SamplingParams {
                    temperature: 1.0,
                    seed: Some(i as u64),
                    ..SamplingParams::default()
                }
                .validated(h.info().valid_vocab)
                .unwrap(),
                stop: StopParams {
                    max_tokens: Some(tokens),
                    ignore_eos: true,
                    ..Default::default()
                },
                prompt_logprobs: false,
                cache_salt: Vec::new(),
                checkpoint_at: Vec::new(),
                images: None,
            };
            let c = grammars.map(|g| OutputConstraint {
                matcher: g[i].matcher(),
                activate_after: Vec::new(),
            });
            h.submit_constrained(req, c).unwrap()
        })
        .collect();
    for mut s in streams {
        while let Some(ev) = s.blocking_recv() {
            if matches!(ev, EngineEvent::Finished { .. }) {
                break;
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    // The metrics are published once per loop turn.
    std::thread::sleep(Duration::from_millis(20));
    let steps = (h.metrics().steps_total - before).max(1);
    elapsed / steps as f64
}

fn main() {
    let tok = Tokenizer::builtin().unwrap();
    let t = Instant::now();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    println!(
        "token trie and parser factory: {:.0} ms (once per tokenizer)",
        t.elapsed().as_secs_f64() * 1e3
    );
    let t = Instant::now();
    let grammars: Vec<CompiledGrammar> = constraints()
        .iter()
        .map(|c| compiler.compile(c).unwrap())
        .collect();
    println!(
        "compiling {} constraints (first mask included): {:.1} ms each",
        grammars.len(),
        t.elapsed().as_secs_f64() * 1e3 / grammars.len() as f64
    );
    let (seq, par) = mask_step_times(&grammars, compiler.vocab_size(), tok.eos_token_ids());
    println!(
        "masks at batch {BATCH}, per step over {STEPS} steps: {:.2} ms one after another ({:.3} ms per sequence), {:.2} ms on 2 threads",
        seq.as_secs_f64() * 1e3,
        seq.as_secs_f64() * 1e3 / BATCH as f64,
        par.as_secs_f64() * 1e3
    );
    // Grammars that outlast the run, so every step has 8 constrained sequences.
    let long: Vec<CompiledGrammar> = (0..BATCH)
        .map(|i| {
            let c = if i % 2 == 0 {
                Constraint::JsonObject
            } else {
                Constraint::JsonSchema(json!({"type": "array", "items": {"type": "object",
                    "properties": {"k": {"type": "string", "maxLength": 6}, "v": {"type": "integer"}}}}))
            };
            compiler.compile(&c).unwrap()
        })
        .collect();
    let h = engine(&tok);
    // Warm-up, then the measured runs (ignore_eos: a free sequence runs to max_tokens; a constrained one
    // may end earlier when its grammar completes).
    engine_step(&h, &tok, None, 8);
    let free = engine_step(&h, &tok, None, 48);
    let constrained = engine_step(&h, &tok, Some(&long), 48);
    println!(
        "engine step at batch {BATCH} on the built-in model: {:.2} ms free, {:.2} ms constrained",
        free * 1e3,
        constrained * 1e3
    );
    println!(
        "mask share of the constrained step: {:.0}% (mask CPU time per step / constrained step time)",
        100.0 * seq.as_secs_f64() / constrained
    );
    h.shutdown();
}
