//! Pipeline stages ([`Model::load_stage`], [`Model::forward_stage`]): a fixture loaded as two stages, each
//! on its own backend with its own caches, the first handing its residual streams to the second through
//! the host, gives the whole model's logits bit for bit over a prefill chunk and decode steps (GDN
//! state, K/V, QSA index keys, PLE rows and conv state, hyper-connection streams all cross the cut);
//! and a stage outside the model's layers is refused with the numbers.

use std::ops::Range;
use std::path::Path;

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, PleSource, StageInput};
use sanmai_weights::Checkpoint;

mod fixture_util;
use fixture_util::*;

const BLOCK: usize = 16;

fn load(dir: &Path, stage: Range<usize>) -> Model<CpuBackend> {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ple = cfg
        .ple
        .as_ref()
        .map(|p| PleSource::open(dir, p, false).unwrap());
    let m = Model::load_stage(
        cfg,
        &Checkpoint::open(dir).unwrap(),
        CpuBackend::new(),
        ple,
        stage,
    )
    .unwrap();
    m.init_cache(BLOCKS_PER_SEQ, BLOCK);
    m
}

/// Logits of the last position of each step: a prefill of `prefill` tokens, then one token a step.
fn run_whole(m: &Model<CpuBackend>, toks: &[u32], prefill: usize) -> Vec<Vec<f32>> {
    let seq = new_seq(m, 0);
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < toks.len() {
        let len = if pos == 0 { prefill } else { 1 };
        let c = [chunk(&seq, len, pos)];
        let ple = m.ple_rows(&[&toks[..pos + len]], &c).unwrap();
        let h = m.forward_with(&toks[pos..pos + len], &c, &[len - 1], ple.as_ref());
        out.push(m.backend.to_host(m.logits(&h.hidden)).2);
        pos += len;
    }
    out
}

/// The same steps through two stages: the first's streams cross to the second through the host.
fn run_staged(
    a: &Model<CpuBackend>,
    b: &Model<CpuBackend>,
    toks: &[u32],
    prefill: usize,
) -> Vec<Vec<f32>> {
    let (sa, sb) = (new_seq(a, 0), new_seq(b, 0));
    assert_eq!(
        sa.state, sb.state,
        "each stage numbers its state slots alike"
    );
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < toks.len() {
        let len = if pos == 0 { prefill } else { 1 };
        let (ca, cb) = ([chunk(&sa, len, pos)], [chunk(&sb, len, pos)]);
        let hist = [&toks[..pos + len]];
        let ple_a = a.ple_rows(&hist, &ca).unwrap();
        let streams = a.forward_stage(
            StageInput::Tokens(&toks[pos..pos + len]),
            &ca,
            &[len - 1],
            ple_a.as_ref(),
        );
        let (r, c, v) = a.backend.to_host(streams);
        let ple_b = b.ple_rows(&hist, &cb).unwrap();
        let h = b.forward_stage(
            StageInput::Streams(b.backend.upload(r, c, v)),
            &cb,
            &[len - 1],
            ple_b.as_ref(),
        );
        out.push(b.backend.to_host(b.logits(&h)).2);
        pos += len;
    }
    out
}

#[test]
fn two_stages_equal_the_whole_model() {
    for name in [
        "qwen3_next_tiny",
        "qwen3_5_moe_text_tiny",
        "qwen4_exp_all_tiny",
    ] {
        let dir = fixture(name);
        let n = ModelConfig::from_file(&dir.join("config.json"))
            .unwrap()
            .num_layers;
        let toks: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % 500).collect();
        let whole = run_whole(&load(&dir, 0..n), &toks, 20);
        for cut in 1..n {
            let (a, b) = (load(&dir, 0..cut), load(&dir, cut..n));
            assert!(a.lm_head.is_none() && a.norm.is_none() && a.mtp.is_none());
            assert!(b.is_last_stage() && !b.is_first_stage());
            assert_eq!(a.layers.len() + b.layers.len(), n);
            let staged = run_staged(&a, &b, &toks, 20);
            assert_eq!(staged, whole, "{name} cut at layer {cut}");
        }
    }
}

#[test]
// The empty and reversed ranges are the point: each must be refused.
#[allow(clippy::reversed_empty_ranges)]
fn a_stage_outside_the_layers_is_refused() {
    let dir = fixture("qwen3_next_tiny");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let n = cfg.num_layers;
    for bad in [0..0, 2..1, 0..n + 1] {
        let err = Model::load_stage(
            cfg.clone(),
            &Checkpoint::open(&dir).unwrap(),
            CpuBackend::new(),
            None,
            bad.clone(),
        )
        .err()
        .unwrap_or_else(|| panic!("stage {bad:?} accepted"))
        .to_string();
        assert!(
            err.contains(&format!("{}..{}", bad.start, bad.end)),
            "{err}"
        );
        assert!(err.contains(&format!("{n}-layer")), "{err}");
    }
}
