//! Parity with HF transformers: the CPU backend against the reference outputs recorded by
//! `tests/reference/make_fixtures.py` for tiny random checkpoints of each supported architecture.

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, OutRows};
use sanmai_weights::Checkpoint;
use serde_json::Value;

mod fixture_util;
mod step_util;
use fixture_util::*;
use step_util::{logits, new_seq, Seq, BLOCKS_PER_SEQ};

const TOL: f64 = 1e-3;
const BLOCK: usize = 16;

fn load(name: &str) -> (Model<CpuBackend>, Value) {
    let dir = fixture(name);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Model::load(cfg, &ckpt, CpuBackend::new()).unwrap();
    model.init_cache(BLOCKS_PER_SEQ * 8, BLOCK).unwrap();
    (model, reference(&dir))
}

/// Runs the prompt in chunks of `chunk` tokens and returns every position's log-probabilities.
fn prompt_logprobs(
    m: &Model<CpuBackend>,
    seq: &Seq,
    prompt: &[u32],
    chunk_len: usize,
) -> Vec<Vec<f64>> {
    let mut rows = Vec::new();
    let mut pos = 0;
    while pos < prompt.len() {
        let len = chunk_len.min(prompt.len() - pos);
        let data = logits(m, &[seq.chunk(prompt, pos, len, OutRows::All)]);
        rows.extend(data.chunks_exact(m.cfg.vocab_size).map(log_softmax));
        pos += len;
    }
    rows
}

fn check_prompts(name: &str, chunk_len: usize) {
    let (m, reference) = load(name);
    for (pi, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["ids"]);
        let seq = new_seq(&m, pi);
        let rows = prompt_logprobs(&m, &seq, &prompt, chunk_len);
        let expected = floats(&p["prompt_logprobs"]);
        let mut worst: f64 = 0.0;
        for t in 1..prompt.len() {
            let got = rows[t - 1][prompt[t] as usize];
            let want = expected[t].unwrap();
            worst = worst.max((got - want).abs());
        }
        eprintln!(
            "{name} prompt {pi} (chunks of {chunk_len}): max prompt logprob error {worst:.1e}"
        );
        assert!(
            worst < TOL,
            "{name} prompt {pi} (chunks of {chunk_len}): prompt logprob off by {worst}"
        );

        // Greedy continuation through the recurrent decode path.
        let greedy = ids(&p["greedy_ids"]);
        let gaps = floats(&p["greedy_top2_gap"]);
        let mut tokens = prompt.clone();
        let mut next = argmax(rows.last().unwrap());
        for (pos, (i, &want)) in (prompt.len()..).zip(greedy.iter().enumerate()) {
            if gaps[i].unwrap() < 1e-3 {
                break; // transformers' own choice is a near-tie from here on
            }
            assert_eq!(next, want, "{name} prompt {pi}: greedy token {i} differs");
            tokens.push(next);
            let row = logits(&m, &[seq.chunk(&tokens, pos, 1, OutRows::Last)]);
            next = argmax(&log_softmax(&row));
        }
        m.backend.free_state(seq.state);
    }
}

fn check_mtp(name: &str) {
    let (m, reference) = load(name);
    check_mtp_drafts(name, &m, &reference, TOL);
}

#[test]
fn qwen3_next_matches_transformers() {
    check_prompts("qwen3_next_tiny", 1024);
}

#[test]
fn qwen3_next_chunked_prefill_matches_transformers() {
    check_prompts("qwen3_next_tiny", 37);
}

#[test]
fn qwen3_5_moe_text_matches_transformers() {
    check_prompts("qwen3_5_moe_text_tiny", 1024);
}

#[test]
fn qwen3_5_moe_wrapper_matches_transformers() {
    check_prompts("qwen3_5_moe_tiny", 100);
}

#[test]
fn qwen3_next_mtp_matches_reference() {
    check_mtp("qwen3_next_tiny");
}

#[test]
fn qwen3_5_moe_mtp_matches_reference() {
    check_mtp("qwen3_5_moe_text_tiny");
    check_mtp("qwen3_5_moe_tiny");
}
