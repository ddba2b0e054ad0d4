//! The qwen4_exp extension blocks (spec §2–§4): `qsa`, `ple` and `hyper_connections`. Each is
//! optional and independent; the parsers check every field against the base model's shapes.

use serde_json::Value;

use crate::fields::Fields;
use crate::ple::PleConfig;
use crate::{LayerType, Result};

/// QSA: sparse full attention with a lightning indexer (config block `qsa`, spec §2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QsaConfig {
    /// Indexer query heads `nI`.
    pub index_n_heads: usize,
    /// Indexer head width `dI` (query heads and the single key).
    pub index_head_dim: usize,
    /// Leading dims of each indexer head that get NeoX RoPE.
    pub index_rope_dim: usize,
    /// Positions each query attends to at most.
    pub index_topk: usize,
}

impl QsaConfig {
    /// Bytes of one index-key cache entry: `dI` fp8 values and a bf16 scale.
    pub fn index_entry_bytes(&self) -> usize {
        self.index_head_dim + 2
    }
}

/// Hyper-connections with gated residuals (config block `hyper_connections`, spec §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HyperConnectionsConfig {
    /// Residual streams `S`.
    pub num_streams: usize,
    /// Width of the gate's bottleneck.
    pub rank: usize,
}

pub(crate) fn parse_qsa(text: &Fields<'_>) -> Result<Option<QsaConfig>> {
    if !text.has("qsa") {
        return Ok(None);
    }
    let b = text.child("qsa")?;
    let cfg = QsaConfig {
        index_n_heads: b.req_usize("index_n_heads")?,
        index_head_dim: b.req_usize("index_head_dim")?,
        index_rope_dim: b.req_usize("index_rope_dim")?,
        index_topk: b.req_usize("index_topk")?,
    };
    if cfg.index_n_heads == 0 {
        return Err(b.invalid("index_n_heads", "must be positive".into()));
    }
    if cfg.index_head_dim == 0 {
        return Err(b.invalid("index_head_dim", "must be positive".into()));
    }
    if !cfg.index_rope_dim.is_multiple_of(2) || cfg.index_rope_dim > cfg.index_head_dim {
        return Err(b.invalid(
            "index_rope_dim",
            format!(
                "{} must be even and at most index_head_dim = {}",
                cfg.index_rope_dim, cfg.index_head_dim
            ),
        ));
    }
    if cfg.index_topk == 0 {
        return Err(b.invalid("index_topk", "must be positive".into()));
    }
    Ok(Some(cfg))
}

pub(crate) fn parse_hc(text: &Fields<'_>) -> Result<Option<HyperConnectionsConfig>> {
    if !text.has("hyper_connections") {
        return Ok(None);
    }
    let b = text.child("hyper_connections")?;
    let cfg = HyperConnectionsConfig {
        num_streams: b.req_usize("num_streams")?,
        rank: b.req_usize("rank")?,
    };
    if cfg.num_streams == 0 {
        return Err(b.invalid("num_streams", "must be positive".into()));
    }
    if cfg.rank == 0 {
        return Err(b.invalid("rank", "must be positive".into()));
    }
    Ok(Some(cfg))
}

pub(crate) fn parse_ple(text: &Fields<'_>, layer_types: &[LayerType]) -> Result<Option<PleConfig>> {
    let Some(block) = text.get("ple").filter(|v| !Value::is_null(v)) else {
        return Ok(None);
    };
    let cfg = PleConfig::from_block(block).map_err(|e| text.invalid("ple", e.to_string()))?;
    let mut seen = Vec::new();
    for &l in &cfg.layer_ids {
        if l >= layer_types.len() {
            return Err(text.invalid(
                "ple.layer_ids",
                format!(
                    "layer {l} does not exist (num_hidden_layers = {})",
                    layer_types.len()
                ),
            ));
        }
        if seen.contains(&l) {
            return Err(text.invalid("ple.layer_ids", format!("layer {l} is listed twice")));
        }
        seen.push(l);
    }
    Ok(Some(cfg))
}
