//! QSA attention on the device (spec §2): the attention inputs as for gated attention (q/k norms and
//! RoPE, the K/V write), the index-key write into the layer's index pool, then per sequence either the
//! dense paged kernels (every position selected: context ≤ topk) or the indexer scan, the exact top-k
//! and the attention over the gathered selected rows only. Not recorded into CUDA graphs (see
//! `CudaBackend::refuse_capture`): decode steps of QSA models run eagerly.

use cudarc::driver::sys;
use sanmai_model::backend::{AttnShape, AttnWeights, IndexerWeights, QsaShape, Rope, SeqChunk};

use super::attn::vector;
use super::cache::QsaPick;
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend};
use crate::error::{CudaError, Result};
use crate::ops::{AttnDims, RopeArgs};

/// Epsilon of the indexer's key LayerNorm.
const INDEX_NORM_EPS: f32 = 1e-6;
/// Score scratch per group of query rows, in f32 values (128 MiB).
const SCORE_BUDGET: usize = 32 << 20;
/// Query rows per score / select / attend launch at most (the grid's y limit).
const MAX_GROUP_ROWS: usize = 65535;

impl CudaBackend {
    /// Refuses to be recorded into a CUDA graph: QSA and the PLE mix choose their launches from the
    /// step's host-side lengths (dense or selecting, score grid, splits) and state slots, which a
    /// replay for a later step would not update. The error fails the capture, and the graph code
    /// runs such decode steps eagerly.
    pub(crate) fn refuse_capture(&self, op: &'static str) -> Result<()> {
        let status = self.gpu.stream().capture_status()?;
        if status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            Ok(())
        } else {
            Err(CudaError::Shape {
                op,
                msg: "not capturable into a CUDA graph (host-side lengths and slots)".into(),
            })
        }
    }

    /// Starts (`true`) or stops recording QSA selections (each query row's selected positions; a
    /// device synchronisation per QSA call while on: for tests and diagnostics).
    pub fn trace_qsa(&self, on: bool) {
        self.lock().kv.qsa_trace = on.then(Vec::new);
    }

    /// The selections recorded since the last call, as `(layer, state slot, position, selected
    /// positions ascending)`, sorted by slot and position.
    pub fn take_qsa_trace(&self) -> Vec<QsaPick> {
        let mut v = self
            .lock()
            .kv
            .qsa_trace
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        v.sort_by_key(|r| (r.0, r.1, r.2));
        v
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qsa_impl(
        &self,
        layer: usize,
        sh: &AttnShape,
        rope: &Rope,
        qsa: &QsaShape,
        q_gate: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        w: &AttnWeights<CudaWeight>,
        iq: &CudaTensor,
        ik: &CudaTensor,
        iw: &CudaTensor,
        iw_: &IndexerWeights<CudaWeight>,
        seqs: &[SeqChunk<'_>],
    ) -> Result<CudaTensor> {
        self.refuse_capture("qsa_attention")?;
        let g = &self.gpu;
        let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
        let (ni, di, topk) = (qsa.n_heads, qsa.head_dim, qsa.topk.max(1));
        let rows = q_gate.rows;
        let bad = |msg: String| CudaError::Shape {
            op: "qsa_attention",
            msg,
        };
        if q_gate.cols != 2 * nh * d || k.cols != nkv * d || v.cols != nkv * d {
            return Err(bad(format!(
                "q_gate {} / k {} / v {} columns do not match {nh} heads, {nkv} kv heads of {d}",
                q_gate.cols, k.cols, v.cols
            )));
        }
        if iq.cols != ni * di || ik.cols != di || iw.cols != ni {
            return Err(bad(format!(
                "iq {} / ik {} / iw {} columns do not match {ni} indexer heads of {di}",
                iq.cols, ik.cols, iw.cols
            )));
        }
        if [k.rows, v.rows, iq.rows, ik.rows, iw.rows]
            .iter()
            .any(|&r| r != rows)
        {
            return Err(bad("the inputs differ in rows".into()));
        }
        let mut st = self.lock();
        let st = &mut *st;
        let bs = st.kv.block_size;
        if st.kv.idx_row != di + 2 {
            return Err(bad(format!(
                "the cache has no index keys of width dI = {di}: init_cache with index_head_dim"
            )));
        }
        let m = st.meta.seqs(g, seqs, rows, bs)?;
        let ri = st.rope_table(g, &rope.inv_freq)?;
        let qi_rope = st.rope_table(g, &qsa.rope.inv_freq)?;
        let inv_freq = &st.rope[ri].1;
        let index_freq = &st.rope[qi_rope].1;
        let positions = st.meta.view(m.positions, rows);
        // 1. q (normed, roped), gate and the normed, roped k, as the dense attention; 2. K, V and the
        // index-key entries into the sequences' blocks.
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
        let half = qsa.rope.rot_dim / 2;
        let idx = pool
            .idx
            .as_mut()
            .ok_or_else(|| bad(format!("layer {layer} has no index-key pool")))?;
        g.qsa_index_key_write(
            &ik.buf,
            vector(&iw_.k_norm)?,
            vector(&iw_.k_norm_bias)?,
            INDEX_NORM_EPS,
            &positions,
            (di, half, index_freq),
            &kv_dst,
            idx,
            rows,
        )?;
        let pool = &*pool;
        let idx = pool.idx.as_ref().expect("checked above");
        let dims = AttnDims {
            hq: nh,
            hkv: nkv,
            head_dim: d,
            block_size: bs,
        };
        let mut out = self.zeros(rows, nh * d)?;
        let tables = st.meta.view(m.tables, m.n_seq * m.stride);
        let mut trace: Vec<QsaPick> = Vec::new();
        let tracing = st.kv.qsa_trace.is_some();
        let dense = |s: &SeqChunk<'_>| s.pos0 + s.len <= topk;
        // 3a. Every position of the step selected: the dense kernels, as gated attention.
        if all_decode(seqs) && seqs.iter().all(dense) {
            let max_len = seqs.iter().map(|s| s.pos0 + 1).max().unwrap_or(1);
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
            if tracing {
                for s in seqs {
                    trace.push((layer, s.state, s.pos0, (0..=s.pos0).collect()));
                }
            }
        } else {
            // 3b. Per sequence: dense while its context fits topk, else scan, select and gather.
            let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
            let mut qi = self.scratch::<f32>(rows * ni * di)?;
            let mut wts = self.scratch::<f32>(rows * ni)?;
            g.qsa_query_prep(
                &iq.buf,
                &iw.buf,
                &positions,
                (ni, di, half, index_freq),
                head_scale,
                &mut qi,
                &mut wts,
                rows,
            )?;
            let qr = nh * d;
            for (i, s) in seqs.iter().enumerate().filter(|(_, s)| s.len > 0) {
                let nb = (s.pos0 + s.len).div_ceil(bs.max(1));
                let table = tables.slice(i * m.stride..i * m.stride + nb);
                if dense(s) {
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
                    if tracing {
                        for p in s.pos0..s.pos0 + s.len {
                            trace.push((layer, s.state, p, (0..=p).collect()));
                        }
                    }
                    continue;
                }
                let ctx_all = s.pos0 + s.len;
                let group = (SCORE_BUDGET / ctx_all).clamp(1, MAX_GROUP_ROWS);
                let mut a = 0;
                while a < s.len {
                    let n = group.min(s.len - a);
                    let (r0, p0) = (s.start + a, s.pos0 + a);
                    let ld = p0 + n;
                    let mut scores = self.scratch::<f32>(n * ld)?;
                    let mut sel = self.scratch::<u32>(n * topk)?;
                    let mut counts = self.scratch::<u32>(n)?;
                    g.qsa_scores(
                        &qi.slice(r0 * ni * di..(r0 + n) * ni * di),
                        &wts.slice(r0 * ni..(r0 + n) * ni),
                        idx,
                        &table,
                        ni,
                        di,
                        bs,
                        p0,
                        n,
                        &mut scores,
                        ld,
                    )?;
                    g.qsa_topk(&scores, ld, p0, n, topk, &mut sel, &mut counts)?;
                    let (qa, qb) = (r0 * qr, (r0 + n) * qr);
                    g.qsa_attention_gather(
                        dims,
                        &q.buf.slice(qa..qb),
                        &gate.buf.slice(qa..qb),
                        &pool.k,
                        &pool.v,
                        &table,
                        &sel,
                        topk,
                        &counts,
                        topk.min(ld),
                        &mut out.buf.slice_mut(qa..qb),
                        n,
                    )?;
                    if tracing {
                        let sel = g.download(&sel)?;
                        let counts = g.download(&counts)?;
                        for (j, &c) in counts.iter().take(n).enumerate() {
                            let picked = sel[j * topk..j * topk + c as usize]
                                .iter()
                                .map(|&x| x as usize)
                                .collect();
                            trace.push((layer, s.state, p0 + j, picked));
                        }
                    }
                    a += n;
                }
            }
        }
        if let Some(t) = st.kv.qsa_trace.as_mut() {
            t.extend(trace);
        }
        Ok(out)
    }
}
