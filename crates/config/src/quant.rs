//! The `quantization_config` block of a compressed-tensors `pack-quantized` checkpoint: which Linear
//! gets which weight-only integer scheme.
//!
//! ```json
//! "quantization_config": {
//!   "quant_method": "compressed-tensors", "format": "pack-quantized",
//!   "config_groups": {
//!     "experts": {"targets": ["re:.*mlp\\.experts\\..*"],
//!                 "weights": {"num_bits": 4, "type": "int", "symmetric": true,
//!                             "strategy": "group", "group_size": 128}},
//!     "shared":  {"targets": ["re:.*shared_expert\\.(gate|up|down)_proj$"], "format": "int6-gapless",
//!                 "weights": {"num_bits": 6, "type": "int", "symmetric": true, "strategy": "channel"}}
//!   },
//!   "ignore": ["lm_head", "re:.*mlp\\.gate$"]
//! }
//! ```
//! Matching follows compressed-tensors: a name in `ignore` is never quantized; otherwise the first group
//! (in file order) with an exact-name target wins, then the first with a matching `re:` target (matched
//! from the start of the name), then the first whose target is the class name `Linear`. Only symmetric
//! `int` weights are served: INT4 and INT8 in `pack-quantized` layout, INT6 in the `int6-gapless` layout.

use regex::Regex;
use serde_json::Value;

use crate::fields::Fields;
use crate::Result;

/// How one Linear's weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantScheme {
    /// 4, 6 or 8.
    pub bits: u32,
    /// Inputs per scale (`strategy: group`); 0 = one scale per output row (`strategy: channel`).
    pub group_size: usize,
}

impl QuantScheme {
    /// Whether the int32 words hold values with no gap bits (INT6 gapless) rather than whole values per
    /// word (INT4: 8 per word, INT8: 4 per word).
    pub fn gapless(&self) -> bool {
        self.bits == 6
    }
}

#[derive(Debug, Clone)]
enum Target {
    /// The class name `Linear`: every Linear the caller asks about.
    Linear,
    Exact(String),
    Regex(Regex),
}

impl Target {
    fn parse(text: &str, fields: &Fields, field: &str) -> Result<Target> {
        if let Some(pat) = text.strip_prefix("re:") {
            let re = Regex::new(&format!("^(?:{pat})"))
                .map_err(|e| fields.invalid(field, format!("bad regex `{pat}`: {e}")))?;
            Ok(Target::Regex(re))
        } else if text == "Linear" {
            Ok(Target::Linear)
        } else {
            Ok(Target::Exact(text.to_string()))
        }
    }

    fn matches(&self, module: &str, is_linear: bool) -> bool {
        match self {
            Target::Linear => is_linear,
            Target::Exact(n) => n == module,
            Target::Regex(re) => re.is_match(module),
        }
    }
}

impl PartialEq for Target {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Target::Linear, Target::Linear) => true,
            (Target::Exact(a), Target::Exact(b)) => a == b,
            (Target::Regex(a), Target::Regex(b)) => a.as_str() == b.as_str(),
            _ => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Group {
    name: String,
    targets: Vec<Target>,
    scheme: QuantScheme,
}

/// A parsed compressed-tensors `quantization_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    groups: Vec<Group>,
    ignore: Vec<Target>,
}

pub(crate) fn str_list(f: &Fields, name: &str) -> Result<Vec<String>> {
    match f.get(name) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| f.invalid(name, format!("expected strings, found {v}")))
            })
            .collect(),
        Some(v) => Err(f.invalid(name, format!("expected an array of strings, found {v}"))),
    }
}

impl QuantConfig {
    /// Parses the `quantization_config` object; `file` names the file in errors.
    pub fn from_value(value: &Value, file: &str) -> Result<Self> {
        let f = Fields::new(value, file, "quantization_config.")?;
        Self::from_fields(&f)
    }

