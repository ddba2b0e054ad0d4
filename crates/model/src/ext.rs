//! Shapes and weights of the qwen4_exp extension ops of the [`Backend`](crate::Backend) trait: QSA's
//! lightning indexer, the PLE mix and the hyper-connections' gated residuals.

use crate::backend::Rope;

/// Static shapes of a QSA layer call.
#[derive(Debug, Clone)]
pub struct QsaShape {
    /// Indexer query heads `nI`.
    pub n_heads: usize,
    /// Indexer head width `dI`.
    pub head_dim: usize,
    /// Positions attended at most per query.
    pub topk: usize,
    /// The indexer's RoPE: `rot_dim` = `index_rope_dim`, frequencies `θ^(−2j/index_rope_dim)`, no
    /// scaling (`mscale` 1).
    pub rope: Rope,
}

/// The indexer's weights of one QSA layer (`self_attn.indexer.`), in backend form.
pub struct IndexerWeights<W> {
    /// `[nI·dI, hidden]`.
    pub wq: W,
    /// `[dI, hidden]`.
    pub wk: W,
    /// LayerNorm weight `[dI]`.
    pub k_norm: W,
    /// LayerNorm bias `[dI]`.
    pub k_norm_bias: W,
    /// `[nI, hidden]`.
    pub weights_proj: W,
}

/// Static shapes of a PLE mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PleShape {
    /// Residual streams S (1 without hyper-connections).
    pub streams: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Width E of a token's gathered rows (`len(orders)·heads·row_dim`).
    pub row_width: usize,
    pub conv_kernel: usize,
    pub conv_dilation: usize,
}

impl PleShape {
    /// Past positions of the conv's normed input kept per sequence.
    pub fn state_rows(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dilation
    }
    /// Conv channels `S·H`.
    pub fn channels(&self) -> usize {
        self.streams * self.hidden
    }
}

/// The PLE weights of one layer (`model.layers.{i}.ple.`), in backend form; the per-stream lists have
/// S entries.
pub struct PleWeights<W> {
    /// `[H, E]`.
    pub value: W,
    /// `[H]`.
    pub value_bias: W,
    /// `[H, E]` each.
    pub key: Vec<W>,
    /// `[H]` each.
    pub key_bias: Vec<W>,
    pub key_norm: Vec<W>,
    pub query_norm: Vec<W>,
    pub conv_norm: Vec<W>,
    /// `[S·H, kernel]` (`conv.weight [S·H, 1, kernel]` squeezed).
    pub conv: W,
}

/// One sublayer's hyper-connection weights (`hc_attn.` / `hc_ffn.`), in backend form.
pub struct HcWeights<W> {
    /// `[S]` pre-mix logits.
    pub pre: W,
    /// `[rank, H]`.
    pub down: W,
    /// `[rank, H]`.
    pub inject: W,
    /// `[S·H, rank]`.
    pub up: W,
}
