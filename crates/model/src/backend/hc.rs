//! Hyper-connections (spec §4): one sublayer's weights and the gated residual written as plain ops
//! (the oracle a fusing backend is tested against).

use super::{Backend, OpResult};

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

/// The sublayer after a gated residual, for [`Backend::hc_residual_premix_norm`]: its pre-mix logits
/// `pre` `[S]` and its norm (weight `norm`, `eps`, `offset` as [`Backend::rms_norm`] takes them).
pub struct HcNext<'a, W> {
    pub pre: &'a W,
    pub norm: &'a W,
    pub eps: f32,
    pub offset: f32,
}

/// [`Backend::hc_residual`] as six ops, each rounding its output to the backend's activation type:
/// `linear` down (of `y`) and inject (of `x`), `add`, `silu`, `linear` up, `hc_gated_residual`. The
/// trait's default, and what a fusing backend falls back to for shapes its kernels do not take.
pub fn hc_residual_ops<B: Backend + ?Sized>(
    b: &B,
    streams: &mut B::Tensor,
    x: &B::Tensor,
    y: &B::Tensor,
    w: &HcWeights<B::Weight>,
) -> OpResult<()> {
    let mut pre = b.linear(y, &w.down)?;
    b.add(&mut pre, &b.linear(x, &w.inject)?)?;
    let u = b.linear(&b.silu(&pre)?, &w.up)?;
    b.hc_gated_residual(streams, &u, y)
}

/// [`Backend::hc_residual_premix_norm`] as its three calls: [`Backend::hc_residual`], the next
/// sublayer's [`Backend::hc_premix`] and [`Backend::rms_norm`]. The trait's default, and what a
/// fusing backend falls back to.
pub fn hc_residual_premix_norm_ops<B: Backend + ?Sized>(
    b: &B,
    streams: &mut B::Tensor,
    (x, y): (&B::Tensor, &B::Tensor),
    w: &HcWeights<B::Weight>,
    next: HcNext<'_, B::Weight>,
) -> OpResult<(B::Tensor, B::Tensor)> {
    b.hc_residual(streams, x, y, w)?;
    let x = b.hc_premix(streams, next.pre)?;
    let hn = b.rms_norm(&x, next.norm, next.eps, next.offset)?;
    Ok((x, hn))
}
