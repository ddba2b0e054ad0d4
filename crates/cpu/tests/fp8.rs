//! Block-scaled FP8 checkpoints (`quant_method: fp8`) against HF transformers: the CPU backend on the
//! tiny checkpoints written by `tests/reference/make_fp8_fixtures.py`, whose converted Linears are
//! float8_e4m3fn with one `weight_scale_inv` per 128×128 block (hidden 160, so partial edge blocks
//! everywhere), compared with transformers run in float64 on the dequantised weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, OutRows};
use sanmai_weights::Checkpoint;
use serde_json::Value;

mod fixture_util;
mod step_util;
use fixture_util::*;
use step_util::{logits, new_seq, BLOCKS_PER_SEQ};

const TOL: f64 = 1e-3;
const BLOCK: usize = 16;

fn load_dir(dir: &Path) -> Model<CpuBackend> {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert!(
        cfg.fp8.is_some(),
        "{}: no FP8 quantization_config",
        dir.display()
    );
    let ckpt = Checkpoint::open(dir).unwrap();
    let model = Model::load(cfg, &ckpt, CpuBackend::new()).unwrap();
    model.init_cache(BLOCKS_PER_SEQ * 4, BLOCK).unwrap();
    model
}

/// The fixture really is what it claims: FP8 weights with their block scales, some of them with
/// partial edge blocks and some with several blocks along a dimension.
fn check_layout(dir: &Path) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let scales: Vec<&str> = ckpt
        .names()
        .filter(|n| n.ends_with(".weight_scale_inv"))
        .collect();
    assert!(!scales.is_empty(), "{}: no weight_scale_inv", dir.display());
    let (mut partial, mut several) = (0, 0);
    for s in &scales {
        let w = s.replace(".weight_scale_inv", ".weight");
        let shape = ckpt.shape(&w).unwrap_or_else(|| panic!("{w} missing"));
        let grid = ckpt.shape(s).unwrap();
        assert_eq!(
            grid,
            [shape[0].div_ceil(128), shape[1].div_ceil(128)],
            "{s}"
        );
        partial += usize::from(shape.iter().any(|d| d % 128 != 0));
        several += usize::from(grid.iter().any(|&g| g > 1));
    }
    assert!(
        partial > 0 && several > 0,
        "{partial} partial, {several} multi-block"
    );
}

fn check_prompts(name: &str, chunk_len: usize) {
    let dir = fixture(name);
    check_layout(&dir);
    let m = load_dir(&dir);
    let reference = reference(&dir);
    for (pi, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["ids"]);
        let seq = new_seq(&m, pi);
        let mut rows = Vec::new();
        let mut pos = 0;
        while pos < prompt.len() {
            let len = chunk_len.min(prompt.len() - pos);
            let data = logits(&m, &[seq.chunk(&prompt, pos, len, OutRows::All)]);
            rows.extend(data.chunks_exact(m.cfg.vocab_size).map(log_softmax));
            pos += len;
        }
        let expected = floats(&p["prompt_logprobs"]);
        let mut worst: f64 = 0.0;
        for t in 1..prompt.len() {
            worst = worst.max((rows[t - 1][prompt[t] as usize] - expected[t].unwrap()).abs());
        }
        eprintln!(
            "{name} prompt {pi} (chunks of {chunk_len}): max prompt logprob error {worst:.1e}"
        );
        assert!(
            worst < TOL,
            "{name} prompt {pi}: prompt logprob off by {worst}"
        );

        // The greedy continuation through the decode path.
        let greedy = ids(&p["greedy_ids"]);
        let mut tokens = prompt.clone();
        let mut next = argmax(rows.last().unwrap());
        for (pos, (i, &want)) in (prompt.len()..).zip(greedy.iter().enumerate()) {
            assert_eq!(next, want, "{name} prompt {pi}: greedy token {i} differs");
            tokens.push(next);
            let row = logits(&m, &[seq.chunk(&tokens, pos, 1, OutRows::Last)]);
            next = argmax(&log_softmax(&row));
        }
        m.backend.free_state(seq.state);
    }
}

#[test]
fn qwen3_next_fp8_matches_transformers() {
    check_prompts("qwen3_next_fp8_tiny", 1024);
}

#[test]
fn qwen3_next_fp8_chunked_prefill_matches_transformers() {
    check_prompts("qwen3_next_fp8_tiny", 37);
}

#[test]
fn qwen3_5_moe_fp8_matches_transformers() {
    check_prompts("qwen3_5_moe_fp8_tiny", 1024);
}

/// A copy of fixture `name` in a fresh temporary directory, its `model.safetensors` rewritten
/// without the tensor `drop` (the safetensors layout: an 8-byte little-endian header length, the
/// JSON header of names, dtypes, shapes and data offsets, then the data).
fn copy_without(name: &str, drop: &str) -> PathBuf {
    let src = fixture(name);
    let dst = std::env::temp_dir().join(format!("sanmai-fp8-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "generation_config.json", "reference.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: BTreeMap<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    assert!(header.contains_key(drop), "{name} has no `{drop}`");
    let (mut out_header, mut out_data) = (serde_json::Map::new(), Vec::new());
    for (k, v) in header {
        if k == drop {
            continue;
        }
        if k == "__metadata__" {
            out_header.insert(k, v);
            continue;
        }
        let offs = &v["data_offsets"];
        let (s, e) = (
            offs[0].as_u64().unwrap() as usize,
            offs[1].as_u64().unwrap() as usize,
        );
        let start = out_data.len();
        out_data.extend_from_slice(&data[s..e]);
        let mut entry = v.clone();
        entry["data_offsets"] = serde_json::json!([start, out_data.len()]);
        out_header.insert(k, entry);
    }
    let mut text = serde_json::to_vec(&Value::Object(out_header)).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&text);
    file.extend_from_slice(&out_data);
    std::fs::write(dst.join("model.safetensors"), file).unwrap();
    dst
}

#[test]
fn a_missing_weight_scale_inv_is_an_error_naming_it() {
    for (name, drop) in [
        (
            "qwen3_next_fp8_tiny",
            "model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv",
        ),
        (
            "qwen3_5_moe_fp8_tiny",
            "model.language_model.layers.2.mlp.experts.5.down_proj.weight_scale_inv",
        ),
    ] {
        let dir = copy_without(name, drop);
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert!(ckpt.shape(drop).is_none());
        let result = Model::load(cfg, &ckpt, CpuBackend::new());
        let _ = std::fs::remove_dir_all(&dir);
        let Err(e) = result else {
            panic!("{name} without `{drop}` loaded");
        };
        let message = e.to_string();
        assert!(message.contains(drop), "{name}: {message}");
    }
}
