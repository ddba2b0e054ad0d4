//! The built-in default model: a tiny Qwen3.5-MoE-shaped model with random weights from a fixed seed and
//! the real Qwen3.5/3.6 vocabulary, so the server runs with nothing downloaded.

use sanmai_config::ModelConfig;

/// The built-in model's `config.json`.
pub const CONFIG_JSON: &str = include_str!("../../../configs/models/builtin.json");

/// Its image processor's `preprocessor_config.json` (Qwen3.5's, at most 1 MP an image: its vision
/// tower runs on the CPU).
pub const PREPROCESSOR_JSON: &str =
    include_str!("../../../configs/models/builtin_preprocessor_config.json");

/// The seed its random weights are drawn from.
pub const SEED: u64 = 0x5a4e_4d41_4931;

/// The name the built-in model is served under.
pub const NAME: &str = "sanmai-demo";

pub fn config() -> ModelConfig {
    ModelConfig::from_json_str(CONFIG_JSON, "configs/models/builtin.json")
        .expect("the built-in config is valid")
}
