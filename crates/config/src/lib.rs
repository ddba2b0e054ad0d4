//! Model configuration: turns a Hugging Face `config.json` into a typed [`ModelConfig`].
//!
//! Owns the knowledge of which architectures exist (`qwen3_next`, `qwen3_5_moe` and its text-only form,
//! `qwen4_exp`), their defaults, which layer is attention or GDN, dense or MoE, and the RoPE parameters
//! (plain, linear or YaRN), and the qwen4_exp extension blocks `qsa`, `ple` (the PLE table's shape,
//! which the table tools also read on its own) and `hyper_connections`. Unknown fields are ignored; a
//! missing required field or a value the engine cannot serve is an error naming the field.

mod blocks;
mod fields;
mod fp8;
mod ple;
mod quant;
mod rope;
mod vision;

use std::path::Path;

use serde_json::Value;

pub use blocks::{HyperConnectionsConfig, QsaConfig};
use fields::Fields;
pub use fp8::Fp8Config;
pub use ple::{PleConfig, PleConfigError};
pub use quant::{QuantConfig, QuantScheme};
pub use rope::{RopeConfig, RopeScaling};
pub use vision::VisionSpec;

/// Errors from reading a model configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("{file}: field `{field}` is missing")]
    Missing { file: String, field: String },
    #[error("{file}: field `{field}`: {message}")]
    Invalid {
        file: String,
        field: String,
        message: String,
    },
}

pub type Result<T> = std::result::Result<T, ConfigError>;

/// The model families the engine serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen3-Next: grouped `in_proj_qkvz` / `in_proj_ba`, optional dense `mlp_only_layers`.
    Qwen3Next,
    /// Qwen3.5/3.6-MoE (multimodal wrapper, text under `text_config`, weights under `model.language_model.`).
    Qwen35Moe,
    /// Qwen3.5/3.6-MoE text-only (`qwen3_5_moe_text`).
    Qwen35MoeText,
    /// The seed model: Qwen3.5-MoE plus optional extension blocks.
    Qwen4Exp,
}

impl Arch {
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen3Next => "qwen3_next",
            Arch::Qwen35Moe => "qwen3_5_moe",
            Arch::Qwen35MoeText => "qwen3_5_moe_text",
            Arch::Qwen4Exp => "qwen4_exp",
        }
    }

    /// Whether the GDN input projections are Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba`.
    pub fn grouped_gdn_projections(self) -> bool {
        self == Arch::Qwen3Next
    }
}

/// The mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    FullAttention,
    LinearAttention,
}

/// The feed-forward block of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnType {
    Dense,
    Moe,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Gated delta net (linear attention) shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct GdnConfig {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
}

impl GdnConfig {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }
    /// Channels of the causal conv: `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
    /// 0 when the model has no shared expert.
    pub shared_intermediate_size: usize,
    pub norm_topk_prob: bool,
}

/// A typed model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub layer_types: Vec<LayerType>,
    pub ffn_types: Vec<FfnType>,
    /// Width of dense MLP layers (`intermediate_size`).
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub attention: AttentionConfig,
    pub gdn: GdnConfig,
    pub moe: Option<MoeConfig>,
    pub rope: RopeConfig,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Number of MTP draft layers carried under `mtp.*` (0 = none).
    pub mtp_layers: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// Prefix of the text model's tensors (`model.` or `model.language_model.`).
    pub weight_prefix: String,
    /// The compressed-tensors weight quantization (`quantization_config` with `quant_method:
    /// compressed-tensors`); `None` = no packed weights.
    pub quantization: Option<QuantConfig>,
    /// The block-scaled FP8 weights (`quantization_config` with `quant_method: fp8`).
    pub fp8: Option<Fp8Config>,
    /// qwen4_exp: sparse attention with a lightning indexer on every full-attention layer.
    pub qsa: Option<QsaConfig>,
    /// qwen4_exp: the hashed n-gram memory (PLE) inserted before the mixers of `ple.layer_ids`.
    pub ple: Option<PleConfig>,
    /// qwen4_exp: S residual streams with gated residuals.
    pub hyper_connections: Option<HyperConnectionsConfig>,
    /// The vision tower and image token ids, when the top level carries a `vision_config`
    /// (multimodal wrappers and qwen4_exp); the text model ignores them.
    pub vision: Option<VisionSpec>,
}

