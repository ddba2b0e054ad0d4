//! Rotary position embedding parameters: the `rope_parameters` form of transformers 5 and the older
//! `rope_scaling` / flat `rope_theta` / `partial_rotary_factor` fields, with plain, linear and YaRN scaling.

use serde_json::Value;

use crate::fields::Fields;
use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (`rope_type: linear`).
    Linear {
        factor: f64,
    },
    /// YaRN (`rope_type: yarn`), as transformers' `_compute_yarn_parameters`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub partial_rotary_factor: f64,
    /// Rotated dims per head: `int(head_dim · partial_rotary_factor)`.
    pub rot_dim: usize,
    /// Interleaved MRoPE sections (T, H, W) in frequency pairs; for text the three positions are equal.
    pub mrope_section: Option<[usize; 3]>,
    pub mrope_interleaved: bool,
    pub scaling: RopeScaling,
}

impl RopeConfig {
    pub(crate) fn from_fields(text: &Fields, head_dim: usize) -> Result<Self> {
        // Priority as in transformers: the dict (`rope_scaling` or `rope_parameters`), then flat fields.
        let (dict_name, dict) = ["rope_scaling", "rope_parameters"]
            .into_iter()
            .find_map(|n| match text.get(n) {
                Some(v @ Value::Object(_)) => Some((n, Some(v))),
                _ => None,
            })
            .unwrap_or(("rope_parameters", None));
        let d = match dict {
            Some(v) => Some(Fields::new(v, "", "")?),
            None => None,
        };
        let field = |name: &str| format!("{dict_name}.{name}");
        let num = |name: &str| -> Result<Option<f64>> {
            match &d {
                Some(d) => d
                    .opt_f64(name)
                    .map_err(|_| text.invalid(&field(name), "expected a number".into())),
                None => Ok(None),
            }
        };
        let theta = match num("rope_theta")? {
            Some(t) => t,
            None => text.opt_f64("rope_theta")?.unwrap_or(10000.0),
        };
        let partial_rotary_factor = match num("partial_rotary_factor")? {
            Some(p) => p,
            None => text.opt_f64("partial_rotary_factor")?.unwrap_or(0.25),
        };
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(text.invalid(
                "partial_rotary_factor",
                format!("{partial_rotary_factor} is not in (0, 1]"),
            ));
        }
        let rot_dim = (head_dim as f64 * partial_rotary_factor) as usize;
        if rot_dim == 0 || !rot_dim.is_multiple_of(2) {
            return Err(text.invalid(
                "partial_rotary_factor",
                format!("head_dim {head_dim} × {partial_rotary_factor} gives {rot_dim} rotary dims (must be even and > 0)"),
            ));
        }
        let rope_type = match &d {
            Some(d) => d
                .opt_str("rope_type")
                .ok()
                .flatten()
                .or_else(|| d.opt_str("type").ok().flatten())
                .unwrap_or_else(|| "default".into()),
            None => "default".into(),
        };
        let mrope_section = match d.as_ref().and_then(|d| d.get("mrope_section")) {
            None | Some(Value::Null) => None,
            Some(v) => {
                let s: Option<Vec<usize>> = v
                    .as_array()
                    .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect());
                match s.as_deref() {
                    Some([t, h, w]) if t + h + w == rot_dim / 2 => Some([*t, *h, *w]),
                    _ => {
                        return Err(text.invalid(
                            &field("mrope_section"),
                            format!(
                                "expected three sections summing to rot_dim/2 = {}, found {v}",
                                rot_dim / 2
                            ),
                        ))
                    }
                }
            }
        };
        let mrope_interleaved = d
            .as_ref()
            .and_then(|d| d.get("mrope_interleaved"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if mrope_section.is_some() && !mrope_interleaved {
            return Err(text.invalid(
                &field("mrope_interleaved"),
                "only interleaved MRoPE (Qwen3.5 style) is supported".into(),
            ));
        }
        let req =
            |name: &str| -> Result<f64> { num(name)?.ok_or_else(|| text.missing(&field(name))) };
        let scaling = match rope_type.as_str() {
            "default" | "mrope" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: req("factor")?,
            },
            "yarn" => {
                let factor = req("factor")?;
                let original = match num("original_max_position_embeddings")? {
                    Some(o) => o,
                    None => return Err(text.missing(&field("original_max_position_embeddings"))),
                };
                let mscale = num("mscale")?;
                let mscale_all_dim = num("mscale_all_dim")?;
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None => match (mscale, mscale_all_dim) {
                        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                            get_mscale(factor, m) / get_mscale(factor, a)
                        }
                        _ => get_mscale(factor, 1.0),
                    },
                };
                let truncate = d
                    .as_ref()
                    .and_then(|d| d.get("truncate"))
                    .and_then(Value::as_bool)
                    .unwrap_or(true);
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: num("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0),
                    beta_slow: num("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0),
                    attention_factor,
                    truncate,
                }
            }
            other => {
                return Err(text.invalid(
                    &field("rope_type"),
                    format!("RoPE scaling `{other}` is not supported (default, linear, yarn are)"),
                ))
            }
        };
        Ok(RopeConfig {
            theta,
            partial_rotary_factor,
            rot_dim,
            mrope_section,
            mrope_interleaved,
            scaling,
        })
    }

    /// Inverse frequencies, `rot_dim / 2` of them, with the scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.rot_dim;
        let base = self.theta;
        let plain: Vec<f64> = (0..dim / 2)
            .map(|j| 1.0 / base.powf((2 * j) as f64 / dim as f64))
            .collect();
        match &self.scaling {
            RopeScaling::None => plain.iter().map(|&f| f as f32).collect(),
            RopeScaling::Linear { factor } => plain.iter().map(|&f| (f / factor) as f32).collect(),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let correction_dim = |rot: f64| {
                    (dim as f64
                        * (original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI))
                            .ln())
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                plain
                    .iter()
                    .enumerate()
                    .map(|(j, &extra)| {
                        let ramp = ((j as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        let inter = extra / factor;
                        (inter * (1.0 - extrapolation) + extra * extrapolation) as f32
                    })
                    .collect()
            }
        }
    }

    /// The factor cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    pub fn attention_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor as f32,
            _ => 1.0,
        }
    }
}
