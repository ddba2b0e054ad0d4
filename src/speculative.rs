//! `--speculative-config`: vLLM's JSON for speculative decoding with the checkpoint's MTP head,
//! read and checked (each refusal names the key at fault).

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use sanmai_config::ModelConfig;

/// `--speculative-config`, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculative {
    pub num_speculative_tokens: usize,
    /// `model`: a directory whose `mtp.*` tensors replace the checkpoint's (e.g. the INT4 head
    /// `sanmai quantize --mtp-int4` writes); every other tensor still comes from the checkpoint.
    pub model: Option<PathBuf>,
}

/// The most drafts a step may verify (a step's drafts and the head's chained rows stay within one
/// K/V block past the context).
pub const MAX_SPECULATIVE_TOKENS: usize = 8;

impl Speculative {
    /// `--speculative-config`'s JSON when given, read and checked against the model (it needs an
    /// MTP head).
    pub fn for_model(json: Option<&str>, cfg: &ModelConfig) -> Result<Option<Self>> {
        let Some(json) = json else {
            return Ok(None);
        };
        let s = Speculative::parse(json)?;
        if cfg.mtp_layers == 0 {
            return Err(anyhow!(
                "--speculative-config: the model has no MTP head (its config gives no MTP layers: \
                 mtp_num_hidden_layers or num_nextn_predict_layers)"
            ));
        }
        Ok(Some(s))
    }

    /// Reads `--speculative-config`'s JSON; each refusal names the key at fault.
    pub fn parse(json: &str) -> Result<Self> {
        let flag = "--speculative-config";
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| anyhow!("{flag}: not JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow!("{flag}: expected a JSON object"))?;
        for key in obj.keys() {
            if !["method", "num_speculative_tokens", "model"].contains(&key.as_str()) {
                return Err(anyhow!(
                    "{flag}: unknown key `{key}` (known: method, num_speculative_tokens, model)"
                ));
            }
        }
        match obj.get("method").map(|m| m.as_str()) {
            Some(Some("mtp")) => {}
            Some(Some(m)) => {
                return Err(anyhow!(
                    "{flag}: `method` {m:?} is not supported (the one method is \"mtp\")"
                ))
            }
            Some(None) => return Err(anyhow!("{flag}: `method` must be a string")),
            None => return Err(anyhow!("{flag}: `method` is missing (use \"mtp\")")),
        }
        let k = match obj.get("num_speculative_tokens") {
            None => 1,
            Some(n) => n
                .as_u64()
                .filter(|&n| (1..=MAX_SPECULATIVE_TOKENS as u64).contains(&n))
                .ok_or_else(|| {
                    anyhow!(
                        "{flag}: `num_speculative_tokens` must be an integer in \
                         1..={MAX_SPECULATIVE_TOKENS}, not {n}"
                    )
                })? as usize,
        };
        let model = match obj.get("model") {
            None => None,
            Some(m) => {
                let dir = m.as_str().filter(|s| !s.is_empty()).ok_or_else(|| {
                    anyhow!("{flag}: `model` must be the path of a directory, not {m}")
                })?;
                let dir = std::path::PathBuf::from(dir);
                if !dir.is_dir() {
                    let what = match dir.exists() {
                        true => "not a directory",
                        false => "no such directory",
                    };
                    return Err(anyhow!("{flag}: `model` {}: {what}", dir.display()));
                }
                Some(dir)
            }
        };
        Ok(Speculative {
            num_speculative_tokens: k,
            model,
        })
    }
}
