//! The built-in default model: a tiny Qwen3.5-MoE-shaped model with the real Qwen3.5/3.6 vocabulary,
//! so the server runs with nothing downloaded.
//!
//! Two forms share the name and the vocabulary:
//! - the **trained** model served by default: weights trained by `scripts/builtin_model` on generated
//!   chat exchanges (greetings, arithmetic, counting, echoing and reversing words, a table in the
//!   prompt, tool calls and tool results), its embedding INT4, embedded in the binary
//!   ([`trained_config`], [`trained_checkpoint`]);
//! - the **random** model ([`config`], random weights from [`SEED`]), for tests and benchmarks that
//!   need shapes, not answers (`--load-format dummy` without `--model`).

use sanmai_config::ModelConfig;
use sanmai_weights::Checkpoint;

/// The random built-in model's `config.json`.
pub const CONFIG_JSON: &str = include_str!("../../../configs/models/builtin.json");

/// Its image processor's `preprocessor_config.json` (Qwen3.5's, at most 1 MP an image: its vision
/// tower runs on the CPU).
pub const PREPROCESSOR_JSON: &str =
    include_str!("../../../configs/models/builtin_preprocessor_config.json");

/// The seed the random model's weights are drawn from.
pub const SEED: u64 = 0x5a4e_4d41_4931;

/// The name the built-in model is served under.
pub const NAME: &str = "sanmai-demo";

/// The trained model's `config.json` (its embedding quantized: a compressed-tensors INT4 group).
pub const TRAINED_CONFIG_JSON: &str = include_str!("../data/builtin/config.json");

/// Bytes aligned for the embedded safetensors file.
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

/// The trained model's `model.safetensors`.
static TRAINED_SAFETENSORS: &Aligned<[u8]> =
    &Aligned(*include_bytes!("../data/builtin/model.safetensors"));

/// What messages call the embedded checkpoint.
const TRAINED_PATH: &str = "<built-in sanmai-demo>";

/// The random model's config.
pub fn config() -> ModelConfig {
    ModelConfig::from_json_str(CONFIG_JSON, "configs/models/builtin.json")
        .expect("the built-in config is valid")
}

/// The trained model's config.
pub fn trained_config() -> ModelConfig {
    ModelConfig::from_json_str(TRAINED_CONFIG_JSON, "crates/model/data/builtin/config.json")
        .expect("the trained built-in config is valid")
}

/// The trained model's weights, read from the binary.
pub fn trained_checkpoint() -> Checkpoint {
    Checkpoint::from_static(TRAINED_PATH, &TRAINED_SAFETENSORS.0, TRAINED_CONFIG_JSON)
        .expect("the embedded built-in checkpoint is valid")
}

/// Bytes of the embedded weights.
pub fn trained_bytes() -> usize {
    TRAINED_SAFETENSORS.0.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sanmai_weights::TensorSource;

    #[test]
    fn trained_model_has_the_random_models_vocabulary_and_its_weights_are_embedded() {
        let (trained, random) = (trained_config(), config());
        assert_eq!(trained.vocab_size, random.vocab_size);
        assert_eq!(trained.eos_token_ids, random.eos_token_ids);
        let ckpt = trained_checkpoint();
        let q = ckpt.quantization().expect("the embedding is quantized");
        assert!(q
            .scheme_for_module("model.language_model.embed_tokens", false)
            .is_some());
        assert!(ckpt.contains("model.language_model.embed_tokens.weight"));
        assert!(ckpt.names().any(|n| n.starts_with("model.visual.")));
        assert!(ckpt.names().any(|n| n.starts_with("mtp.")));
        assert!(trained_bytes() < 12_000_000, "{} bytes", trained_bytes());
    }
}
