//! The gated attention core on the device: q/gate split with per-head q/k RMSNorm and partial NeoX
//! RoPE (one kernel each for q and k), the K/V write into the layer's pools, then the paged decode
//! kernel for a batch of one-token chunks or the paged prefill kernel per chunk. The first part
//! ([`CudaBackend::attn_prologue`]) is QSA attention's first part too (`qsa.rs`).
//!
//! Explicit interleaved-MRoPE positions (`AttnCall::mrope`, images in a prompt) change the RoPE
//! angles only: the rows' `(t, h, w)` are staged once per step (`Meta::stage_mrope`, a small
//! device buffer reused across steps) and the norm+RoPE kernel takes each frequency's axis from
//! them; the K/V destinations and the causal extent stay the sequence positions.

use sanmai_model::backend::{AttnCall, AttnShape};

use super::meta::SeqMeta;
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend, State};
use crate::error::{CudaError, Result};
use crate::ops::{
    AttnDims, ChunkRows, DecodeLens, HeadLayout, HeadNorm, KvPools, MropeArgs, PagedCache, Queries,
    RopeArgs,
};

/// What the attention prologue leaves for the attention proper: q (normed and roped) and the gate,
/// each `[rows, num_heads·head_dim]`, and where the step's chunks lie in the metadata buffer.
pub(crate) struct Prepared {
    pub q: CudaTensor,
    pub gate: CudaTensor,
    pub meta: SeqMeta,
}

/// The paged kernels' dimensions of an attention shape over blocks of `block_size` positions.
pub(crate) fn attn_dims(sh: &AttnShape, block_size: usize) -> AttnDims {
    AttnDims {
        hq: sh.num_heads,
        hkv: sh.num_kv_heads,
        head_dim: sh.head_dim,
        block_size,
    }
}

impl CudaBackend {
    pub(crate) fn attention_impl(
        &self,
        c: &AttnCall<'_, CudaTensor, CudaWeight>,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (nh, d) = (c.shape.num_heads, c.shape.head_dim);
        let rows = c.q_gate.rows;
        let mut st = self.lock();
        let st = &mut *st;
        let Prepared { q, gate, meta: m } = self.attn_prologue(st, c, "attention")?;
        let bs = st.kv.block_size;
        let pool = st.kv.pool(c.layer)?;
        let dims = attn_dims(c.shape, bs);
        // Every row is written below (each row belongs to one chunk), so it is not cleared.
        let mut out = self.alloc(rows, nh * d)?;
        let tables = st.meta.view(m.tables, m.n_seq * m.stride);
        if all_decode(c.seqs) {
            // A decode step that may be recorded sizes the split grid by its span: splits beyond a
            // sequence's length (read on the device) exit at once.
            let longest = c.seqs.iter().map(|s| s.pos0 + 1).max().unwrap_or(1);
            let max_len = st.decode_span.map_or(longest, |span| span.max(longest));
            let lens = st.meta.view(m.lens, m.n_seq);
            let cache = PagedCache {
                pools: KvPools {
                    k: &pool.k,
                    v: &pool.v,
                },
                tables: &tables,
                stride: m.stride,
            };
            let seqs = DecodeLens {
                lens: &lens,
                max_len,
                batch: c.seqs.len(),
            };
            let queries = Queries {
                q: &q.buf,
                gate: &gate.buf,
            };
            g.attention_paged_decode(dims, &queries, &cache, &seqs, &mut out.buf)?;
        } else {
            let qr = nh * d;
            for (i, s) in c.seqs.iter().enumerate().filter(|(_, s)| s.len > 0) {
                let nb = (s.pos0 + s.len).div_ceil(bs.max(1));
                let table = tables.slice(i * m.stride..i * m.stride + nb);
                let (a, b) = (s.start * qr, (s.start + s.len) * qr);
                let cache = PagedCache {
                    pools: KvPools {
                        k: &pool.k,
                        v: &pool.v,
                    },
                    tables: &table,
                    stride: 0,
                };
                let queries = Queries {
                    q: &q.buf.slice(a..b),
                    gate: &gate.buf.slice(a..b),
                };
                let chunk = ChunkRows {
                    pos0: s.pos0,
                    t: s.len,
                };
                g.attention_paged_prefill(
                    dims,
                    &queries,
                    &cache,
                    chunk,
                    &mut out.buf.slice_mut(a..b),
                )?;
            }
        }
        Ok(out)
    }

