//! The gated attention core on the device: q/gate split with per-head q/k RMSNorm and partial NeoX
//! RoPE (one kernel each for q and k), the K/V write into the layer's pools, then the paged decode
//! kernel for a batch of one-token chunks or the paged prefill kernel per chunk.

use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;
use sanmai_model::backend::{AttnShape, AttnWeights, Rope, SeqChunk};

use super::cache::KvPool;
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend};
use crate::error::{CudaError, Result};
use crate::ops::{AttnDims, HeadLayout, RopeArgs};

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_impl(
        &self,
        layer: usize,
        sh: &AttnShape,
        rope: &Rope,
        q_gate: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        w: &AttnWeights<CudaWeight>,
        seqs: &[SeqChunk<'_>],
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
        let rows = q_gate.rows;
        let bad = |msg: String| CudaError::Shape {
            op: "attention",
            msg,
        };
        if q_gate.cols != 2 * nh * d || k.cols != nkv * d || v.cols != nkv * d {
            return Err(bad(format!(
                "q_gate {} / k {} / v {} columns do not match {nh} heads, {nkv} kv heads of {d}",
                q_gate.cols, k.cols, v.cols
            )));
        }
        if k.rows != rows || v.rows != rows {
            return Err(bad("q, k and v differ in rows".into()));
        }
        let mut st = self.lock();
        let st = &mut *st;
        let bs = st.kv.block_size;
        let m = st.meta.seqs(g, seqs, rows, bs)?;
        let ri = st.rope_table(g, &rope.inv_freq)?;
        let inv_freq = &st.rope[ri].1;
        let positions = st.meta.view(m.positions, rows);
        let ra = RopeArgs {
            inv_freq,
            rot_dim: rope.rot_dim,
            mscale: rope.mscale,
        };
        let pool = st
            .kv
            .layers
            .get_mut(&layer)
            .ok_or_else(|| bad(format!("no K/V pool for layer {layer}: init_cache first")))?;
        let kv_dst = st.meta.view(m.kv_dst, rows);
        let (q, gate) = self.qkv_prepare(sh, &ra, &positions, &kv_dst, q_gate, k, v, w, pool)?;
        let dims = AttnDims {
            hq: nh,
            hkv: nkv,
            head_dim: d,
            block_size: bs,
        };
        // Every row is written below (each row belongs to one chunk), so it is not cleared.
        let mut out = self.alloc(rows, nh * d)?;
        let tables = st.meta.view(m.tables, m.n_seq * m.stride);
        if all_decode(seqs) {
            // A decode step that may be recorded sizes the split grid by its span: splits beyond a
            // sequence's length (read on the device) exit at once.
            let longest = seqs.iter().map(|s| s.pos0 + 1).max().unwrap_or(1);
            let max_len = st.decode_span.map_or(longest, |span| span.max(longest));
            let lens = st.meta.view(m.lens, m.n_seq);
            g.attention_paged_decode(
                dims,
                &q.buf,
                &gate.buf,
                &pool.k,
                &pool.v,
                &tables,
                m.stride,
                &lens,
                max_len,
                &mut out.buf,
                seqs.len(),
            )?;
        } else {
            let qr = nh * d;
            for (i, s) in seqs.iter().enumerate().filter(|(_, s)| s.len > 0) {
                let nb = (s.pos0 + s.len).div_ceil(bs.max(1));
                let table = tables.slice(i * m.stride..i * m.stride + nb);
                let (a, b) = (s.start * qr, (s.start + s.len) * qr);
                g.attention_paged_prefill(
                    dims,
                    &q.buf.slice(a..b),
                    &gate.buf.slice(a..b),
                    &pool.k,
                    &pool.v,
                    &table,
                    s.pos0,
                    s.len,
                    &mut out.buf.slice_mut(a..b),
                )?;
            }
        }
        Ok(out)
    }

    /// The start of dense and QSA attention alike: q (per-head RMSNorm and partial RoPE) and the gate
    /// split out of `q_gate`, k normed and roped the same way and written with v into `pool` at the
    /// step's K/V destinations. Returns `(q, gate)`, each `[rows, num_heads·head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qkv_prepare(
        &self,
        sh: &AttnShape,
        ra: &RopeArgs<'_, CudaSlice<f32>>,
        positions: &CudaView<'_, u32>,
        kv_dst: &CudaView<'_, u32>,
        q_gate: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        w: &AttnWeights<CudaWeight>,
        pool: &mut KvPool,
    ) -> Result<(CudaTensor, CudaTensor)> {
        let g = &self.gpu;
        let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
        let rows = q_gate.rows;
        let mut q = self.alloc(rows, nh * d)?;
        let mut gate = self.alloc(rows, nh * d)?;
        let mut kn = self.alloc(rows, nkv * d)?;
        let mut gv = gate.buf.slice_mut(..);
        g.qk_norm_rope(
            &q_gate.buf,
            HeadLayout {
                rows,
                n_heads: nh,
                head_dim: d,
                row_stride: 2 * nh * d,
                head_stride: 2 * d,
            },
            vector(&w.q_norm)?,
            sh.eps,
            positions,
            ra,
            &mut q.buf,
            Some(&mut gv),
        )?;
        g.qk_norm_rope::<CudaSlice<f32>>(
            &k.buf,
            HeadLayout {
                rows,
                n_heads: nkv,
                head_dim: d,
                row_stride: nkv * d,
                head_stride: d,
            },
            vector(&w.k_norm)?,
            sh.eps,
            positions,
            ra,
            &mut kn.buf,
            None,
        )?;
        g.kv_write(
            &kn.buf,
            &v.buf,
            &mut pool.k,
            &mut pool.v,
            kv_dst,
            rows,
            nkv * d,
        )?;
        Ok((q, gate))
    }
}

/// The bf16 values of a vector weight.
pub(crate) fn vector(w: &CudaWeight) -> Result<&CudaSlice<bf16>> {
    Ok(w.bf16())
}
