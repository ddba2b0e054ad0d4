//! qwen4_exp on the CPU oracle against the PyTorch reference (`tests/reference/qwen4_exp_ref.py`):
//! tiny checkpoints with QSA, PLE and hyper-connections each on alone and all together; QSA's selected
//! sets; the PLE rows against a direct read of the table; and, with every block off, the Qwen3.5-MoE
//! fixture.

use std::path::Path;

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, OutRows, PleSource};
use sanmai_weights::Checkpoint;
use serde_json::Value;

mod fixture_util;
mod step_util;
use fixture_util::*;
use step_util::{logits, new_seq, Seq, BLOCKS_PER_SEQ};

const TOL: f64 = 1e-3;
const BLOCK: usize = 16;

fn load_cfg(dir: &Path, cfg: ModelConfig) -> Model<CpuBackend> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let ple = cfg
        .ple
        .as_ref()
        .map(|p| PleSource::open(dir, p, false).unwrap());
    let model = Model::load_with_ple(cfg, &ckpt, CpuBackend::new(), ple).unwrap();
    model.init_cache(BLOCKS_PER_SEQ * 8, BLOCK).unwrap();
    model
}

fn load(name: &str) -> (Model<CpuBackend>, Value) {
    let dir = fixture(name);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    (load_cfg(&dir, cfg), reference(&dir))
}

/// One step of a single sequence: `tokens` is the whole history, the step covers `pos0..pos0 + len`.
fn step(
    m: &Model<CpuBackend>,
    seq: &Seq,
    tokens: &[u32],
    pos0: usize,
    len: usize,
) -> Vec<Vec<f64>> {
    logits(m, &[seq.chunk(tokens, pos0, len, OutRows::All)])
        .chunks_exact(m.cfg.vocab_size)
        .map(log_softmax)
        .collect()
}

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
        rows.extend(step(m, seq, prompt, pos, len));
        pos += len;
    }
    rows
}

fn check_prompts_with(name: &str, m: &Model<CpuBackend>, reference: &Value, chunk_len: usize) {
    for (pi, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["ids"]);
        let seq = new_seq(m, pi);
        let rows = prompt_logprobs(m, &seq, &prompt, chunk_len);
        let expected = floats(&p["prompt_logprobs"]);
        let worst = (1..prompt.len())
            .map(|t| (rows[t - 1][prompt[t] as usize] - expected[t].unwrap()).abs())
            .fold(0.0, f64::max);
        eprintln!(
            "{name} prompt {pi} (chunks of {chunk_len}): max prompt logprob error {worst:.1e}"
        );
        assert!(
            worst < TOL,
            "{name} prompt {pi} (chunks of {chunk_len}): off by {worst}"
        );

        // Greedy continuation through single-token decode steps.
        let greedy = ids(&p["greedy_ids"]);
        let gaps = floats(&p["greedy_top2_gap"]);
        let mut tokens = prompt.clone();
        let mut next = argmax(rows.last().unwrap());
        for (i, &want) in greedy.iter().enumerate() {
            if gaps[i].unwrap() < 1e-3 {
                break; // a near-tie in the reference from here on
            }
            assert_eq!(next, want, "{name} prompt {pi}: greedy token {i} differs");
            tokens.push(next);
            let row = step(m, &seq, &tokens, tokens.len() - 1, 1);
            next = argmax(&row[0]);
        }
        m.backend.free_state(seq.state);
    }
}

fn check_prompts(name: &str, chunk_len: usize) {
    let (m, reference) = load(name);
    check_prompts_with(name, &m, &reference, chunk_len);
}

fn check_mtp(name: &str) {
    let (m, reference) = load(name);
    let cases = check_mtp_drafts(name, &m, &reference, TOL);
    assert!(cases > 0, "{name} has MTP references");
}

#[test]
fn qsa_matches_reference() {
    check_prompts("qwen4_exp_qsa_tiny", 1024);
    check_prompts("qwen4_exp_qsa_tiny", 37);
    check_mtp("qwen4_exp_qsa_tiny");
}

#[test]
fn ple_matches_reference() {
    check_prompts("qwen4_exp_ple_tiny", 1024);
    check_prompts("qwen4_exp_ple_tiny", 37);
}

