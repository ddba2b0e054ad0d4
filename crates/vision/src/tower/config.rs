//! The tower's shape: the checkpoint's `vision_config`, as transformers 5.17's
//! `Qwen3_5MoeVisionConfig` reads it. A missing field takes that class's default (the
//! Qwen3.5-35B-A3B tower's value); a present one of the wrong kind is an error naming it.
//! `deepstack_visual_indexes`, Qwen3-VL's extra feature levels, is not read: Qwen3.5's tower has no
//! deepstack mergers and transformers ignores the key.

use serde_json::Value;

use crate::{Result, VisionError};

/// The activation of the blocks' MLP (`hidden_act`, as transformers' `ACT2FN` names them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `gelu_pytorch_tanh` (and `gelu_new`, the same formula): GELU's tanh approximation.
    GeluTanh,
    /// `gelu`: the exact GELU, `x · Φ(x)` with erf.
    Gelu,
    /// `silu`: `x · sigmoid(x)`.
    Silu,
    /// `quick_gelu`: `x · sigmoid(1.702 x)`.
    QuickGelu,
}

impl Activation {
    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "gelu_pytorch_tanh" | "gelu_new" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            "silu" | "swish" => Activation::Silu,
            "quick_gelu" => Activation::QuickGelu,
            _ => return None,
        })
    }
}

/// The vision tower's sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Transformer blocks.
    pub depth: usize,
    /// Width of the patch tokens.
    pub hidden_size: usize,
    /// Attention heads; `hidden_size / num_heads` is the head dimension.
    pub num_heads: usize,
    /// Width of the blocks' MLP.
    pub intermediate_size: usize,
    /// Side of a patch in pixels.
    pub patch_size: usize,
    /// Frames a patch spans (an image is repeated over them by the preprocessor).
    pub temporal_patch_size: usize,
    /// Side of the square of patches that merges into one output token.
    pub spatial_merge_size: usize,
    /// Width of the merged tokens: the text model's hidden size.
    pub out_hidden_size: usize,
    /// Entries of the learned position table, a square of `side × side`.
    pub num_position_embeddings: usize,
    /// Colour channels of the pixels.
    pub in_channels: usize,
    /// The blocks' MLP activation.
    pub hidden_act: Activation,
    /// Base of the 2-D rotary embedding's frequencies (`rope_parameters.rope_theta`).
    pub rope_theta: f64,
}

impl Default for VisionConfig {
    /// transformers' `Qwen3_5MoeVisionConfig()` defaults.
    fn default() -> Self {
        VisionConfig {
            depth: 27,
            hidden_size: 1152,
            num_heads: 16,
            intermediate_size: 4304,
            patch_size: 16,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            out_hidden_size: 3584,
            num_position_embeddings: 2304,
            in_channels: 3,
            hidden_act: Activation::GeluTanh,
            rope_theta: 10_000.0,
        }
    }
}

