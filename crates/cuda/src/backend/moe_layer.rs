//! A MoE layer's one-token decode step in one launch ([`Gpu::moe_layer_decode`]): with the fused
//! decode launches and the one-launch MoE layer on, a layer whose router and shared gate are bf16
//! and whose experts are INT4 (and shared expert packed) takes its routing, shared expert, routed
//! experts and combine (with the residual add and the next norm) in one persistent launch instead
//! of six.

use std::sync::atomic::Ordering;

use sanmai_model::backend::{MoeCall, MoeWeights};

use super::moe_tables::expert_format;
use super::norm_after::NormAfter;
use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::ops::{MoeLayer, MoeLayerBufs, MoeLayerShared};

impl CudaBackend {
    /// Whether a step of `rows` rows on `w` takes [`CudaBackend::moe_layer_step`]: both switches on,
    /// one row, a bf16 router `[e, h]`, packed experts of one scheme, a packed shared expert with a
    /// bf16 gate row (or none of either) and the kernel's shapes ([`crate::Gpu::moe_layer_fits`]).
    pub fn moe_layer_takes(&self, w: &MoeWeights<CudaWeight>, rows: usize) -> bool {
        if rows != 1
            || !self.switches.fused_decode.load(Ordering::Relaxed)
            || !self.switches.moe_layer.load(Ordering::Relaxed)
        {
            return false;
        }
        let (CudaWeight::Bf16(router), Some(first)) = (&w.router, w.experts.first()) else {
            return false;
        };
        let (e, inter) = (w.experts.len(), first.inter);
        let h = router.shape.last().copied().unwrap_or(0);
        if router.shape != [e, h] {
            return false;
        }
        let formats = (
            expert_format("gate|up", w.experts.iter().map(|x| &x.gate_up)),
            expert_format("down", w.experts.iter().map(|x| &x.down)),
        );
        let scheme = match formats {
            (Ok(gu), Ok(dn)) if gu == dn => gu.scheme(),
            _ => None,
        };
        let shaped = w.experts.iter().all(|x| {
            x.inter == inter && x.gate_up.shape() == [2 * inter, h] && x.down.shape() == [h, inter]
        });
        let shared = match (&w.shared, &w.shared_gate) {
            (None, None) => Some(None),
            (Some(s), Some(CudaWeight::Bf16(g))) => match (&s.gate_up, &s.down) {
                (CudaWeight::Packed(gu), CudaWeight::Packed(dn))
                    if g.shape == [1, h]
                        && gu.scheme() == dn.scheme()
                        && gu.shape == [2 * s.inter, h]
                        && dn.shape == [h, s.inter] =>
                {
                    Some(Some((gu.scheme(), s.inter)))
                }
                _ => None,
            },
            _ => None,
        };
        let Some(shared) = shared else {
            return false;
        };
        shaped
            && self
                .gpu
                .moe_layer_fits((h, e, w.top_k, inter), scheme, shared)
    }

    /// The one-launch decode step of one row ([`CudaBackend::moe_layer_takes`]): the combined row
    /// into a new tensor, or (`after`) its add to the residual and the norm of that.
    pub(super) fn moe_layer_step(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        after: Option<NormAfter<'_>>,
    ) -> Result<CudaTensor> {
        let (x, w) = (c.x, c.w);
        let (h, e, k) = (x.cols, w.experts.len(), w.top_k);
        let inter = w.experts[0].inter;
        let bad = |msg: &str| CudaError::Shape {
            op: "moe",
            msg: msg.into(),
        };
        let CudaWeight::Bf16(router) = &w.router else {
            return Err(bad("the one-launch MoE step needs a bf16 router"));
        };
        let shared = match (&w.shared, &w.shared_gate) {
            (Some(s), Some(CudaWeight::Bf16(g))) => match (&s.gate_up, &s.down) {
                (CudaWeight::Packed(gu), CudaWeight::Packed(dn)) => Some(MoeLayerShared {
                    gate: &g.data,
                    gate_up: gu.mat(),
                    down: dn.mat(),
                }),
                _ => return Err(bad("the one-launch MoE step needs a packed shared expert")),
            },
            _ => None,
        };
        let si = w.shared.as_ref().map_or(0, |s| s.inter);
        let format = expert_format("gate|up", w.experts.iter().map(|x| &x.gate_up))?;
        let mut st = self.lock();
        let table = self.expert_table(&mut st.experts, w)?;
        let (gate_up, down) = table.routed.experts(format, format, h, inter);
        let layer = MoeLayer {
            router: &router.data,
            gate_up,
            down,
            experts: e,
            top_k: k,
            renormalize: w.renormalize,
            shared,
        };
        let mut logits = self.scratch::<f32>(e + 1)?;
        let mut sgu = self.scratch(2 * si)?;
        let mut act = self.scratch(k * inter)?;
        let mut sdn = self.scratch::<f32>(if si > 0 { h } else { 0 })?;
        let mut partials = self.scratch::<f32>(self.gpu.moe_layer_max_blocks())?;
        let mut ids = self.scratch::<u32>(k)?;
        let mut wts = self.scratch::<f32>(k)?;
        let mut sync = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
        let bufs = MoeLayerBufs {
            logits: &mut logits,
            shared_gate_up: &mut sgu,
            shared_down: &mut sdn,
            act: &mut act,
            ids: &mut ids,
            weights: &mut wts,
            partials: &mut partials,
            sync: &mut sync,
            trace: None,
        };
        let mut out = self.alloc(1, h)?;
        let into = NormAfter::combine_into(after, &mut out);
        self.gpu.moe_layer_decode(&layer, &x.buf, h, bufs, into)?;
        drop(sync);
        drop(st);
        self.log_routing(&ids, k, e)?;
        Ok(out)
    }
}