impl ModelConfig {
    /// Reads `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: name.clone(),
            source,
        })?;
        Self::from_json_str(&text, &name)
    }

    /// Parses the text of a `config.json`; `file` names it in errors.
    pub fn from_json_str(text: &str, file: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| ConfigError::Json {
            path: file.to_string(),
            source,
        })?;
        Self::from_value(&value, file)
    }

    /// Builds the typed config from parsed JSON.
    pub fn from_value(root: &Value, file: &str) -> Result<Self> {
        let top = Fields::new(root, file, "")?;
        let model_type = top.req_str("model_type")?;
        let arch = match model_type.as_str() {
            "qwen3_next" => Arch::Qwen3Next,
            "qwen3_5_moe" => Arch::Qwen35Moe,
            "qwen3_5_moe_text" => Arch::Qwen35MoeText,
            "qwen4_exp" => Arch::Qwen4Exp,
            other => {
                return Err(top.invalid(
                    "model_type",
                    format!(
                        "`{other}` is not served; supported: qwen3_next, qwen3_5_moe, qwen3_5_moe_text, qwen4_exp"
                    ),
                ))
            }
        };
        // The multimodal wrapper keeps the text model under `text_config`.
        let text = if arch == Arch::Qwen35Moe {
            top.child("text_config")?
        } else {
            top.clone()
        };
        let quant_block = match (
            top.has("quantization_config"),
            text.has("quantization_config"),
        ) {
            (true, _) => Some(top.child("quantization_config")?),
            (false, true) => Some(text.child("quantization_config")?),
            (false, false) => None,
        };
        let (quantization, fp8) = match &quant_block {
            None => (None, None),
            Some(q) if q.opt_str("quant_method")?.as_deref() == Some("fp8") => {
                (None, Some(Fp8Config::from_fields(q)?))
            }
            Some(q) => (Some(QuantConfig::from_fields(q)?), None),
        };
        if top.has("compression_config") || text.has("compression_config") {
            return Err(top.invalid(
                "compression_config",
                "the legacy compression_config block is not served (use quantization_config)"
                    .into(),
            ));
        }
        let act = text.opt_str("hidden_act")?.unwrap_or_else(|| "silu".into());
        if act != "silu" {
            return Err(text.invalid(
                "hidden_act",
                format!("`{act}` is not supported (only silu)"),
            ));
        }
        if text.opt_bool("attention_bias")?.unwrap_or(false) {
            return Err(text.invalid(
                "attention_bias",
                "attention biases are not supported".into(),
            ));
        }

        let vocab_size = text.req_usize("vocab_size")?;
        let hidden_size = text.req_usize("hidden_size")?;
        let num_layers = text.req_usize("num_hidden_layers")?;
        let num_heads = text.req_usize("num_attention_heads")?;
        let num_kv_heads = text.req_usize("num_key_value_heads")?;
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(text.invalid(
                "num_key_value_heads",
                format!("{num_kv_heads} must divide num_attention_heads = {num_heads}"),
            ));
        }
        let head_dim = text
            .opt_usize("head_dim")?
            .unwrap_or(hidden_size / num_heads);
        let attention = AttentionConfig {
            num_heads,
            num_kv_heads,
            head_dim,
        };

        let gdn = GdnConfig {
            num_k_heads: text.opt_usize("linear_num_key_heads")?.unwrap_or(16),
            num_v_heads: text.opt_usize("linear_num_value_heads")?.unwrap_or(32),
            k_head_dim: text.opt_usize("linear_key_head_dim")?.unwrap_or(128),
            v_head_dim: text.opt_usize("linear_value_head_dim")?.unwrap_or(128),
            conv_kernel: text.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        };
        if gdn.num_k_heads == 0 || !gdn.num_v_heads.is_multiple_of(gdn.num_k_heads) {
            return Err(text.invalid(
                "linear_num_value_heads",
                format!(
                    "{} must be a multiple of linear_num_key_heads = {}",
                    gdn.num_v_heads, gdn.num_k_heads
                ),
            ));
        }

        let layer_types = match text.get("layer_types") {
            Some(v) => {
                let arr = v.as_array().ok_or_else(|| {
                    text.invalid("layer_types", "expected an array of strings".into())
                })?;
                if arr.len() != num_layers {
                    return Err(text.invalid(
                        "layer_types",
                        format!(
                            "has {} entries but num_hidden_layers = {num_layers}",
                            arr.len()
                        ),
                    ));
                }
                arr.iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") | Some("attention") => Ok(LayerType::FullAttention),
                        Some("linear_attention") => Ok(LayerType::LinearAttention),
                        _ => Err(text.invalid("layer_types", format!("unknown layer type {t}"))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                let interval = text
                    .opt_usize("full_attention_interval")?
                    .unwrap_or(4)
                    .max(1);
                (0..num_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect()
            }
        };

        let num_experts = text.opt_usize("num_experts")?.unwrap_or(0);
        let moe = if num_experts > 0 {
            let top_k = text.req_usize("num_experts_per_tok")?;
            if top_k == 0 || top_k > num_experts {
                return Err(text.invalid(
                    "num_experts_per_tok",
                    format!("{top_k} must be in 1..={num_experts}"),
                ));
            }
            Some(MoeConfig {
                num_experts,
                top_k,
                intermediate_size: text.req_usize("moe_intermediate_size")?,
                shared_intermediate_size: text
                    .opt_usize("shared_expert_intermediate_size")?
                    .unwrap_or(0),
                // Qwen3.5 and the seed model always renormalise; Qwen3-Next follows its flag.
                norm_topk_prob: match arch {
                    Arch::Qwen3Next => text.opt_bool("norm_topk_prob")?.unwrap_or(true),
                    _ => true,
                },
            })
        } else {
            None
        };
        let mlp_only: Vec<usize> = match text.get("mlp_only_layers") {
            Some(Value::Null) | None => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                .ok_or_else(|| {
                    text.invalid(
                        "mlp_only_layers",
                        "expected an array of layer indices".into(),
                    )
                })?,
        };
        let sparse_step = text.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1);
        let ffn_types: Vec<FfnType> = (0..num_layers)
            .map(|i| {
                if moe.is_some() && !mlp_only.contains(&i) && (i + 1) % sparse_step == 0 {
                    FfnType::Moe
                } else {
                    FfnType::Dense
                }
            })
            .collect();
        let intermediate_size = match text.opt_usize("intermediate_size")? {
            Some(v) => v,
            None if ffn_types.contains(&FfnType::Dense) => {
                return Err(text.missing("intermediate_size"))
            }
            None => 0,
        };

        let rope = RopeConfig::from_fields(&text, head_dim)?;
        let max_position_embeddings = text.opt_usize("max_position_embeddings")?.unwrap_or(32768);
        let mtp_layers = match arch {
            Arch::Qwen3Next => text.opt_usize("num_nextn_predict_layers")?.unwrap_or(0),
            _ => text.opt_usize("mtp_num_hidden_layers")?.unwrap_or(0),
        };
        if mtp_layers > 1 {
            return Err(text.invalid(
                "mtp_num_hidden_layers",
                format!("{mtp_layers} MTP layers: at most 1 is supported"),
            ));
        }
        let eos_token_ids = match text.get("eos_token_id").or_else(|| top.get("eos_token_id")) {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|x| x as u32))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| text.invalid("eos_token_id", "expected integers".into()))?,
            Some(v) => vec![v
                .as_u64()
                .ok_or_else(|| text.invalid("eos_token_id", "expected an integer".into()))?
                as u32],
        };
        let tie_word_embeddings = text
            .opt_bool("tie_word_embeddings")?
            .or(top.opt_bool("tie_word_embeddings")?)
            .unwrap_or(false);
        // The extension blocks belong to qwen4_exp; other architectures ignore such fields.
        let (qsa, ple, hyper_connections) = if arch == Arch::Qwen4Exp {
            (
                blocks::parse_qsa(&text)?,
                blocks::parse_ple(&text, &layer_types)?,
                blocks::parse_hc(&text)?,
            )
        } else {
            (None, None, None)
        };
        let vision = match arch {
            Arch::Qwen35Moe | Arch::Qwen4Exp => vision::parse(&top)?,
            _ => None,
        };
        let weight_prefix = if arch == Arch::Qwen35Moe {
            "model.language_model.".to_string()
        } else {
            "model.".to_string()
        };

        Ok(ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            num_layers,
            layer_types,
            ffn_types,
            intermediate_size,
            rms_norm_eps: text.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            attention,
            gdn,
            moe,
            rope,
            max_position_embeddings,
            tie_word_embeddings,
            mtp_layers,
            eos_token_ids,
            bos_token_id: text.opt_usize("bos_token_id")?.map(|x| x as u32),
            pad_token_id: text.opt_usize("pad_token_id")?.map(|x| x as u32),
            weight_prefix,
            quantization,
            fp8,
            qsa,
            ple,
            hyper_connections,
            vision,
        })
    }

    pub fn num_attention_layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|t| **t == LayerType::FullAttention)
            .count()
    }

    pub fn num_gdn_layers(&self) -> usize {
        self.num_layers - self.num_attention_layers()
    }
}

#[cfg(test)]
mod tests;
