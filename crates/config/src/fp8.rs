//! The `quantization_config` of the block-scaled FP8 releases (Qwen3-Next `-FP8`, Qwen3.5/3.6 FP8):
//!
//! ```json
//! "quantization_config": {
//!   "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
//!   "weight_block_size": [128, 128],
//!   "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", ...]
//! }
//! ```
//! Each converted Linear stores `weight` as float8_e4m3fn and `weight_scale_inv` as f32, one scale per
//! block of `weight_block_size` (rows × columns; the edge blocks may be partial): the weight is
//! `fp8(q) · scale_inv[block]`. The modules in `modules_to_not_convert` stay in the checkpoint's float
//! dtype; a checkpoint's loader goes by each tensor's stored dtype, so the list is kept as written.

use serde_json::Value;

use crate::fields::Fields;
use crate::quant::str_list;
use crate::Result;

/// A parsed FP8 `quantization_config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Config {
    /// Rows and columns of the weight each scale covers.
    pub block: [usize; 2],
    /// `modules_to_not_convert`, as written.
    pub not_converted: Vec<String>,
}

impl Fp8Config {
    /// Parses the `quantization_config` object; `file` names the file in errors.
    pub fn from_value(value: &Value, file: &str) -> Result<Self> {
        Self::from_fields(&Fields::new(value, file, "quantization_config.")?)
    }

    pub(crate) fn from_fields(f: &Fields) -> Result<Self> {
        let method = f.req_str("quant_method")?;
        if method != "fp8" {
            return Err(f.invalid("quant_method", format!("`{method}` is not fp8")));
        }
        let fmt = f.opt_str("fmt")?.unwrap_or_else(|| "e4m3".into());
        if fmt != "e4m3" {
            return Err(f.invalid(
                "fmt",
                format!("`{fmt}` is not served (only e4m3: float8_e4m3fn weights)"),
            ));
        }
        let scheme = f
            .opt_str("activation_scheme")?
            .unwrap_or_else(|| "dynamic".into());
        if scheme != "dynamic" {
            return Err(f.invalid(
                "activation_scheme",
                format!("`{scheme}` is not served (only dynamic: activations scaled per token group at run time)"),
            ));
        }
        let block = match f.get("weight_block_size") {
            Some(Value::Array(a)) if a.len() == 2 => {
                let dim = |v: &Value| v.as_u64().filter(|&d| d > 0).map(|d| d as usize);
                match (dim(&a[0]), dim(&a[1])) {
                    (Some(r), Some(c)) => [r, c],
                    _ => {
                        return Err(f.invalid(
                            "weight_block_size",
                            format!("expected two positive integers, found {}", Value::Array(a.clone())),
                        ))
                    }
                }
            }
            None | Some(Value::Null) => {
                return Err(f.invalid(
                    "weight_block_size",
                    "missing: per-tensor FP8 scales are not served (only block scales, e.g. [128, 128])"
                        .into(),
                ))
            }
            Some(v) => {
                return Err(f.invalid(
                    "weight_block_size",
                    format!("expected [rows, columns], found {v}"),
                ))
            }
        };
        let not_converted = str_list(f, "modules_to_not_convert")?;
        Ok(Fp8Config {
            block,
            not_converted,
        })
    }

    /// Whether the Linear `module` (its name without `.weight`) is stored in FP8: not when an entry
    /// of `modules_to_not_convert` names it, a module it belongs to (`lm_head`, `mtp.fc`,
    /// `model.layers.0.mlp.gate`) or its own last parts (`mlp.gate` names every layer's gate).
    pub fn converts(&self, module: &str) -> bool {
        !self.not_converted.iter().any(|p| {
            module == p
                || module.starts_with(&format!("{p}."))
                || module.ends_with(&format!(".{p}"))
        })
    }

    /// The scale grid of a `[rows, cols]` weight: `[ceil(rows / block rows), ceil(cols / block cols)]`.
    pub fn scale_shape(&self, rows: usize, cols: usize) -> [usize; 2] {
        [rows.div_ceil(self.block[0]), cols.div_ceil(self.block[1])]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn modules_to_not_convert_name_modules_their_parents_or_their_last_parts() {
        let c = Fp8Config {
            block: [128, 128],
            not_converted: vec!["lm_head".into(), "mtp.fc".into(), "mlp.gate".into()],
        };
        for kept in ["lm_head", "mtp.fc", "model.layers.3.mlp.gate"] {
            assert!(!c.converts(kept), "{kept}");
        }
        for fp8 in [
            "model.layers.3.mlp.gate_proj",
            "model.layers.3.mlp.shared_expert_gate",
            "mtp.layers.0.self_attn.q_proj",
        ] {
            assert!(c.converts(fp8), "{fp8}");
        }
    }

    fn parse(v: Value) -> Result<Fp8Config> {
        Fp8Config::from_value(&v, "config.json")
    }

    #[test]
    fn the_official_block_config_parses() {
        let c = parse(json!({
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "mtp.fc"]
        }))
        .unwrap();
        assert_eq!(c.block, [128, 128]);
        assert_eq!(c.not_converted.len(), 3);
        assert_eq!(c.scale_shape(300, 128), [3, 1]);
        assert_eq!(c.scale_shape(64, 129), [1, 2]);
    }

    #[test]
    fn unsupported_fields_are_named() {
        let base = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]});
        for (key, value, word) in [
            ("fmt", json!("e5m2"), "fmt"),
            ("activation_scheme", json!("static"), "activation_scheme"),
            ("weight_block_size", json!([128]), "weight_block_size"),
            ("weight_block_size", json!([0, 128]), "weight_block_size"),
            ("weight_block_size", Value::Null, "weight_block_size"),
            (
                "modules_to_not_convert",
                json!("lm_head"),
                "modules_to_not_convert",
            ),
        ] {
            let mut v = base.clone();
            v[key] = value;
            let e = parse(v).unwrap_err().to_string();
            assert!(e.contains(word) && e.contains("config.json"), "{key}: {e}");
        }
    }
}
