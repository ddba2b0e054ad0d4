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