#[test]
fn hyper_connections_match_reference() {
    check_prompts("qwen4_exp_hc_tiny", 1024);
    check_prompts("qwen4_exp_hc_tiny", 37);
}

#[test]
fn all_blocks_match_reference() {
    check_prompts("qwen4_exp_all_tiny", 1024);
    check_prompts("qwen4_exp_all_tiny", 37);
    check_mtp("qwen4_exp_all_tiny");
}

/// The selected sets of the reference's traced positions, in one pass and in chunks of 37.
fn check_selected(name: &str, chunk_len: usize) {
    let (m, reference) = load(name);
    let mut checked = 0;
    for (pi, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let Some(sel) = p.get("qsa_selected") else {
            continue;
        };
        let prompt = ids(&p["ids"]);
        let layer = sel["layer"].as_u64().unwrap() as usize;
        let seq = new_seq(&m, pi);
        m.backend.trace_qsa(true);
        prompt_logprobs(&m, &seq, &prompt, chunk_len);
        let trace = m.backend.take_qsa_trace();
        m.backend.trace_qsa(false);
        for (pos, want) in sel["positions"]
            .as_array()
            .unwrap()
            .iter()
            .zip(sel["sets"].as_array().unwrap())
        {
            let pos = pos.as_u64().unwrap() as usize;
            let want: Vec<usize> = ids(want).into_iter().map(|x| x as usize).collect();
            let got = trace
                .iter()
                .find(|r| r.layer == layer && r.state == seq.state && r.pos == pos)
                .unwrap_or_else(|| panic!("no selection recorded for position {pos}"));
            assert_eq!(got.selected, want, "{name} prompt {pi} position {pos}");
            let topk = m.cfg.qsa.as_ref().unwrap().index_topk;
            assert_eq!(got.selected.len(), topk.min(pos + 1));
            checked += 1;
        }
        m.backend.free_state(seq.state);
    }
    assert!(checked > 0, "{name} records selected sets");
}

#[test]
fn qsa_selected_sets_are_exact() {
    check_selected("qwen4_exp_qsa_tiny", 1024);
    check_selected("qwen4_exp_qsa_tiny", 37);
    check_selected("qwen4_exp_all_tiny", 1024);
}

#[test]
fn ple_rows_equal_a_direct_read_of_the_table() {
    let (m, reference) = load("qwen4_exp_ple_tiny");
    let p = m.cfg.ple.clone().unwrap();
    let dir = fixture("qwen4_exp_ple_tiny");
    let bytes = std::fs::read(dir.join("ple.bin")).unwrap();
    let sizes = p.flat_sizes();
    let prompt_ref = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p.get("ple_indices").is_some())
        .expect("a prompt records its PLE row indices");
    let prompt = ids(&prompt_ref["ids"]);
    assert!(
        prompt.contains(&(p.eos_token_id as u32)),
        "the prompt crosses a document boundary"
    );
    // The rows a step gathers: its chunk's positions of the history followed by the chunk.
    let (shape, source) = m.ple.as_ref().unwrap();
    let e = shape.row_width;
    assert_eq!(e, sizes.len() * p.row_dim);
    let n = prompt.len();
    let mut got = vec![0f32; n * e];
    source.gather(&prompt, 0..n, e, &mut got).unwrap();
    for (t, idx) in prompt_ref["ple_indices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        for (k, row) in idx.as_array().unwrap().iter().enumerate() {
            let row = row.as_u64().unwrap();
            assert!(row < sizes[k]);
            let base: u64 = sizes[..k].iter().sum();
            let off = ((base + row) * p.row_dim as u64 * 2) as usize;
            for j in 0..p.row_dim {
                let bits = u16::from_le_bytes([bytes[off + 2 * j], bytes[off + 2 * j + 1]]);
                let want = f32::from_bits((bits as u32) << 16);
                assert_eq!(
                    got[t * e + k * p.row_dim + j],
                    want,
                    "position {t} table {k} value {j}"
                );
            }
        }
    }
    // A step's rows are those of its positions only: a later chunk reads the same rows.
    let mut tail = vec![0f32; (n - 40) * e];
    source.gather(&prompt, 40..n, e, &mut tail).unwrap();
    assert_eq!(tail, got[40 * e..]);
}

