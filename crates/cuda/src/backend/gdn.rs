//! The gated delta net core on the device. A step of one-token chunks is one launch of the fused
//! decode kernel (conv update against the conv state ring, delta rule, gated RMSNorm); any other step
//! runs the multi-sequence prefill kernels (causal conv + SiLU over the ring, the chunked delta rule)
//! and then the gated RMSNorm with `z`, one launch per kernel for the whole step.

use std::sync::atomic::Ordering;

use sanmai_model::backend::{GdnCall, GdnGates, GdnShape, GdnWeights};

use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend};
use crate::error::{CudaError, Result};
use crate::ops::{
    ConvWeight, DecodeSlots, GdnDecodeWeights, GdnDims, GdnGateProj, GdnGates as PrefillGates,
    GdnPools, GdnProj, NormRows, SeqRows,
};

fn dims_of(sh: &GdnShape) -> GdnDims {
    GdnDims {
        hk: sh.num_k_heads,
        hv: sh.num_v_heads,
        dk: sh.k_head_dim,
        dv: sh.v_head_dim,
    }
}

impl CudaBackend {
    /// [`Backend::gdn_projects_gates`](sanmai_model::Backend::gdn_projects_gates): with fused
    /// decode launches on, at one row, for bf16 gate weights `[hv, H]` the decode launch takes
    /// ([`Gpu::gdn_gates_inside_fit`](crate::Gpu::gdn_gates_inside_fit)).
    pub(crate) fn gdn_projects_gates_impl(
        &self,
        w: &GdnWeights<CudaWeight>,
        sh: &GdnShape,
        rows: usize,
    ) -> bool {
        let dims = dims_of(sh);
        let k = w.in_proj_b.cols();
        let fits = |p: &CudaWeight| matches!(p, CudaWeight::Bf16(d) if d.shape == [dims.hv, k]);
        self.switches.fused_decode.load(Ordering::Relaxed)
            && rows == 1
            && fits(&w.in_proj_b)
            && fits(&w.in_proj_a)
            && self.gpu.gdn_gates_inside_fit(dims, k)
    }

    pub(crate) fn gdn_impl(&self, c: &GdnCall<'_, CudaTensor, CudaWeight>) -> Result<CudaTensor> {
        let g = &self.gpu;
        let GdnCall {
            layer,
            shape: sh,
            qkv,
            z,
            gates,
            w,
            eps,
            seqs,
        } = *c;
        let dims = dims_of(sh);
        let (cd, kk, hv, dv) = (dims.conv_dim(), sh.conv_kernel, dims.hv, dims.dv);
        let rows = qkv.rows;
        let decode = all_decode(seqs) && rows == seqs.len();
        if let GdnGates::FromInput(x) = gates {
            if !(decode && self.gdn_projects_gates_impl(w, sh, rows)) {
                // Not a step the decode launch projects the gates of (a one-row prefill chunk).
                let ba = self.linear_many_impl(x, &[&w.in_proj_b, &w.in_proj_a])?;
                let gates = GdnGates::Given {
                    b: &ba[0],
                    a: &ba[1],
                };
                return self.gdn_impl(&GdnCall { gates, ..*c });
            }
        }
        let bad = |msg: String| CudaError::Shape { op: "gdn", msg };
        let gates_fit = match gates {
            GdnGates::Given { b, a } => a.cols == hv && b.cols == hv,
            GdnGates::FromInput(x) => x.rows == rows,
        };
        if qkv.cols != cd || z.cols != hv * dv || !gates_fit {
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
        let conv_w = w.conv.bf16()?;
        let n = seqs.len();
        let slots = st.meta.view(m.slots, n);
        let mut out = self.alloc(rows, hv * dv)?;
        if decode {
            let positions = st.meta.view(m.positions, n);
            let dw = GdnDecodeWeights {
                conv: conv_w,
                kernel: kk,
                a_log,
                dt_bias,
                norm: w.norm.bf16()?,
                eps,
            };
            let pools = GdnPools {
                conv: &mut pool.conv,
                ssm: &mut pool.ssm,
            };
            let seqs = DecodeSlots {
                slots: &slots,
                positions: &positions,
                batch: n,
            };
            match gates {
                GdnGates::Given { b, a } => {
                    let proj = GdnProj {
                        qkv: &qkv.buf,
                        z: &z.buf,
                        a: &a.buf,
                        b: &b.buf,
                    };
                    g.gdn_decode(dims, &proj, &dw, pools, &seqs, &mut out.buf)?;
                }
                GdnGates::FromInput(x) => {
                    let (mut b, mut a) = (self.alloc(1, hv)?, self.alloc(1, hv)?);
                    let proj = GdnGateProj {
                        x: &x.buf,
                        w_b: w.in_proj_b.bf16()?,
                        w_a: w.in_proj_a.bf16()?,
                        k: x.cols,
                    };
                    let ab = (&mut a.buf, &mut b.buf);
                    g.gdn_decode_projecting_gates(
                        dims,
                        &qkv.buf,
                        &z.buf,
                        &proj,
                        ab,
                        &dw,
                        pools,
                        &seqs,
                        &mut out.buf,
                    )?;
                }
            }
            return Ok(out);
        }
        let GdnGates::Given { b, a } = gates else {
            return Err(bad("a prefill step without its gate projections".into()));
        };
        // Every sequence of the step in two conv launches and one GDN launch, each reading the
        // sequences' rows, positions and slots from the step metadata. Every row of `mixed` and
        // `core` is written (each row belongs to one chunk), so neither is cleared.
        let mut mixed = self.alloc(rows, cd)?;
        let mut core = self.alloc(rows, hv * dv)?;
        let max_len = seqs.iter().map(|s| s.len).max().unwrap_or(0);
        let positions = st.meta.view(m.positions, rows);
        let starts = st.meta.view(m.starts, n);
        let lens = st.meta.view(m.chunk_lens, n);
        let step = SeqRows {
            starts: &starts,
            lens: &lens,
            slots: &slots,
            rows,
            n_seq: n,
            max_len,
        };
        let conv = ConvWeight {
            w: conv_w,
            channels: cd,
            kernel: kk,
        };
        g.conv1d_prefill(
            &qkv.buf,
            &conv,
            &mut pool.conv,
            &positions,
            &step,
            &mut mixed.buf,
        )?;
        let gates = PrefillGates {
            a: &a.buf,
            b: &b.buf,
            a_log,
            dt_bias,
        };
        g.gdn_chunk_prefill(
            dims,
            &mixed.buf,
            &gates,
            &mut pool.ssm,
            &step,
            &mut core.buf,
        )?;
        let shape = NormRows {
            rows: rows * hv,
            d: dv,
            eps,
        };
        g.gated_rms_norm(&core.buf, &z.buf, w.norm.bf16()?, &mut out.buf, shape)?;
        Ok(out)
    }
}