    pub(crate) fn from_fields(f: &Fields) -> Result<Self> {
        let method = f.req_str("quant_method")?;
        if method != "compressed-tensors" {
            return Err(f.invalid(
                "quant_method",
                format!("`{method}` is not served (compressed-tensors or fp8)"),
            ));
        }
        let format = f.req_str("format")?;
        if format != "pack-quantized" {
            return Err(f.invalid(
                "format",
                format!("`{format}` is not served (only pack-quantized)"),
            ));
        }
        let groups_v = f
            .get("config_groups")
            .ok_or_else(|| f.missing("config_groups"))?;
        let groups_map = groups_v
            .as_object()
            .ok_or_else(|| f.invalid("config_groups", "expected an object".into()))?;
        let cg = f.child("config_groups")?;
        let mut groups = Vec::with_capacity(groups_map.len());
        for name in groups_map.keys() {
            let g = cg.child(name)?;
            groups.push(Self::group(name, &g)?);
        }
        let ignore = str_list(f, "ignore")?
            .iter()
            .map(|t| Target::parse(t, f, "ignore"))
            .collect::<Result<_>>()?;
        Ok(QuantConfig { groups, ignore })
    }

    fn group(name: &str, g: &Fields) -> Result<Group> {
        let targets: Vec<Target> = str_list(g, "targets")?
            .iter()
            .map(|t| Target::parse(t, g, "targets"))
            .collect::<Result<_>>()?;
        if targets.is_empty() {
            return Err(g.missing("targets"));
        }
        if g.has("input_activations") {
            return Err(g.invalid(
                "input_activations",
                "activation quantization is not served (weights only)".into(),
            ));
        }
        let w = g.child("weights")?;
        let bits = w.req_usize("num_bits")?;
        let ty = w.opt_str("type")?.unwrap_or_else(|| "int".into());
        if ty != "int" {
            return Err(w.invalid("type", format!("`{ty}` is not served (only int)")));
        }
        if !w.opt_bool("symmetric")?.unwrap_or(true) {
            return Err(w.invalid(
                "symmetric",
                "asymmetric weights (zero points) are not served".into(),
            ));
        }
        if let Some(a) = w.opt_str("actorder")? {
            return Err(w.invalid(
                "actorder",
                format!("`{a}`: activation ordering (g_idx) is not served"),
            ));
        }
        if w.opt_bool("dynamic")?.unwrap_or(false) {
            return Err(w.invalid("dynamic", "dynamic weight scales are not served".into()));
        }
        let strategy = w.req_str("strategy")?;
        let group_size = match strategy.as_str() {
            "channel" => 0,
            "group" => {
                let gs = w.req_usize("group_size")?;
                if gs == 0 || !gs.is_multiple_of(8) {
                    return Err(w.invalid(
                        "group_size",
                        format!("{gs} must be a positive multiple of 8"),
                    ));
                }
                gs
            }
            other => {
                return Err(w.invalid(
                    "strategy",
                    format!("`{other}` is not served (only group, channel)"),
                ))
            }
        };
        let layout = g
            .opt_str("format")?
            .unwrap_or_else(|| "pack-quantized".into());
        let bits = match (bits, layout.as_str()) {
            (4, "pack-quantized") | (8, "pack-quantized") => bits as u32,
            (6, "int6-gapless") => 6,
            (6, "pack-quantized") => {
                return Err(g.invalid(
                    "format",
                    format!(
                        "group `{name}`: 6-bit weights must declare \"format\": \"int6-gapless\" \
                         (compressed-tensors' own 6-bit packing is not served)"
                    ),
                ))
            }
            (b, "int6-gapless") => {
                return Err(w.invalid(
                    "num_bits",
                    format!("{b}: the int6-gapless format holds 6-bit values only"),
                ))
            }
            (_, "pack-quantized") => {
                return Err(w.invalid(
                    "num_bits",
                    format!("{bits} bits are not served (4, 8, or 6 with int6-gapless)"),
                ))
            }
            (_, other) => {
                return Err(g.invalid(
                    "format",
                    format!("`{other}` is not served (pack-quantized, int6-gapless)"),
                ))
            }
        };
        Ok(Group {
            name: name.to_string(),
            targets,
            scheme: QuantScheme { bits, group_size },
        })
    }

    /// The scheme of the Linear called `module` (a tensor name without `.weight`); `None` = bf16.
    pub fn scheme_for(&self, module: &str) -> Option<QuantScheme> {
        self.scheme_for_module(module, true)
    }

