//! The tiny FP8 fixtures on the GPU (FP8 weights kept as bytes) against the CPU (the same bytes and
//! block scales dequantised to f32): prompt log-probs through one prefill chunk (the FP8 GEMM tiles)
//! and one-token decode steps (the FP8 GEMV and the grouped FP8 expert GEMV). The baseline is the same
//! checkpoint on the GPU with its FP8 weights dequantised to bf16 at load (what the backend did
//! before it kept FP8), against the same CPU run.

use std::path::{Path, PathBuf};

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_cuda::{CudaBackend, CudaWeight};
use sanmai_model::{Backend, Ffn, Model};
use sanmai_weights::{Checkpoint, HostTensor, Init, TensorSource};

use crate::logits::{log_softmax, step_logits};

const FIXTURES: [&str; 2] = ["qwen3_next_fp8_tiny", "qwen3_5_moe_fp8_tiny"];
/// The packed formats' end-to-end bounds (`tests/packed/e2e.rs`): mean |GPU − CPU| prompt log-prob at
/// most this or three times the bf16 baseline's, and no single position past `MAX_TOL`.
const MEAN_TOL: f64 = 0.1;
const MAX_TOL: f64 = 2.5;
const PREFILL: usize = 40;
const DECODE: usize = 12;
const BLOCK: usize = 16;
const BLOCKS: usize = 8;

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

/// A checkpoint that hands no tensor over packed: every FP8 weight comes as its f32 values.
struct Dequantised<'a>(&'a Checkpoint);

impl TensorSource for Dequantised<'_> {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        init: Init,
    ) -> sanmai_weights::Result<HostTensor<'_>> {
        self.0.tensor(name, shape, init)
    }

    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
}

fn load<B: Backend>(b: B, dir: &Path, src: &dyn TensorSource) -> Model<B> {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let m = Model::load(cfg, src, b).unwrap();
    m.init_cache(BLOCKS, BLOCK).unwrap();
    m
}

/// Log-prob rows of every position of `prompt`: one prefill chunk of `PREFILL` tokens, then one
/// decode step per token.
fn prompt_logprobs<B: Backend>(m: &Model<B>, prompt: &[u32]) -> Vec<Vec<f64>> {
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
    m.backend.free_state(state);
    rows
}

/// |a − b| of the prompt's next-token log-probs, position by position.
fn distance(a: &[Vec<f64>], b: &[Vec<f64>], prompt: &[u32]) -> Vec<f64> {
    (1..prompt.len())
        .map(|t| (a[t - 1][prompt[t] as usize] - b[t - 1][prompt[t] as usize]).abs())
        .collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

#[test]
fn fp8_fixtures_gpu_match_cpu() {
    let test = "fp8_fixtures_gpu_match_cpu";
    if let Err(e) = CudaBackend::new(0, &crate::options::cuda_options()) {
        eprintln!("skipped: {test}: {e}");
        return;
    }
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let gpu = || CudaBackend::new(0, &crate::options::cuda_options()).unwrap();
        let g = load(gpu(), &dir, &ckpt);
        // The converted Linears stay FP8 on the device: the routed experts, the attention and GDN
        // projections; the router and the lm_head (not converted) are bf16.
        let fp8_count = g.packed.iter().filter(|p| p.bits == 8).count();
        assert!(fp8_count > 0, "{name}: FP8 weights handed over packed");
        let Ffn::Moe(moe) = &g.layers[0].ffn else {
            panic!("{name}: layer 0 is MoE");
        };
        assert!(
            matches!(moe.experts[0].gate_up, CudaWeight::Fp8(_)),
            "{name}: expert kept FP8"
        );
        assert!(
            matches!(moe.router, CudaWeight::Bf16(_)),
            "{name}: router bf16"
        );
        let info = g
            .packed
            .iter()
            .find(|p| p.name.ends_with("layers.0.mlp.experts.0.gate_up_proj"))
            .expect("expert 0's gate|up recorded");
        // One byte a weight plus one f32 scale per row and 128 columns.
        let (n, k) = (info.out_features, info.in_features);
        assert_eq!(
            g.backend.weight_bytes(&moe.experts[0].gate_up),
            n * k + 4 * n * k.div_ceil(128)
        );
        let c = load(CpuBackend::default(), &dir, &ckpt);
        let vocab = g.cfg.vocab_size as u64;
        let mut s = 12345u64;
        let prompt: Vec<u32> = (0..PREFILL + DECODE)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) % vocab) as u32
            })
            .collect();
        let lg = prompt_logprobs(&g, &prompt);
        let lc = prompt_logprobs(&c, &prompt);
        let errs = distance(&lg, &lc, &prompt);
        drop(g);
        let dense = Dequantised(&ckpt);
        let b = load(gpu(), &dir, &dense);
        assert!(b.packed.is_empty(), "{name}: the baseline keeps no FP8");
        let base = distance(&prompt_logprobs(&b, &prompt), &lc, &prompt);
        drop(b);
        let base_mean = mean(&base);
        let mean_tol = MEAN_TOL.max(3.0 * base_mean);
        let worst = errs.iter().copied().fold(0.0, f64::max);
        let (pf, dc) = errs.split_at(PREFILL - 1);
        println!(
            "FP8 check=e2e model={name} tokens={} prefill={PREFILL} decode={DECODE} fp8_tensors={fp8_count} mean_abs={:.4} max_abs={worst:.4} prefill_mean={:.4} decode_mean={:.4} bf16_baseline_mean={base_mean:.4} bf16_baseline_max={:.4} tol_mean={mean_tol:.4} tol_max={MAX_TOL}",
            prompt.len(),
            mean(&errs),
            mean(pf),
            mean(dc),
            base.iter().copied().fold(0.0, f64::max),
        );
        assert!(
            mean(&errs) <= mean_tol,
            "{name}: mean |GPU − CPU| log-prob {} (bound {mean_tol})",
            mean(&errs)
        );
        assert!(worst <= MAX_TOL, "{name}: max |GPU − CPU| log-prob {worst}");
    }
}