    /// The start of dense and QSA attention alike (`op` names which, for its errors): the inputs
    /// checked against the shape, the step's chunks staged, q (per-head RMSNorm and partial RoPE)
    /// and the gate split out of `q_gate`, k normed and roped the same way and written with v into
    /// layer `c.layer`'s pool at the step's K/V destinations.
    pub(crate) fn attn_prologue(
        &self,
        st: &mut State,
        c: &AttnCall<'_, CudaTensor, CudaWeight>,
        op: &'static str,
    ) -> Result<Prepared> {
        let g = &self.gpu;
        let sh = c.shape;
        let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
        let (q_gate, k, v) = (c.q_gate, c.k, c.v);
        let rows = q_gate.rows;
        let bad = |msg: String| CudaError::Shape { op, msg };
        if q_gate.cols != 2 * nh * d || k.cols != nkv * d || v.cols != nkv * d {
            return Err(bad(format!(
                "q_gate {} / k {} / v {} columns do not match {nh} heads, {nkv} kv heads of {d}",
                q_gate.cols, k.cols, v.cols
            )));
        }
        if k.rows != rows || v.rows != rows {
            return Err(bad("q, k and v differ in rows".into()));
        }
        let bs = st.kv.block_size;
        let m = st.meta.seqs(g, c.seqs, rows, bs)?;
        let ri = st.rope_table(g, &c.rope.inv_freq)?;
        let sections = match &c.mrope {
            None => None,
            Some(mr) => {
                let half = c.rope.rot_dim / 2;
                if mr.positions.len() < rows {
                    return Err(bad(format!(
                        "{} MRoPE positions for a step of {rows} rows",
                        mr.positions.len()
                    )));
                }
                if mr.sections.iter().sum::<usize>() != half {
                    return Err(bad(format!(
                        "MRoPE sections {:?} for {half} rotary frequencies",
                        mr.sections
                    )));
                }
                st.meta.stage_mrope(g, &mr.positions[..rows])?;
                Some(mr.sections)
            }
        };
        let positions = st.meta.view(m.positions, rows);
        let pos3 = match sections {
            None => None,
            Some(_) => Some(
                st.meta
                    .mrope_view(rows)
                    .ok_or_else(|| bad("MRoPE positions not staged".into()))?,
            ),
        };
        let ra = RopeArgs {
            positions: &positions,
            inv_freq: &st.rope[ri].1,
            rot_dim: c.rope.rot_dim,
            mscale: c.rope.mscale,
        };
        let mrope = sections
            .zip(pos3.as_ref())
            .map(|(sections, positions)| MropeArgs {
                rope: &ra,
                positions,
                sections,
            });
        let kv_dst = st.meta.view(m.kv_dst, rows);
        let pool = st.kv.pool_mut(c.layer)?;
        let mut q = self.alloc(rows, nh * d)?;
        let mut gate = self.alloc(rows, nh * d)?;
        let mut kn = self.alloc(rows, nkv * d)?;
        let mut gv = gate.buf.slice_mut(..);
        let q_layout = HeadLayout {
            rows,
            n_heads: nh,
            head_dim: d,
            row_stride: 2 * nh * d,
            head_stride: 2 * d,
        };
        let q_norm = HeadNorm {
            w: c.w.q_norm.bf16()?,
            eps: sh.eps,
        };
        let k_layout = HeadLayout {
            rows,
            n_heads: nkv,
            head_dim: d,
            row_stride: nkv * d,
            head_stride: d,
        };
        let k_norm = HeadNorm {
            w: c.w.k_norm.bf16()?,
            eps: sh.eps,
        };
        match &mrope {
            None => {
                g.qk_norm_rope(
                    &q_gate.buf,
                    q_layout,
                    &q_norm,
                    &ra,
                    &mut q.buf,
                    Some(&mut gv),
                )?;
                g.qk_norm_rope(&k.buf, k_layout, &k_norm, &ra, &mut kn.buf, None)?;
            }
            Some(mr) => {
                let (x, out) = (&q_gate.buf, &mut q.buf);
                g.qk_norm_rope_mrope(x, q_layout, &q_norm, mr, out, Some(&mut gv))?;
                g.qk_norm_rope_mrope(&k.buf, k_layout, &k_norm, mr, &mut kn.buf, None)?;
            }
        }
        let pools = KvPools {
            k: &mut pool.k,
            v: &mut pool.v,
        };
        g.kv_write(&kn.buf, &v.buf, pools, &kv_dst, rows, nkv * d)?;
        Ok(Prepared { q, gate, meta: m })
    }
}