/// The PLE conv across a restored checkpoint: run 45 tokens, save the state slot, run on; then restore
/// the checkpoint into a fresh slot and run the rest again. Both continuations equal one pass.
#[test]
fn ple_conv_state_survives_checkpoint_restore() {
    for name in ["qwen4_exp_ple_tiny", "qwen4_exp_all_tiny"] {
        let (m, reference) = load(name);
        let prompt = ids(&reference["prompts"][2]["ids"]);
        let n = prompt.len();
        let one = new_seq(&m, 0);
        let whole = step(&m, &one, &prompt, 0, n);

        let split = new_seq(&m, 1);
        step(&m, &split, &prompt, 0, 45);
        let saved = m.backend.alloc_state().unwrap();
        m.backend.copy_state(split.state, saved).unwrap();
        let first = step(&m, &split, &prompt, 45, n - 45);
        let restored = Seq::new(&m, split.blocks.clone());
        m.backend.copy_state(saved, restored.state).unwrap();
        let second = step(&m, &restored, &prompt, 45, n - 45);
        for (t, (a, b)) in first.iter().zip(&second).enumerate() {
            assert_eq!(a, b, "{name}: restored continuation differs at {}", 45 + t);
        }
        let worst = first
            .iter()
            .zip(&whole[45..])
            .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
            .fold(0.0, f64::max);
        eprintln!("{name}: split at 45 vs one pass: max logprob difference {worst:.1e}");
        assert!(worst < TOL, "{name}: split vs one pass off by {worst}");
    }
}

#[test]
fn all_blocks_off_equals_the_qwen3_5_moe_fixture() {
    let dir = fixture("qwen3_5_moe_text_tiny");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut json: Value = serde_json::from_str(&text).unwrap();
    json["model_type"] = Value::from("qwen4_exp");
    let cfg = ModelConfig::from_value(&json, "config.json").unwrap();
    assert!(cfg.qsa.is_none() && cfg.ple.is_none() && cfg.hyper_connections.is_none());
    let exp = load_cfg(&dir, cfg);
    let base = load_cfg(
        &dir,
        ModelConfig::from_file(&dir.join("config.json")).unwrap(),
    );
    let reference = reference(&dir);
    check_prompts_with("qwen4_exp (all off)", &exp, &reference, 1024);
    // The same computation, not merely a close one.
    let prompt = ids(&reference["prompts"][1]["ids"]);
    let a = step(&exp, &new_seq(&exp, 7), &prompt, 0, prompt.len());
    let b = step(&base, &new_seq(&base, 7), &prompt, 0, prompt.len());
    assert_eq!(a, b);
}

/// With `index_topk` at least the context, a QSA layer is dense gated attention: the QSA checkpoint
/// with a large `index_topk` computes exactly what it computes with the `qsa` block removed.
#[test]
fn qsa_with_topk_over_the_context_is_dense_attention() {
    let dir = fixture("qwen4_exp_qsa_tiny");
    let mut cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    cfg.qsa.as_mut().unwrap().index_topk = 4096;
    let sparse = load_cfg(&dir, cfg.clone());
    cfg.qsa = None;
    let dense = load_cfg(&dir, cfg);
    let prompt = ids(&reference(&dir)["prompts"][2]["ids"]);
    for chunk_len in [1024, 37] {
        let a = prompt_logprobs(&sparse, &new_seq(&sparse, 0), &prompt, chunk_len);
        let b = prompt_logprobs(&dense, &new_seq(&dense, 0), &prompt, chunk_len);
        assert_eq!(a, b, "chunks of {chunk_len}");
    }
    // And with the fixture's own index_topk (32 < 300) the layer does select: the logits differ.
    let (m, _) = load("qwen4_exp_qsa_tiny");
    let c = prompt_logprobs(&m, &new_seq(&m, 1), &prompt, 1024);
    let d = prompt_logprobs(&dense, &new_seq(&dense, 1), &prompt, 1024);
    let diff = |a: &[Vec<f64>], b: &[Vec<f64>]| {
        a.iter()
            .zip(b)
            .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
            .fold(0.0, f64::max)
    };
    // Positions within index_topk see every key (through the sparse kernel: equal up to rounding).
    assert!(diff(&c[..32], &d[..32]) < 1e-5);
    assert!(
        diff(&c[40..], &d[40..]) > 1e-2,
        "later positions attend to 32 keys only"
    );
}
