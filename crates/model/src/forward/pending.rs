//! A sublayer's output not yet added to the residual ([`Pending`]): a sublayer hands it to the next
//! norm, which adds it first. A mixer hands over its output projection before it runs, a MoE FFN
//! its experts, so that the add can ask the backend for the last op, the add and the norm in one
//! call ([`Backend::linear_add_rms_norm`], [`Backend::moe_experts_add_rms_norm`]). With
//! hyper-connections a sublayer hands over its gated residual, which the next sublayer's pre-mix and
//! norm take in one call ([`Backend::hc_residual_premix_norm`]).

use crate::backend::{
    Backend, BackendError, HcWeights, MoeCall, MoeWeights, OpResult, SharedExpert, SharedFusion,
};
use crate::load::{Ffn, Layer, Model};

/// A sublayer's output not yet added to the residual.
pub(super) enum Pending<'l, T, W> {
    /// Its rows.
    Rows(T),
    /// The projection `x · wᵀ` (a mixer's output projection).
    Linear { x: T, w: &'l W },
    /// A MoE FFN on the normed input `x`, with the shared expert's output and gate logits the model
    /// computed (`None` where the backend computes them: [`Backend::moe_fuses_shared`]).
    Moe {
        w: &'l MoeWeights<W>,
        x: T,
        shared: Option<(Option<T>, Option<T>)>,
    },
    /// The hyper-connections' gated residual ([`Backend::hc_residual`]) of output `y` for the
    /// sublayer's pre-mixed input `x`: added to the streams, not to one residual row.
    Hc { x: T, y: T, w: &'l HcWeights<W> },
}

/// The error of a gated residual asked for as rows or as a plain residual's add and norm.
fn not_plain(op: &'static str) -> BackendError {
    BackendError::invalid(
        op,
        "a gated residual (hyper-connections) is not a plain residual's add",
    )
}

/// The MoE call of a pending MoE output.
fn call<'a, T, W>(
    w: &'a MoeWeights<W>,
    x: &'a T,
    shared: &'a Option<(Option<T>, Option<T>)>,
) -> MoeCall<'a, T, W> {
    MoeCall {
        x,
        w,
        shared: shared.as_ref().map(|(y, g)| SharedExpert {
            y: y.as_ref(),
            gate: g.as_ref(),
        }),
    }
}

impl<T, W> Pending<'_, T, W> {
    /// The output's rows.
    pub(super) fn rows<B: Backend<Tensor = T, Weight = W>>(self, b: &B) -> OpResult<T> {
        match self {
            Pending::Rows(y) => Ok(y),
            Pending::Linear { x, w } => b.linear(&x, w),
            Pending::Moe { w, x, shared } => b.moe_experts(&call(w, &x, &shared)),
            Pending::Hc { .. } => Err(not_plain("rows")),
        }
    }

    /// `acc += output` (the gated residual into the streams `acc`).
    pub(super) fn add_to<B: Backend<Tensor = T, Weight = W>>(
        self,
        b: &B,
        acc: &mut T,
    ) -> OpResult<()> {
        match self {
            Pending::Hc { x, y, w } => b.hc_residual(acc, &x, &y, w),
            plain => b.add(acc, &plain.rows(b)?),
        }
    }

    /// `acc += output`, then [`Backend::rms_norm`] of the new `acc` (weight `norm`).
    pub(super) fn add_rms_norm<B: Backend<Tensor = T, Weight = W>>(
        self,
        b: &B,
        acc: &mut T,
        norm: &W,
        eps: f32,
        offset: f32,
    ) -> OpResult<T> {
        match self {
            Pending::Rows(y) => b.add_rms_norm(acc, &y, norm, eps, offset),
            Pending::Linear { x, w } => b.linear_add_rms_norm(&x, w, acc, norm, eps, offset),
            Pending::Moe { w, x, shared } => {
                b.moe_experts_add_rms_norm(&call(w, &x, &shared), acc, norm, eps, offset)
            }
            Pending::Hc { .. } => Err(not_plain("add_rms_norm")),
        }
    }
}

impl<B: Backend> Model<B> {
    /// The FFN sublayer's output for normed input `hn`: the dense MLP, or the routed experts plus the
    /// sigmoid-gated shared expert (left pending: see [`Pending`]).
    pub(super) fn ffn<'l>(
        &self,
        layer: &'l Layer<B::Weight>,
        hn: B::Tensor,
        rows: usize,
    ) -> OpResult<Pending<'l, B::Tensor, B::Weight>> {
        let b = &self.backend;
        match &layer.ffn {
            Ffn::Dense(m) => Ok(Pending::Rows(self.mlp(m, &hn)?)),
            Ffn::Moe(m) => {
                let shared = match (&m.shared, &m.shared_gate) {
                    (Some(shared), Some(gate)) => {
                        let fusion = b.moe_fuses_shared(m, rows);
                        let y = match fusion {
                            SharedFusion::Apart | SharedFusion::Gate => {
                                Some(self.mlp(shared, &hn)?)
                            }
                            SharedFusion::Expert | SharedFusion::ExpertAndGate => None,
                        };
                        let g = match fusion {
                            SharedFusion::ExpertAndGate | SharedFusion::Gate => None,
                            SharedFusion::Apart | SharedFusion::Expert => {
                                Some(b.linear(&hn, gate)?)
                            }
                        };
                        Some((y, g))
                    }
                    _ => None,
                };
                Ok(Pending::Moe {
                    w: m,
                    x: hn,
                    shared,
                })
            }
        }
    }
}
