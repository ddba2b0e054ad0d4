//! A GDN mixer's one-token decode step in one launch ([`Gpu::gdn_layer_decode`]): with the fused
//! decode launches and the one-launch GDN mixer on, a layer whose q|k|v, z and out projections are
//! packed in one width and whose gate projections are bf16 takes its input projections, GDN step and
//! output projection (with the residual add and the next norm) in one persistent launch instead of
//! three.

use std::sync::atomic::Ordering;

use sanmai_model::backend::{Backend, GdnMixerCall, GdnShape, GdnWeights, OpResult};

use super::norm_after::NormAfter;
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend};
use crate::error::{At, CudaError, Result};
use crate::ops::{DecodeSlots, GdnDecodeWeights, GdnDims, GdnLayer, GdnLayerBufs, GdnPools};
use crate::Gpu;

fn dims_of(sh: &GdnShape) -> GdnDims {
    GdnDims {
        hk: sh.num_k_heads,
        hv: sh.num_v_heads,
        dk: sh.k_head_dim,
        dv: sh.v_head_dim,
    }
}

/// The layer's weights as the one launch takes them, or `None` where their formats or shapes do not
/// suit it (packed q|k|v `[conv_dim, h]`, z `[hv·dv, h]`, out `[h, hv·dv]`; bf16 gates `[hv, h]`).
fn layer_of<'a>(gpu: &Gpu, w: &'a GdnWeights<CudaWeight>, sh: &GdnShape) -> Option<GdnLayer<'a>> {
    let dims = dims_of(sh);
    let (CudaWeight::Packed(qkv), CudaWeight::Packed(z), CudaWeight::Packed(out)) =
        (&w.in_proj_qkv, &w.in_proj_z, &w.out_proj)
    else {
        return None;
    };
    let (CudaWeight::Bf16(wb), CudaWeight::Bf16(wa)) = (&w.in_proj_b, &w.in_proj_a) else {
        return None;
    };
    let (h, ko) = (qkv.in_features(), dims.hv * dims.dv);
    let shaped = qkv.shape == [dims.conv_dim(), h]
        && z.shape == [ko, h]
        && out.shape == [h, ko]
        && wb.shape == [dims.hv, h]
        && wa.shape == [dims.hv, h];
    let schemes = [qkv.scheme(), z.scheme(), out.scheme()];
    if !(shaped && gpu.gdn_layer_fits(h, dims, sh.conv_kernel, schemes)) {
        return None;
    }
    Some(GdnLayer {
        dims,
        qkv: qkv.mat(),
        z: z.mat(),
        w_b: &wb.data,
        w_a: &wa.data,
        step: GdnDecodeWeights {
            conv: w.conv.bf16().ok()?,
            kernel: sh.conv_kernel,
            a_log: w.a_log.f32()?,
            dt_bias: w.dt_bias.f32()?,
            norm: w.norm.bf16().ok()?,
            eps: 0.0,
        },
        out: out.mat(),
    })
}

impl CudaBackend {
    /// Whether a mixer call of `rows` rows on `w` takes [`CudaBackend::gdn_layer_step`]: both
    /// switches on, one row, and weights the launch takes ([`crate::Gpu::gdn_layer_fits`]).
    pub fn gdn_layer_takes(&self, w: &GdnWeights<CudaWeight>, sh: &GdnShape, rows: usize) -> bool {
        rows == 1
            && self.switches.fused_decode.load(Ordering::Relaxed)
            && self.switches.gdn_layer.load(Ordering::Relaxed)
            && layer_of(&self.gpu, w, sh).is_some()
    }

    /// The one-launch mixer of one decoding row ([`CudaBackend::gdn_layer_takes`]): its output row
    /// into a new tensor, or (`after`) its add to the residual and the norm of that.
    pub(super) fn gdn_layer_step(
        &self,
        c: &GdnMixerCall<'_, CudaTensor, CudaWeight>,
        after: Option<NormAfter<'_>>,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let bad = |msg: String| CudaError::Shape {
            op: "gdn_mixer",
            msg,
        };
        let (x, seqs) = (c.x, c.seqs);
        if !(all_decode(seqs) && seqs.len() == 1 && x.rows == 1) {
            return Err(bad("the one-launch GDN mixer takes one decoding row".into()));
        }
        let mut layer = layer_of(g, c.w, c.shape)
            .ok_or_else(|| bad("weights the one-launch GDN mixer does not take".into()))?;
        layer.step.eps = c.eps;
        let h = layer.qkv.k;
        if x.cols != h {
            return Err(bad(format!("input of {} columns for h = {h}", x.cols)));
        }
        let dims = layer.dims;
        let mut st = self.lock();
        let st = &mut *st;
        let bs = st.kv.block_size;
        let m = st.meta.seqs(g, seqs, 1, bs)?;
        st.states.check(seqs[0].state)?;
        let pool = st.states.layers.get_mut(&c.layer).ok_or_else(|| {
            bad(format!(
                "no GDN state for layer {}: init_cache first",
                c.layer
            ))
        })?;
        let slots = st.meta.view(m.slots, 1);
        let positions = st.meta.view(m.positions, 1);
        let ko = dims.hv * dims.dv;
        let mut qkv = self.scratch(dims.conv_dim())?;
        let mut z = self.scratch(ko)?;
        let mut ab = self.scratch::<f32>(2 * dims.hv)?;
        let mut o = self.scratch::<f32>(ko)?;
        let mut partials = self.scratch::<f32>(g.moe_layer_max_blocks())?;
        let mut sync = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
        let bufs = GdnLayerBufs {
            qkv: &mut qkv,
            z: &mut z,
            ab: &mut ab,
            o: &mut o,
            partials: &mut partials,
            sync: &mut sync,
            trace: None,
        };
        let pools = GdnPools {
            conv: &mut pool.conv,
            ssm: &mut pool.ssm,
        };
        let seq = DecodeSlots {
            slots: &slots,
            positions: &positions,
            batch: 1,
        };
        let mut out = self.alloc(1, h)?;
        let into = NormAfter::combine_into(after, &mut out);
        g.gdn_layer_decode(&layer, &x.buf, pools, &seq, bufs, into)?;
        Ok(out)
    }

    /// [`Backend::gdn_mixer`](sanmai_model::Backend::gdn_mixer): the one launch where it takes the
    /// call, else the mixer's ops and `out_proj`.
    pub(super) fn gdn_mixer_impl(
        &self,
        c: &GdnMixerCall<'_, CudaTensor, CudaWeight>,
    ) -> OpResult<CudaTensor> {
        if !self.gdn_layer_takes(c.w, c.shape, c.x.rows) {
            return self.linear(&self.gdn_from_input(c)?, &c.w.out_proj);
        }
        self.gdn_layer_step(c, None).at("gdn_mixer")
    }

    /// [`Backend::gdn_mixer_add_rms_norm`](sanmai_model::Backend::gdn_mixer_add_rms_norm): the one
    /// launch where it takes the call, else the mixer's ops and `out_proj` with the add and norm.
    pub(super) fn gdn_mixer_add_rms_norm_impl(
        &self,
        c: &GdnMixerCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        if !self.gdn_layer_takes(c.w, c.shape, c.x.rows) {
            let o = self.gdn_from_input(c)?;
            return self.linear_add_rms_norm(&o, &c.w.out_proj, acc, norm, eps, offset);
        }
        NormAfter::for_rows(acc, c.x, norm, eps, offset)
            .and_then(|after| self.gdn_layer_step(c, Some(after)))
            .at("gdn_mixer_add_rms_norm")
    }
}
