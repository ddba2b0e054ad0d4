//! The quantized tiny fixture on the GPU (packed) against the CPU (the same integers dequantised):
//! prompt log-probs through one prefill chunk (the tiled packed GEMM) and then one-token decode steps
//! (the packed GEMV and the packed grouped GEMV of the experts).

use std::path::{Path, PathBuf};

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_cuda::{CudaBackend, CudaWeight};
use sanmai_model::{Backend, Ffn, Model};
use sanmai_weights::Checkpoint;

use crate::logits::{log_softmax, step_logits};

const FIXTURE: &str = "qwen3_5_moe_text_tiny_quant";
/// The bf16 checkpoint the quantized fixture was made from: its GPU − CPU distance on the same prompt
/// is the baseline of bf16 activations alone.
const BASE_FIXTURE: &str = "qwen3_5_moe_text_tiny";
/// Bound on the mean |GPU − CPU| prompt log-prob: the integers and scales are the same on both, so
/// the difference is bf16 activations and accumulation order only: at most this, or three times the
/// bf16 checkpoint's own distance on the same prompt (these tiny random models amplify rounding).
pub(crate) const MEAN_TOL: f64 = 0.1;
/// Bound on the largest single |GPU − CPU| prompt log-prob: that of the end-to-end tests on the same
/// random fixtures (`tests/e2e`), where one position near a top-2 tie moves by more than 1.
pub(crate) const MAX_TOL: f64 = 2.5;
pub(crate) const PREFILL: usize = 40;
const DECODE: usize = 12;
pub(crate) const BLOCK: usize = 16;
pub(crate) const BLOCKS: usize = 8;

fn fixture() -> PathBuf {
    fixture_dir(FIXTURE)
}

fn fixture_dir(name: &str) -> PathBuf {
    let dirs = [
        std::env::var_os("SANMAI_FIXTURES").map(PathBuf::from),
        Some(PathBuf::from("tests/fixtures")),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")),
    ];
    dirs.into_iter()
        .flatten()
        .map(|d| d.join(name))
        .find(|d| d.is_dir())
        .unwrap_or_else(|| panic!("fixture {name} not found: set SANMAI_FIXTURES"))
}

fn load<B: Backend>(b: B) -> Model<B> {
    load_dir(b, &fixture())
}

fn load_dir<B: Backend>(b: B, dir: &Path) -> Model<B> {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let m = Model::load(cfg, &ckpt, b).unwrap();
    m.init_cache(BLOCKS, BLOCK).unwrap();
    m
}

/// A deterministic prompt of `n` tokens below `vocab` (a linear congruential sequence from `seed`).
pub(crate) fn lcg_prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Log-prob rows of every position of `prompt`: one prefill chunk of `PREFILL` tokens, then one
/// decode step per token.
pub(crate) fn prompt_logprobs<B: Backend>(m: &Model<B>, prompt: &[u32]) -> Vec<Vec<f64>> {
    let state = m.backend.alloc_state().unwrap();
    let blocks: Vec<u32> = (0..BLOCKS as u32).collect();
    let mut rows = Vec::new();
    let mut pos = 0;
    while pos < prompt.len() {
        let len = if pos == 0 { PREFILL } else { 1 };
        let (r, c, data) = step_logits(m, prompt, (pos, len), state, &blocks);
        rows.extend((0..r).map(|i| log_softmax(&data[i * c..(i + 1) * c])));
        pos += len;
    }
    rows
}

/// Without a GPU: the fixture's routed experts (INT4 g32), shared experts (INT6 gapless) and
/// projections (INT8, the lm_head and the embedding table included) reach the backend packed; the router does not.
#[test]
fn quant_fixture_loads_packed() {
    let c = load(CpuBackend::default());
    let count = |bits: u32, group: usize| {
        c.packed
            .iter()
            .filter(|p| p.bits == bits && p.group_size == group)
            .count()
    };
    // 5 MoE layers (4 + MTP) × 8 experts × (gate|up, down).
    assert_eq!(count(4, 32), 5 * 8 * 2, "{:?}", c.packed);
    assert_eq!(count(6, 0), 5 * 2, "shared gate|up and down per MoE layer");
    for name in ["lm_head.weight", "model.embed_tokens.weight"] {
        assert!(
            c.packed.iter().any(|p| p.name == name && p.bits == 8),
            "{name}"
        );
    }
    assert!(!c.packed.iter().any(|p| p.name.ends_with("mlp.gate.weight")));
    let info = c
        .packed
        .iter()
        .find(|p| p.name == "model.layers.0.mlp.experts.0.gate_up_proj")
        .expect("expert 0's gate|up recorded");
    // [64, 64] INT4 g32: 8 words and 2 scales a row.
    assert_eq!(info.bytes, 64 * (8 + 2) * 4);
    println!(
        "PACKED check=fixture_load model={FIXTURE} packed_tensors={} int4_g32={} int6={} int8={}",
        c.packed.len(),
        count(4, 32),
        count(6, 0),
        count(8, 0)
    );
}

