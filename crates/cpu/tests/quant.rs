//! The CPU model on the compressed-tensors fixture (`qwen3_5_moe_text_tiny_quant`: INT4 g32 routed
//! experts, INT6 gapless shared experts, INT8 projections and embedding):
//! - it equals the dense model built from the dequantised values the Python quantiser recorded
//!   (`quant_reference.safetensors`), so the packed path loads every quantized tensor where it belongs;
//! - it tracks the bf16 checkpoint it was quantised from. The tiny random model is far more sensitive
//!   than a trained one: its prompt log-probs average −14, and quantising every Linear to INT8 (0.6 %
//!   weight error) alone moves single log-probs by up to 3.9 nats (mean 0.28) and changes the predicted
//!   token at 13 % of positions. The mixed fixture (INT4 g32 experts: 9 % weight error) measured a mean
//!   shift of 0.92 nats (max 8.9) and the same top-1 token at 57.5 % of 372 positions; the bounds below
//!   sit just outside that and far from what a misplaced tensor gives (unrelated outputs).

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, OutRows};
use sanmai_weights::{Checkpoint, HostTensor, Init, TensorData, TensorSource};

mod fixture_util;
mod step_util;
use fixture_util::{argmax, fixture, ids, log_softmax, reference};
use step_util::{logits, Seq};

const BLOCK: usize = 16;
const BLOCKS: usize = 64;

fn load(name: &str) -> Model<CpuBackend> {
    let dir = fixture(name);
    let ckpt = Checkpoint::open(&dir).unwrap();
    load_from(name, &ckpt)
}

fn load_from(name: &str, src: &dyn TensorSource) -> Model<CpuBackend> {
    let dir = fixture(name);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let model = Model::load(cfg, src, CpuBackend::new()).unwrap();
    model.init_cache(BLOCKS, BLOCK).unwrap();
    model
}

/// The bf16 checkpoint with every quantized Linear replaced by the Python side's dequantised f32 values.
struct Dequantised {
    base: Checkpoint,
    values: std::collections::HashMap<String, Vec<f32>>,
}

impl Dequantised {
    fn open() -> Self {
        let base = Checkpoint::open(&fixture("qwen3_5_moe_text_tiny")).unwrap();
        let raw = std::fs::read(
            fixture("qwen3_5_moe_text_tiny_quant").join("quant_reference.safetensors"),
        )
        .unwrap();
        let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&raw[8..8 + n]).unwrap();
        let mut values = std::collections::HashMap::new();
        for (name, info) in header.as_object().unwrap() {
            let Some(module) = name.strip_suffix(".dequant") else {
                continue;
            };
            assert_eq!(info["dtype"], "F32");
            let off = &info["data_offsets"];
            let (a, b) = (
                off[0].as_u64().unwrap() as usize,
                off[1].as_u64().unwrap() as usize,
            );
            let v = raw[8 + n + a..8 + n + b]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            values.insert(format!("{module}.weight"), v);
        }
        assert_eq!(values.len(), 154);
        Dequantised { base, values }
    }
}

impl TensorSource for Dequantised {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        init: Init,
    ) -> sanmai_weights::Result<HostTensor<'_>> {
        match self.values.get(name) {
            Some(v) => {
                assert_eq!(v.len(), shape.iter().product::<usize>(), "{name}");
                Ok(HostTensor {
                    name: name.into(),
                    shape: shape.to_vec(),
                    data: TensorData::F32(v.clone()),
                })
            }
            None => self.base.tensor(name, shape, init),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.base.contains(name)
    }
}

/// Every position's log-probabilities for `prompt`, one prefill.
fn logprobs(m: &Model<CpuBackend>, prompt: &[u32]) -> Vec<Vec<f64>> {
    let seq = Seq::new(m, (0..BLOCKS as u32).collect());
    let data = logits(m, &[seq.chunk(prompt, 0, prompt.len(), OutRows::All)]);
    m.backend.free_state(seq.state);
    data.chunks_exact(m.cfg.vocab_size)
        .map(log_softmax)
        .collect()
}

fn prompts() -> Vec<Vec<u32>> {
    reference(&fixture("qwen3_5_moe_text_tiny"))["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["ids"]))
        .collect()
}

#[test]
fn quantized_checkpoint_equals_the_dequantised_dense_model() {
    let quant = load("qwen3_5_moe_text_tiny_quant");
    let dense = load_from("qwen3_5_moe_text_tiny", &Dequantised::open());
    let mut worst = 0f64;
    for prompt in prompts() {
        let (a, b) = (logprobs(&quant, &prompt), logprobs(&dense, &prompt));
        for (x, y) in a.iter().zip(&b) {
            worst = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(worst, f64::max);
        }
    }
    eprintln!("packed checkpoint vs dense dequantised weights: max |Δ logprob| {worst:.1e}");
    assert!(worst < 1e-4, "{worst}");
}

#[test]
fn quantized_checkpoint_tracks_bf16_prompt_logprobs() {
    let bf16 = load("qwen3_5_moe_text_tiny");
    let quant = load("qwen3_5_moe_text_tiny_quant");
    let (mut worst, mut sum, mut count, mut same_top1, mut spread) =
        (0f64, 0f64, 0usize, 0usize, 0f64);
    for prompt in prompts() {
        let a = logprobs(&bf16, &prompt);
        let b = logprobs(&quant, &prompt);
        assert!(a != b, "quantisation must change something");
        for t in 1..prompt.len() {
            let tok = prompt[t] as usize;
            let d = (a[t - 1][tok] - b[t - 1][tok]).abs();
            worst = worst.max(d);
            sum += d;
            spread += a[t - 1][tok].abs();
            count += 1;
            same_top1 += usize::from(argmax(&a[t - 1]) == argmax(&b[t - 1]));
        }
    }
    let (mean, agree) = (sum / count as f64, same_top1 as f64 / count as f64);
    let mean_lp = spread / count as f64;
    eprintln!(
        "quantized vs bf16 over {count} prompt positions: max |Δ logprob| {worst:.3}, mean {mean:.3} \
         (mean |logprob| {mean_lp:.2}), same top-1 token at {:.1} %",
        100.0 * agree
    );
    assert!(
        mean < 0.1 * mean_lp,
        "mean shift {mean} against mean |logprob| {mean_lp}"
    );
    assert!(agree > 0.45, "top-1 agreement {agree}");
}
