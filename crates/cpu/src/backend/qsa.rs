//! QSA attention ([`Backend::qsa_attention`](sanmai_model::Backend::qsa_attention)): the lightning
//! indexer's fp8 keys written next to the K/V (through the prologue of `attention.rs`), the index
//! scan, the exact top-k, and the gated attention over the selected rows only.

use std::sync::Mutex;

use rayon::prelude::*;
use sanmai_model::backend::{OpResult, QsaCall, SeqChunk};

use super::attention::{attend_all, heads, IndexEntries};
use super::cache::{pool_offset, Pools};
use super::{ensure, CpuBackend, CpuTensor, CpuWeight, QsaSelection};
use crate::ops;

/// Epsilon of the indexer's key LayerNorm.
const INDEX_NORM_EPS: f32 = 1e-6;

/// One sequence's indexer queries and head weights, what its scan reads.
struct Scan {
    /// Indexer queries `[len, nI·dI]`, roped.
    qi: Vec<f32>,
    /// Head weights `[len, nI]`, scaled by `nI^-0.5·dI^-0.5`.
    wts: Vec<f32>,
}

/// One sequence's indexer pass: the roped queries and scaled head weights, and the index-key
/// entries `[len, dI + 2]` bytes of its keys (LayerNorm, RoPE, fp8 with a bf16 scale).
fn index(s: &SeqChunk<'_>, c: &QsaCall<'_, CpuTensor, CpuWeight>) -> (Vec<u8>, Scan) {
    let (ni, di) = (c.qsa.n_heads, c.qsa.head_dim);
    let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
    let t = s.len;
    let positions: Vec<u32> = (s.pos0..s.pos0 + t).map(|p| p as u32).collect();
    let mut qi = c.iq.row_range(s.start, t).to_vec();
    let mut ki = c.ik.row_range(s.start, t).to_vec();
    let iw = c.indexer;
    ops::layer_norm(
        &mut ki,
        &iw.k_norm.data,
        &iw.k_norm_bias.data,
        di,
        INDEX_NORM_EPS,
    );
    let r = &c.qsa.rope;
    if r.rot_dim > 0 {
        ops::rope_neox(&mut qi, ni, di, r.rot_dim, &positions, &r.inv_freq, 1.0);
        ops::rope_neox(&mut ki, 1, di, r.rot_dim, &positions, &r.inv_freq, 1.0);
    }
    let mut entries = vec![0u8; t * (di + 2)];
    for (kr, e) in ki.chunks_exact(di).zip(entries.chunks_exact_mut(di + 2)) {
        ops::quantize_index_key(kr, e);
    }
    let wts =
        c.iw.row_range(s.start, t)
            .iter()
            .map(|x| x * head_scale)
            .collect();
    (entries, Scan { qi, wts })
}

/// `Err` unless the indexer's inputs and weights fit the call's QSA shape and the step.
fn check(op: &'static str, c: &QsaCall<'_, CpuTensor, CpuWeight>) -> OpResult<()> {
    let (ni, di) = (c.qsa.n_heads, c.qsa.head_dim);
    let seqs = c.attn.seqs;
    ensure(ni > 0 && di > 0, op, || {
        format!("an indexer of {ni} heads of width {di}")
    })?;
    c.iq.check_step(op, "iq", ni * di, seqs)?;
    c.ik.check_step(op, "ik", di, seqs)?;
    c.iw.check_step(op, "iw", ni, seqs)?;
    let w = c.indexer;
    ensure(
        w.k_norm.data.len() == di && w.k_norm_bias.data.len() == di,
        op,
        || {
            format!(
                "an index-key LayerNorm of {} values for dI = {di}",
                w.k_norm.data.len()
            )
        },
    )?;
    let r = &c.qsa.rope;
    ensure(
        r.rot_dim.is_multiple_of(2) && r.rot_dim <= di && r.inv_freq.len() == r.rot_dim / 2,
        op,
        || format!("an indexer RoPE over {} dims for dI = {di}", r.rot_dim),
    )
}

