//! A mixer sublayer as one call from the layer's normed input ([`GdnMixerCall`], [`AttnMixerCall`]),
//! and the ops a backend runs for it by default ([`Backend::gdn_from_input`],
//! [`Backend::attn_from_input`]): the input projections, then the mixer's core, leaving the output
//! projection to the caller. A backend that runs a whole mixer its own way (one launch on a GPU)
//! says so through [`Backend::gdn_mixer_whole`] / [`Backend::attn_mixer_whole`].

use super::{
    AttnCall, AttnShape, AttnWeights, Backend, BackendError, GdnCall, GdnGates, GdnShape,
    GdnWeights, Mrope, OpResult, Rope, SeqChunk,
};

/// A GDN mixer from the layer's normed input `x` `[rows, H]` ([`Backend::gdn_from_input`],
/// [`Backend::gdn_mixer`]): GDN layer `layer` of shape `shape` and weights `w`, the gated RMSNorm's
/// `eps`, the step's chunks.
pub struct GdnMixerCall<'a, T, W> {
    pub layer: usize,
    pub shape: &'a GdnShape,
    pub x: &'a T,
    pub w: &'a GdnWeights<W>,
    pub eps: f32,
    pub seqs: &'a [SeqChunk<'a>],
}

/// An attention mixer from the layer's normed input `x` `[rows, H]` ([`Backend::attn_from_input`],
/// [`Backend::attn_mixer_add_rms_norm`]): attention layer `layer` of shape `shape`, RoPE `rope` and
/// weights `w`, the step's chunks and their explicit MRoPE positions if any ([`AttnCall::mrope`]).
pub struct AttnMixerCall<'a, T, W> {
    pub layer: usize,
    pub shape: &'a AttnShape,
    pub rope: &'a Rope,
    pub x: &'a T,
    pub w: &'a AttnWeights<W>,
    pub seqs: &'a [SeqChunk<'a>],
    pub mrope: Option<Mrope<'a>>,
}

/// The results of [`Backend::linear_many`] of `n` weights as a slice of `n`.
fn projections<T>(ys: &[T], n: usize) -> OpResult<&[T]> {
    if ys.len() == n {
        Ok(ys)
    } else {
        Err(BackendError::invalid(
            "linear_many",
            format!("{} results for {n} weights", ys.len()),
        ))
    }
}

/// [`Backend::gdn_from_input`]'s default: `in_proj_qkv`, `in_proj_z` (and the gates `in_proj_b`,
/// `in_proj_a` unless [`Backend::gdn_projects_gates`]) in one [`Backend::linear_many`], then
/// [`Backend::gdn`].
pub(super) fn gdn_from_input<B: Backend + ?Sized>(
    b: &B,
    c: &GdnMixerCall<'_, B::Tensor, B::Weight>,
) -> OpResult<B::Tensor> {
    let w = c.w;
    let rows = c.seqs.iter().map(|s| s.len).sum();
    let inside = b.gdn_projects_gates(w, c.shape, rows);
    let mut ws = vec![&w.in_proj_qkv, &w.in_proj_z];
    if !inside {
        ws.extend([&w.in_proj_b, &w.in_proj_a]);
    }
    let ys = b.linear_many(c.x, &ws)?;
    let (qkv, z, rest) = match projections(&ys, ws.len())? {
        [qkv, z, rest @ ..] => (qkv, z, rest),
        _ => unreachable!("at least two weights"),
    };
    let gates = match rest {
        [gb, ga] => GdnGates::Given { b: gb, a: ga },
        _ => GdnGates::FromInput(c.x),
    };
    b.gdn(&GdnCall {
        layer: c.layer,
        shape: c.shape,
        qkv,
        z,
        gates,
        w,
        eps: c.eps,
        seqs: c.seqs,
    })
}

/// [`Backend::attn_from_input`]'s default: `q_proj`, `k_proj`, `v_proj` in one
/// [`Backend::linear_many`], then [`Backend::attention`].
pub(super) fn attn_from_input<B: Backend + ?Sized>(
    b: &B,
    c: &AttnMixerCall<'_, B::Tensor, B::Weight>,
) -> OpResult<B::Tensor> {
    let w = c.w;
    let ys = b.linear_many(c.x, &[&w.q_proj, &w.k_proj, &w.v_proj])?;
    let [q_gate, k, v] = projections(&ys, 3)? else {
        unreachable!("three results checked")
    };
    b.attention(&AttnCall {
        layer: c.layer,
        shape: c.shape,
        rope: c.rope,
        q_gate,
        k,
        v,
        w,
        seqs: c.seqs,
        mrope: c.mrope,
    })
}
