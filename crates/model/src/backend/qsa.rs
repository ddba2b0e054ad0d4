//! QSA (spec §2): the lightning indexer's shapes and weights, and the arguments of
//! [`Backend::qsa_attention`](super::Backend::qsa_attention).

use super::{AttnCall, AttnMixerCall, Rope};

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

/// One QSA layer call: the gated attention's inputs ([`AttnCall`]) plus the indexer's projections of
/// the normed layer input `x`: `iq = wq·x` `[rows, nI·dI]`, `ik = wk·x` `[rows, dI]` (before its
/// LayerNorm) and `iw = weights_proj·x` `[rows, nI]`.
pub struct QsaCall<'a, T, W> {
    pub attn: AttnCall<'a, T, W>,
    pub qsa: &'a QsaShape,
    pub iq: &'a T,
    pub ik: &'a T,
    pub iw: &'a T,
    pub indexer: &'a IndexerWeights<W>,
}

/// A QSA mixer from the layer's normed input ([`Backend::qsa_mixer_within_topk`]): the gated
/// attention mixer's call ([`AttnMixerCall`]), the QSA shape and the indexer's weights.
pub struct QsaMixerCall<'a, T, W> {
    pub mixer: AttnMixerCall<'a, T, W>,
    pub qsa: &'a QsaShape,
    pub indexer: &'a IndexerWeights<W>,
}
