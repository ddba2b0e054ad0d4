//! The gated delta net core on the device: causal conv + SiLU and the delta rule over the layer's state
//! slots (one batched launch each for a step of one-token chunks, one per chunk otherwise), then the
//! gated RMSNorm with `z`.

use sanmai_model::backend::{GdnShape, GdnWeights, SeqChunk};

use super::cache::{conv_len, ssm_len};
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend};
use crate::error::{CudaError, Result};
use crate::ops::GdnDims;

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gdn_impl(
        &self,
        layer: usize,
        sh: &GdnShape,
        qkv: &CudaTensor,
        z: &CudaTensor,
        b: &CudaTensor,
        a: &CudaTensor,
        w: &GdnWeights<CudaWeight>,
        eps: f32,
        seqs: &[SeqChunk<'_>],
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let dims = GdnDims {
            hk: sh.num_k_heads,
            hv: sh.num_v_heads,
            dk: sh.k_head_dim,
            dv: sh.v_head_dim,
        };
        let (cd, kk, hv, dv) = (dims.conv_dim(), sh.conv_kernel, dims.hv, dims.dv);
        let rows = qkv.rows;
        let bad = |msg: String| CudaError::Shape { op: "gdn", msg };
        if qkv.cols != cd || z.cols != hv * dv || a.cols != hv || b.cols != hv {
            return Err(bad("projection widths do not match the GDN shape".into()));
        }
        let a_log = w
            .a_log
            .f32()
            .ok_or_else(|| bad("A_log is not a vector".into()))?;
        let dt_bias = w
            .dt_bias
            .f32()
            .ok_or_else(|| bad("dt_bias is not a vector".into()))?;
        let mut st = self.lock();
        let st = &mut *st;
        let bs = st.kv.block_size;
        let m = st.meta.seqs(g, seqs, rows, bs)?;
        for s in seqs {
            st.states.check(s.state)?;
        }
        let pool = st
            .states
            .layers
            .get_mut(&layer)
            .ok_or_else(|| bad(format!("no GDN state for layer {layer}: init_cache first")))?;
        let mut mixed = self.zeros(rows, cd)?;
        let mut core = self.zeros(rows, hv * dv)?;
        let conv_w = w.conv.bf16();
        if all_decode(seqs) && kk >= 2 {
            let n = seqs.len();
            let slots = st.meta.view(m.slots, n);
            g.conv1d_update(
                &qkv.buf,
                conv_w,
                &mut pool.conv,
                &slots,
                &mut mixed.buf,
                n,
                cd,
                kk,
            )?;
            g.gdn_recurrent_step(
                dims,
                &mixed.buf,
                &a.buf,
                &b.buf,
                a_log,
                dt_bias,
                &mut pool.ssm,
                &slots,
                &mut core.buf,
                n,
            )?;
        } else {
            let (cl, sl) = (conv_len(sh), ssm_len(sh));
            for s in seqs.iter().filter(|s| s.len > 0) {
                let (r0, r1) = (s.start, s.start + s.len);
                g.conv1d_prefill(
                    &qkv.buf.slice(r0 * cd..r1 * cd),
                    conv_w,
                    &mut pool.conv.slice_mut(s.state * cl..(s.state + 1) * cl),
                    &mut mixed.buf.slice_mut(r0 * cd..r1 * cd),
                    s.len,
                    cd,
                    kk,
                )?;
                g.gdn_recurrent_prefill(
                    dims,
                    &mixed.buf.slice(r0 * cd..r1 * cd),
                    &a.buf.slice(r0 * hv..r1 * hv),
                    &b.buf.slice(r0 * hv..r1 * hv),
                    a_log,
                    dt_bias,
                    &mut pool.ssm.slice_mut(s.state * sl..(s.state + 1) * sl),
                    &mut core.buf.slice_mut(r0 * hv * dv..r1 * hv * dv),
                    s.len,
                )?;
            }
        }
        let mut out = self.alloc(rows, hv * dv)?;
        g.gated_rms_norm(
            &core.buf,
            &z.buf,
            w.norm.bf16(),
            &mut out.buf,
            rows * hv,
            dv,
            eps,
        )?;
        Ok(out)
    }
}
