//! A layer's pending MoE output, the next layer's input norm and its GDN mixer in one launch
//! ([`Gpu::moe_gdn_layer_decode`]): with the one-launch MoE layer and GDN mixer both taking a
//! decoding row and the pair switch on, the two persistent launches run as one (the same bits).

use std::sync::atomic::Ordering;

use sanmai_model::backend::{
    Backend, GdnMixerCall, GdnShape, GdnWeights, MoeCall, MoeWeights, OpResult,
};

use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{At, CudaError, Result};
use crate::ops::{LayerSync, PairOut};
use crate::Gpu;

/// The bits and input width of a packed weight, or `None`.
fn packed(w: &CudaWeight) -> Option<(u32, usize)> {
    match w {
        CudaWeight::Packed(p) => Some((p.scheme().bits, p.in_features())),
        _ => None,
    }
}

impl CudaBackend {
    /// Whether the pair launch takes a step of `rows` rows through MoE layer `moe` and then GDN
    /// mixer `mixer` of shape `sh`: the switch on, one row, each half's one launch taking it, and a
    /// pair kernel of their widths ([`Gpu::layer_pair_fits`]).
    pub fn layer_pair_takes(
        &self,
        moe: &MoeWeights<CudaWeight>,
        mixer: &GdnWeights<CudaWeight>,
        sh: &GdnShape,
        rows: usize,
    ) -> bool {
        let shared_bits = match &moe.shared {
            Some(s) => packed(&s.gate_up).map(|p| p.0),
            None => Some(4),
        };
        self.switches.layer_pair.load(Ordering::Relaxed)
            && self.moe_layer_takes(moe, rows)
            && self.gdn_layer_takes(mixer, sh, rows)
            && match (shared_bits, packed(&mixer.in_proj_qkv)) {
                (Some(s), Some((p, h))) => {
                    let ko = sh.num_v_heads * sh.v_head_dim;
                    Gpu::layer_pair_fits(&self.gpu, s, p, (h, ko))
                }
                _ => false,
            }
    }

    /// [`Backend::moe_gdn_mixer_add_rms_norm`]: the pair launch where it takes the calls, else the
    /// MoE step's and the mixer's own calls.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_gdn_mixer_impl(
        &self,
        moe: &MoeCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        mixer: &GdnMixerCall<'_, CudaTensor, CudaWeight>,
        post: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        if !self.layer_pair_takes(moe.w, mixer.w, mixer.shape, moe.x.rows) {
            let hn = self.moe_experts_add_rms_norm(moe, acc, norm, eps, offset)?;
            return self.gdn_mixer_add_rms_norm(&mixer.on(&hn), acc, post, eps, offset);
        }
        self.layer_pair_step(moe, acc, (norm, post), mixer, (eps, offset))
            .at("moe_gdn_mixer_add_rms_norm")
    }

    /// The pair launch of one decoding row ([`CudaBackend::layer_pair_takes`]).
    fn layer_pair_step(
        &self,
        moe: &MoeCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        (norm, post): (&CudaWeight, &CudaWeight),
        mixer: &GdnMixerCall<'_, CudaTensor, CudaWeight>,
        (eps, offset): (f32, f32),
    ) -> Result<CudaTensor> {
        let h = moe.x.cols;
        if (acc.rows, acc.cols) != (1, h) {
            return Err(CudaError::Shape {
                op: "add_rms_norm",
                msg: format!("[{}, {}] plus [1, {h}]", acc.rows, acc.cols),
            });
        }
        let (moe_norm, mixer_norm) = (norm.bf16()?, post.bf16()?);
        let mut st = self.lock();
        let st = &mut *st;
        let mut partials = self.scratch::<f32>(self.gpu.moe_layer_max_blocks())?;
        let mut sync = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = self.alloc(1, h)?;
        let block_size = st.kv.block_size;
        let ((), ids) = self.with_moe_layer(&mut st.experts, moe, |m| {
            self.with_gdn_layer((&mut st.meta, &mut st.states, block_size), mixer, |l| {
                let out = PairOut {
                    acc: &mut acc.buf,
                    moe_norm,
                    mixer_norm,
                    normed: &mut out.buf,
                    eps,
                    offset,
                };
                let sync = LayerSync {
                    partials: &mut partials,
                    sync: &mut sync,
                };
                self.gpu
                    .moe_gdn_layer_decode(m, l.layer, l.pools, l.seq, l.bufs, out, sync)
            })
        })?;
        drop(sync);
        self.log_routing(&ids, moe.w.top_k, moe.w.experts.len())?;
        Ok(out)
    }
}