    /// As [`QuantConfig::scheme_for`] for any module: one that is not a Linear (an embedding) is matched
    /// by exact names and regexes only, never by the class name `Linear`.
    pub fn scheme_for_module(&self, module: &str, is_linear: bool) -> Option<QuantScheme> {
        if self.ignore.iter().any(|t| t.matches(module, is_linear)) {
            return None;
        }
        let first = |pred: &dyn Fn(&Target) -> bool| {
            self.groups
                .iter()
                .find(|g| g.targets.iter().any(pred))
                .map(|g| g.scheme)
        };
        first(&|t| matches!(t, Target::Exact(n) if n == module))
            .or_else(|| first(&|t| matches!(t, Target::Regex(re) if re.is_match(module))))
            .or_else(|| first(&|t| matches!(t, Target::Linear) && is_linear))
    }

    /// The names of the config groups, in file order.
    pub fn group_names(&self) -> impl Iterator<Item = &str> {
        self.groups.iter().map(|g| g.name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<QuantConfig> {
        QuantConfig::from_value(&v, "config.json")
    }

    fn group(bits: u32, strategy: &str, gs: Option<usize>, targets: &[&str]) -> Value {
        let mut w = serde_json::json!({"num_bits": bits, "type": "int", "symmetric": true, "strategy": strategy});
        if let Some(gs) = gs {
            w["group_size"] = gs.into();
        }
        serde_json::json!({"targets": targets, "weights": w})
    }

    fn mix() -> Value {
        let mut shared = group(
            6,
            "channel",
            None,
            &["re:.*shared_expert\\.(gate|up|down)_proj$"],
        );
        shared["format"] = "int6-gapless".into();
        serde_json::json!({
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "experts": group(4, "group", Some(128), &["re:.*mlp\\.experts\\..*"]),
                "shared": shared,
                "rest": group(8, "channel", None, &["Linear", "model.embed_tokens"]),
            },
            "ignore": ["re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*in_proj_[ab]$", "mtp.fc"]
        })
    }

    #[test]
    fn matches_targets_in_precedence_order() {
        let q = parse(mix()).unwrap();
        let g128 = QuantScheme {
            bits: 4,
            group_size: 128,
        };
        let i6 = QuantScheme {
            bits: 6,
            group_size: 0,
        };
        let i8c = QuantScheme {
            bits: 8,
            group_size: 0,
        };
        assert_eq!(
            q.scheme_for("model.layers.3.mlp.experts.17.down_proj"),
            Some(g128)
        );
        assert_eq!(
            q.scheme_for("model.layers.3.mlp.experts.gate_up_proj"),
            Some(g128)
        );
        assert_eq!(
            q.scheme_for("model.layers.3.mlp.shared_expert.up_proj"),
            Some(i6)
        );
        assert_eq!(
            q.scheme_for("model.layers.3.linear_attn.in_proj_qkv"),
            Some(i8c)
        );
        assert_eq!(q.scheme_for("lm_head"), Some(i8c));
        assert_eq!(q.scheme_for("model.layers.3.linear_attn.in_proj_b"), None);
        assert_eq!(q.scheme_for("model.layers.3.mlp.gate"), None);
        assert_eq!(q.scheme_for("model.layers.3.mlp.shared_expert_gate"), None);
        assert_eq!(q.scheme_for("mtp.fc"), None);
        // The embedding is no Linear: only its exact name picks it.
        assert_eq!(q.scheme_for_module("model.embed_tokens", false), Some(i8c));
        assert_eq!(q.scheme_for_module("model.other_embedding", false), None);
        assert!(q.scheme_for(&"x".repeat(3)).is_some());
        assert_eq!(
            q.group_names().collect::<Vec<_>>(),
            vec!["experts", "shared", "rest"]
        );
    }

    #[test]
    fn exact_name_beats_regex_beats_class() {
        let v = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {
                "a": group(8, "channel", None, &["Linear"]),
                "b": group(4, "group", Some(32), &["re:.*proj"]),
                "c": group(4, "channel", None, &["layers.0.q_proj"]),
            }
        });
        let q = parse(v).unwrap();
        assert_eq!(q.scheme_for("layers.0.q_proj").unwrap().group_size, 0);
        assert_eq!(q.scheme_for("layers.0.q_proj").unwrap().bits, 4);
        assert_eq!(q.scheme_for("layers.1.q_proj").unwrap().group_size, 32);
        assert_eq!(q.scheme_for("lm_head").unwrap().bits, 8);
        // Regexes are anchored at the start, as Python's re.match.
        assert_eq!(q.scheme_for("x.layers.1.q").unwrap().bits, 8);
    }

    #[test]
    fn full_size_qwen3_next_config_carries_the_spec_mix() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../configs/models/qwen3-next-80b-a3b.json");
        let cfg = crate::ModelConfig::from_file(&path).unwrap();
        let q = cfg.quantization.expect("quantization_config");
        let scheme = |m: &str| q.scheme_for(m).map(|s| (s.bits, s.group_size));
        for l in [0, 3, 47] {
            let p = format!("model.layers.{l}.");
            assert_eq!(
                scheme(&format!("{p}mlp.experts.511.gate_proj")),
                Some((4, 128))
            );
            assert_eq!(
                scheme(&format!("{p}mlp.experts.0.down_proj")),
                Some((4, 128))
            );
            assert_eq!(
                scheme(&format!("{p}mlp.experts.gate_up_proj")),
                Some((4, 128))
            );
            assert_eq!(
                scheme(&format!("{p}mlp.shared_expert.down_proj")),
                Some((6, 0))
            );
            assert_eq!(
                scheme(&format!("{p}linear_attn.in_proj_qkvz")),
                Some((8, 0))
            );
            assert_eq!(scheme(&format!("{p}linear_attn.out_proj")), Some((8, 0)));
            assert_eq!(scheme(&format!("{p}self_attn.q_proj")), Some((8, 0)));
            assert_eq!(scheme(&format!("{p}linear_attn.in_proj_ba")), None);
            assert_eq!(scheme(&format!("{p}mlp.gate")), None);
            assert_eq!(scheme(&format!("{p}mlp.shared_expert_gate")), None);
        }
        assert_eq!(scheme("lm_head"), Some((8, 0)));
        assert_eq!(scheme("mtp.fc"), None);
        assert_eq!(scheme("mtp.layers.0.mlp.experts.7.up_proj"), Some((4, 128)));
        assert_eq!(
            q.scheme_for_module("model.embed_tokens", false)
                .map(|s| s.bits),
            Some(8)
        );
    }

    fn err(v: Value) -> String {
        parse(v).unwrap_err().to_string()
    }

    #[test]
    fn refuses_what_it_cannot_serve_by_name() {
        let mut v = mix();
        v["quant_method"] = "gptq".into();
        assert!(err(v).contains("quantization_config.quant_method"));
        let mut v = mix();
        v["format"] = "marlin-24".into();
        assert!(err(v).contains("quantization_config.format"));
        let mut v = mix();
        v["config_groups"]["experts"]["weights"]["num_bits"] = 3.into();
        let e = err(v);
        assert!(e.contains("config_groups.experts.weights.num_bits"), "{e}");
        let mut v = mix();
        v["config_groups"]["shared"]
            .as_object_mut()
            .unwrap()
            .remove("format");
        let e = err(v);
        assert!(
            e.contains("config_groups.shared.format") && e.contains("int6-gapless"),
            "{e}"
        );
        let mut v = mix();
        v["config_groups"]["experts"]["format"] = "int6-gapless".into();
        assert!(err(v).contains("experts.weights.num_bits"));
        let mut v = mix();
        v["config_groups"]["experts"]["weights"]["symmetric"] = false.into();
        assert!(err(v).contains("weights.symmetric"));
        let mut v = mix();
        v["config_groups"]["experts"]["weights"]["type"] = "float".into();
        assert!(err(v).contains("weights.type"));
        let mut v = mix();
        v["config_groups"]["experts"]["weights"]["strategy"] = "tensor".into();
        assert!(err(v).contains("weights.strategy"));
        let mut v = mix();
        v["config_groups"]["experts"]["weights"]["group_size"] = 100.into();
        assert!(err(v).contains("weights.group_size"));
        let mut v = mix();
        v["config_groups"]["rest"]["input_activations"] =
            serde_json::json!({"num_bits": 8, "type": "int"});
        assert!(err(v).contains("rest.input_activations"));
        let mut v = mix();
        v["ignore"] = serde_json::json!(["re:(unclosed"]);
        assert!(err(v).contains("quantization_config.ignore"));
        let mut v = mix();
        v.as_object_mut().unwrap().remove("config_groups");
        assert!(err(v).contains("quantization_config.config_groups"));
    }
}