#[test]
fn quant_fixture_gpu_matches_cpu() {
    let test = "quant_fixture_gpu_matches_cpu";
    let gpu = match CudaBackend::new(0, &crate::options::cuda_options()) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            return;
        }
    };
    let g = load(gpu);
    let c = load(CpuBackend::default());

    // The GPU keeps the packed weights packed (which they are: `quant_fixture_loads_packed`).
    assert_eq!(
        g.packed, c.packed,
        "both backends were handed the same packed weights"
    );
    let Ffn::Moe(moe) = &g.layers[0].ffn else {
        panic!("layer 0 is MoE");
    };
    let e0 = &moe.experts[0].gate_up;
    assert!(matches!(e0, CudaWeight::Packed(_)), "expert kept packed");
    let info = g
        .packed
        .iter()
        .find(|p| p.name == "model.layers.0.mlp.experts.0.gate_up_proj")
        .expect("expert 0's gate|up recorded");
    assert_eq!(g.backend.weight_bytes(e0), info.bytes);
    assert!(
        matches!(moe.router, CudaWeight::Bf16(_)),
        "router left bf16"
    );
    assert!(
        matches!(g.lm_head, Some(CudaWeight::Packed(_))),
        "lm_head packed"
    );
    assert!(
        matches!(g.embedding(), CudaWeight::Packed(_)),
        "embedding table packed"
    );

    let prompt = lcg_prompt(12345, PREFILL + DECODE, g.cfg.vocab_size);
    let lg = prompt_logprobs(&g, &prompt);
    let lc = prompt_logprobs(&c, &prompt);
    let distance = |a: &[Vec<f64>], b: &[Vec<f64>]| -> Vec<f64> {
        (1..prompt.len())
            .map(|t| (a[t - 1][prompt[t] as usize] - b[t - 1][prompt[t] as usize]).abs())
            .collect()
    };
    let errs = distance(&lg, &lc);
    drop((g, c));
    let base_dir = fixture_dir(BASE_FIXTURE);
    let bg = load_dir(
        CudaBackend::new(0, &crate::options::cuda_options()).unwrap(),
        &base_dir,
    );
    let bc = load_dir(CpuBackend::default(), &base_dir);
    let base = distance(
        &prompt_logprobs(&bg, &prompt),
        &prompt_logprobs(&bc, &prompt),
    );
    let base_mean = base.iter().sum::<f64>() / base.len() as f64;
    let mean_tol = MEAN_TOL.max(3.0 * base_mean);
    let mean = errs.iter().sum::<f64>() / errs.len() as f64;
    let worst = errs.iter().copied().fold(0.0, f64::max);
    let (pf, dc) = errs.split_at(PREFILL - 1);
    let pf_mean = pf.iter().sum::<f64>() / pf.len() as f64;
    let dc_mean = dc.iter().sum::<f64>() / dc.len().max(1) as f64;
    let agree = (0..prompt.len())
        .filter(|&t| argmax(&lg[t]) == argmax(&lc[t]))
        .count();
    println!(
        "PACKED check=e2e model={FIXTURE} tokens={} prefill={PREFILL} decode={DECODE} mean_abs={mean:.4} max_abs={worst:.4} prefill_mean={pf_mean:.4} decode_mean={dc_mean:.4} argmax_agree={agree}/{} bf16_baseline_mean={base_mean:.4} tol_mean={mean_tol:.4} tol_max={MAX_TOL}",
        prompt.len(),
        prompt.len()
    );
    assert!(
        mean <= mean_tol,
        "mean |GPU − CPU| log-prob {mean} (bound {mean_tol})"
    );
    assert!(worst <= MAX_TOL, "max |GPU − CPU| log-prob {worst}");
}

pub(crate) fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}