impl VisionConfig {
    /// Parses a `vision_config` object; `file` names it in errors.
    pub fn from_value(v: &Value, file: &str) -> Result<Self> {
        let err = |field: &str, message: String| VisionError::Config {
            file: file.to_string(),
            field: field.to_string(),
            message,
        };
        let get = |path: &[&str]| -> Option<&Value> {
            path.iter()
                .try_fold(v, |v, k| v.get(k))
                .filter(|x| !x.is_null())
        };
        let count = |name: &str, default: usize| -> Result<usize> {
            match get(&[name]) {
                None => Ok(default),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| err(name, format!("expected a positive integer, found {x}"))),
            }
        };
        let d = Self::default();
        let hidden_act = match get(&["hidden_act"]) {
            None => d.hidden_act,
            Some(x) => x.as_str().and_then(Activation::from_name).ok_or_else(|| {
                err(
                    "hidden_act",
                    format!(
                        "expected gelu_pytorch_tanh, gelu_new, gelu, silu or quick_gelu, found {x}"
                    ),
                )
            })?,
        };
        if let Some(x) = get(&["rope_parameters", "rope_type"]) {
            if x.as_str() != Some("axial") {
                return Err(err(
                    "rope_parameters.rope_type",
                    format!("the tower's rotary embedding is axial, found {x}"),
                ));
            }
        }
        let theta_field = if get(&["rope_parameters", "rope_theta"]).is_some() {
            "rope_parameters.rope_theta"
        } else {
            "rope_theta"
        };
        let rope_theta = match get(&theta_field.split('.').collect::<Vec<_>>()) {
            None => d.rope_theta,
            Some(x) => x
                .as_f64()
                .filter(|t| *t > 1.0)
                .ok_or_else(|| err(theta_field, format!("expected a number above 1, found {x}")))?,
        };
        let cfg = VisionConfig {
            depth: count("depth", d.depth)?,
            hidden_size: count("hidden_size", d.hidden_size)?,
            num_heads: count("num_heads", d.num_heads)?,
            intermediate_size: count("intermediate_size", d.intermediate_size)?,
            patch_size: count("patch_size", d.patch_size)?,
            temporal_patch_size: count("temporal_patch_size", d.temporal_patch_size)?,
            spatial_merge_size: count("spatial_merge_size", d.spatial_merge_size)?,
            out_hidden_size: count("out_hidden_size", d.out_hidden_size)?,
            num_position_embeddings: count("num_position_embeddings", d.num_position_embeddings)?,
            in_channels: count("in_channels", d.in_channels)?,
            hidden_act,
            rope_theta,
        };
        if !cfg.hidden_size.is_multiple_of(cfg.num_heads) {
            return Err(err(
                "num_heads",
                format!(
                    "hidden_size {} is not a multiple of {} heads",
                    cfg.hidden_size, cfg.num_heads
                ),
            ));
        }
        if !cfg.head_dim().is_multiple_of(4) {
            return Err(err(
                "num_heads",
                format!(
                    "the head dimension {} is not a multiple of 4, which the 2-D rotary embedding needs",
                    cfg.head_dim()
                ),
            ));
        }
        let side = cfg.position_side();
        if side * side != cfg.num_position_embeddings {
            return Err(err(
                "num_position_embeddings",
                format!("{} is not a square", cfg.num_position_embeddings),
            ));
        }
        Ok(cfg)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Length of one patch row of pixels: `in_channels · temporal_patch_size · patch_size²`.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Side of the learned position table: `sqrt(num_position_embeddings)`.
    pub fn position_side(&self) -> usize {
        let n = self.num_position_embeddings;
        let mut s = (n as f64).sqrt() as usize;
        while s * s > n {
            s -= 1;
        }
        while (s + 1) * (s + 1) <= n {
            s += 1;
        }
        s
    }

    /// Patches that merge into one output token: `spatial_merge_size²`.
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_and_fields() {
        assert_eq!(
            VisionConfig::from_value(&json!({}), "c.json").unwrap(),
            VisionConfig::default()
        );
        let c = VisionConfig::from_value(
            &json!({"depth": 2, "hidden_size": 32, "num_heads": 2, "hidden_act": "gelu",
                    "rope_parameters": {"rope_theta": 500.0, "rope_type": "axial"},
                    "num_position_embeddings": 64}),
            "c.json",
        )
        .unwrap();
        assert_eq!((c.depth, c.head_dim(), c.position_side()), (2, 16, 8));
        assert_eq!((c.hidden_act, c.rope_theta), (Activation::Gelu, 500.0));
        assert_eq!(c.patch_len(), 3 * 2 * 16 * 16);
    }

    #[test]
    fn bad_fields_are_named() {
        for (v, field) in [
            (json!({"depth": 0}), "depth"),
            (json!({"hidden_size": "wide"}), "hidden_size"),
            (json!({"hidden_act": "relu6"}), "hidden_act"),
            (json!({"hidden_size": 30, "num_heads": 4}), "num_heads"),
            (json!({"hidden_size": 36, "num_heads": 6}), "num_heads"),
            (
                json!({"num_position_embeddings": 50}),
                "num_position_embeddings",
            ),
            (
                json!({"rope_parameters": {"rope_type": "default"}}),
                "rope_parameters.rope_type",
            ),
            (
                json!({"rope_parameters": {"rope_theta": "big"}}),
                "rope_parameters.rope_theta",
            ),
            (json!({"rope_theta": -1}), "rope_theta"),
        ] {
            let e = VisionConfig::from_value(&v, "c.json")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("c.json") && e.contains(&format!("`{field}`")),
                "{v}: {e}"
            );
        }
    }
}
