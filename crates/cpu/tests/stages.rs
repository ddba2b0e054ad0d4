//! Pipeline stages ([`Model::load_stage`], [`Model::step`] from [`StepStart::Streams`]): a fixture
//! loaded as two stages, each on its own backend with its own caches, the first handing its residual
//! streams to the second through the host, gives the whole model's logits bit for bit over a prefill
//! chunk and decode steps (GDN state, K/V, QSA index keys, PLE rows and conv state, hyper-connection
//! streams all cross the cut); and a stage outside the model's layers is refused with the numbers.

use std::ops::Range;
use std::path::Path;

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, OutRows, PleSource, StepInput, StepStart};
use sanmai_weights::Checkpoint;

mod fixture_util;
mod step_util;
use fixture_util::*;
use step_util::{host, logits, new_seq, BLOCKS_PER_SEQ};

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
    m.init_cache(BLOCKS_PER_SEQ, BLOCK).unwrap();
    m
}

/// Logits of the last position of each step: a prefill of `prefill` tokens, then one token a step.
fn run_whole(m: &Model<CpuBackend>, toks: &[u32], prefill: usize) -> Vec<Vec<f32>> {
    let seq = new_seq(m, 0);
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < toks.len() {
        let len = if pos == 0 { prefill } else { 1 };
        out.push(logits(m, &[seq.chunk(toks, pos, len, OutRows::Last)]));
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
        let first = a
            .step(StepInput {
                chunks: &[sa.chunk(toks, pos, len, OutRows::Last)],
                start: StepStart::Tokens,
                hidden: false,
            })
            .unwrap();
        assert!(first.logits.is_none() && first.hidden.is_none());
        let (r, c, v) = host(a, first.streams.unwrap());
        let last = b
            .step(StepInput {
                chunks: &[sb.chunk(toks, pos, len, OutRows::Last)],
                start: StepStart::Streams(b.backend.upload(r, c, v).unwrap()),
                hidden: false,
            })
            .unwrap();
        out.push(host(b, last.logits.unwrap()).2);
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