impl CpuBackend {
    pub(super) fn qsa_impl(&self, c: &QsaCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        const OP: &str = "qsa_attention";
        check(OP, c)?;
        let (a, qsa) = (&c.attn, c.qsa);
        let (layer, seqs) = (a.layer, a.seqs);
        let (ni, di) = (qsa.n_heads, qsa.head_dim);
        // 1. Per sequence: the indexer's queries, keys and head weights; then the prologue of
        //    gated attention, which writes K, V and the index-key entries into the blocks.
        let (entries, scans): (Vec<Vec<u8>>, Vec<Scan>) =
            seqs.par_iter().map(|s| index(s, c)).unzip();
        let index = IndexEntries {
            width: di + 2,
            entries: &entries,
        };
        let (prepared, guard) = self.attention_prologue(OP, a, Some(index))?;
        let pools: &Pools = &guard;
        let pool = pools.layer(OP, layer)?;
        let (bs, row, irow) = (pools.block_size, pools.row, pools.idx_row);
        let heads = heads(a);
        let width = heads.hq * heads.d;
        let tracing = self.qsa_trace.lock().unwrap().is_some();
        let trace = Mutex::new(Vec::new());
        // 2. Attend: densely while every position is selected, else over each row's top-k.
        let outs: Vec<Vec<f32>> = seqs
            .par_iter()
            .zip(&prepared)
            .zip(&scans)
            .map(|((s, p), sc)| {
                let len = s.pos0 + s.len;
                if len <= qsa.topk {
                    if tracing {
                        let mut tr = trace.lock().unwrap();
                        for i in 0..s.len {
                            let pos = s.pos0 + i;
                            tr.push(QsaSelection {
                                layer,
                                state: s.state,
                                pos,
                                selected: (0..=pos).collect(),
                            });
                        }
                    }
                    return attend_all(pools, pool, s, p, heads);
                }
                let mut out = vec![0f32; s.len * width];
                // The indexer scan: every index key of the sequence, dequantised.
                let mut keys = vec![0f32; len * di];
                for (pos, kd) in keys.chunks_exact_mut(di).enumerate() {
                    let o = pool_offset(s.blocks, bs, irow, pos);
                    ops::dequantize_index_key(&pool.idx[o..o + irow], kd);
                }
                out.par_chunks_mut(width).enumerate().for_each(|(i, o)| {
                    let ctx = s.pos0 + i + 1;
                    let sel = if ctx <= qsa.topk {
                        (0..ctx).collect()
                    } else {
                        let mut scores = vec![0f32; ctx];
                        ops::index_scores(
                            &sc.qi[i * ni * di..(i + 1) * ni * di],
                            &sc.wts[i * ni..(i + 1) * ni],
                            &keys[..ctx * di],
                            di,
                            &mut scores,
                        );
                        ops::topk_positions(&scores, qsa.topk)
                    };
                    if tracing {
                        trace.lock().unwrap().push(QsaSelection {
                            layer,
                            state: s.state,
                            pos: ctx - 1,
                            selected: sel.clone(),
                        });
                    }
                    // Only the selected K/V rows are read.
                    let mut kr = Vec::with_capacity(sel.len() * row);
                    let mut vr = Vec::with_capacity(sel.len() * row);
                    for &pos in &sel {
                        let off = pool_offset(s.blocks, bs, row, pos);
                        kr.extend_from_slice(&pool.k[off..off + row]);
                        vr.extend_from_slice(&pool.v[off..off + row]);
                    }
                    ops::attend_rows(
                        &p.q[i * width..(i + 1) * width],
                        &p.gate[i * width..(i + 1) * width],
                        &kr,
                        &vr,
                        &heads,
                        o,
                    );
                });
                out
            })
            .collect();
        if tracing {
            let mut recorded = trace.into_inner().unwrap();
            recorded.sort_by_key(|r| (r.state, r.pos));
            if let Some(t) = self.qsa_trace.lock().unwrap().as_mut() {
                t.extend(recorded);
            }
        }
        Ok(Self::stack(seqs, width, outs))
    }
}
