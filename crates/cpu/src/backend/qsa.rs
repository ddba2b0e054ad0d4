//! QSA attention ([`Backend::qsa_attention`](sanmai_model::Backend::qsa_attention)): the lightning
//! indexer's fp8 keys written next to the K/V (through the prologue of `attention.rs`), the index
//! scan, the exact top-k, and the gated attention over the selected rows only; with the rows in
//! pinned host memory, decode-shaped steps read them through the layer's row cache (`host_kv.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;
use sanmai_model::backend::{OpResult, QsaCall, QsaShape, SeqChunk};

use super::attention::{attend_all, attend_gathered, heads, IndexEntries, Prepared};
use super::cache::{no_pool, Pools};
use super::host_kv::{cached_step, gather_cached, gather_host, stored_slots, RowReads};
use super::rows::{pool_offset, KvPool};
use super::{ensure, CpuBackend, CpuTensor, CpuWeight, QsaSelection};
use crate::ops::row_cache::RowCache;
use crate::ops::{self, Heads};

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
    )?;
    ensure(c.attn.mrope.is_none(), op, || {
        "explicit MRoPE positions are not supported by QSA attention (its indexer's keys have \
         no multimodal positions)"
            .into()
    })
}

/// Records the selections of a step's query rows while tracing is on.
struct Trace {
    on: bool,
    layer: usize,
    rows: Mutex<Vec<QsaSelection>>,
}

impl Trace {
    fn record(&self, s: &SeqChunk<'_>, pos: usize, selected: impl FnOnce() -> Vec<usize>) {
        if self.on {
            self.rows.lock().unwrap().push(QsaSelection {
                layer: self.layer,
                state: s.state,
                pos,
                selected: selected(),
            });
        }
    }
}

/// The selected positions of query row `i` of a sequence whose scan is `sc` over `keys`, at context
/// `ctx`: every position while `ctx ≤ topk`, else the top-k of the index scores.
fn select(sc: &Scan, keys: &[f32], i: usize, ctx: usize, qsa: &QsaShape) -> Vec<usize> {
    if ctx <= qsa.topk {
        return (0..ctx).collect();
    }
    let (ni, di) = (qsa.n_heads, qsa.head_dim);
    let mut scores = vec![0f32; ctx];
    ops::index_scores(
        &sc.qi[i * ni * di..(i + 1) * ni * di],
        &sc.wts[i * ni..(i + 1) * ni],
        &keys[..ctx * di],
        di,
        &mut scores,
    );
    ops::topk_positions(&scores, qsa.topk)
}

/// One layer's step as the attend phase sees it.
struct Attend<'a> {
    qsa: &'a QsaShape,
    heads: Heads,
    trace: &'a Trace,
    seqs: &'a [SeqChunk<'a>],
    prepared: &'a [Prepared],
    scans: &'a [Scan],
    geo: Geo,
}

impl Attend<'_> {
    /// Attends every sequence reading its K/V rows from the pool directly: densely while every
    /// position is selected, else over each row's top-k. Returns the outputs and the rows read.
    fn over_pool(&self, pools: &Pools, pool: &KvPool) -> (Vec<Vec<f32>>, u64) {
        let (qsa, heads, geo) = (self.qsa, self.heads, self.geo);
        let width = heads.hq * heads.d;
        let read = AtomicU64::new(0);
        let outs = self
            .seqs
            .par_iter()
            .zip(self.prepared)
            .zip(self.scans)
            .map(|((s, p), sc)| {
                let len = s.pos0 + s.len;
                if len <= qsa.topk {
                    for i in 0..s.len {
                        let pos = s.pos0 + i;
                        self.trace.record(s, pos, || (0..=pos).collect());
                    }
                    read.fetch_add(len as u64, Ordering::Relaxed);
                    return attend_all(pools, pool, s, p, heads);
                }
                let mut out = vec![0f32; s.len * width];
                let keys = geo.index_keys(pool, s, len, qsa.head_dim);
                out.par_chunks_mut(width).enumerate().for_each(|(i, o)| {
                    let ctx = s.pos0 + i + 1;
                    let sel = select(sc, &keys, i, ctx, qsa);
                    self.trace.record(s, ctx - 1, || sel.clone());
                    // Only the selected K/V rows are read.
                    read.fetch_add(sel.len() as u64, Ordering::Relaxed);
                    let (kr, vr) = gather_host(pool, s, &sel, (geo.block_size, geo.row));
                    let rows = i * width..(i + 1) * width;
                    ops::attend_rows(&p.q[rows.clone()], &p.gate[rows], &kr, &vr, &heads, o);
                });
                out
            })
            .collect();
        (outs, read.into_inner())
    }

    /// Attends a decode-shaped step (one row a sequence) reading the selected K/V rows through the
    /// layer's row cache: the same arithmetic as [`Attend::over_pool`] on the same values.
    fn through_cache(&self, cache: &mut RowCache<f32>, pool: &KvPool) -> (Vec<Vec<f32>>, RowReads) {
        let (qsa, heads, geo) = (self.qsa, self.heads, self.geo);
        // Per sequence: its selected positions, and whether that is every position (dense).
        let picks: Vec<Vec<usize>> = self
            .seqs
            .par_iter()
            .zip(self.scans)
            .map(|(s, sc)| {
                let ctx = s.pos0 + 1;
                let sel = if ctx <= qsa.topk {
                    (0..ctx).collect()
                } else {
                    select(sc, &geo.index_keys(pool, s, ctx, qsa.head_dim), 0, ctx, qsa)
                };
                self.trace.record(s, ctx - 1, || sel.clone());
                sel
            })
            .collect();
        let (gathered, reads) =
            gather_cached(cache, pool, self.seqs, &picks, (geo.block_size, geo.row));
        let outs = self
            .seqs
            .par_iter()
            .zip(self.prepared)
            .zip(&gathered)
            .map(|((s, p), (kr, vr))| {
                let ctx = s.pos0 + 1;
                if ctx <= qsa.topk {
                    return attend_gathered(kr, vr, s, p, heads);
                }
                let mut out = vec![0f32; heads.hq * heads.d];
                ops::attend_rows(&p.q, &p.gate, kr, vr, &heads, &mut out);
                out
            })
            .collect();
        (outs, reads)
    }
}

impl CpuBackend {
    pub(super) fn qsa_impl(&self, c: &QsaCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        const OP: &str = "qsa_attention";
        check(OP, c)?;
        let (a, qsa) = (&c.attn, c.qsa);
        let (layer, seqs) = (a.layer, a.seqs);
        // 1. Per sequence: the indexer's queries, keys and head weights; then the prologue of
        //    gated attention, which writes K, V and the index-key entries into the blocks.
        let (entries, scans): (Vec<Vec<u8>>, Vec<Scan>) =
            seqs.par_iter().map(|s| index(s, c)).unzip();
        let index = IndexEntries {
            width: qsa.head_dim + 2,
            entries: &entries,
        };
        let (prepared, mut guard) = self.attention_prologue(OP, a, Some(index))?;
        let pools: &mut Pools = &mut guard;
        let geo = Geo {
            block_size: pools.block_size,
            row: pools.row,
            idx_row: pools.idx_row,
        };
        let offloaded = pools.host.is_some();
        let trace = Trace {
            on: self.qsa_trace.lock().unwrap().is_some(),
            layer,
            rows: Mutex::new(Vec::new()),
        };
        let attend = Attend {
            qsa,
            heads: heads(a),
            trace: &trace,
            seqs,
            prepared: &prepared,
            scans: &scans,
            geo,
        };
        // 2. The row cache forgets the slots just stored (every step, whatever its shape).
        let mut cache = pools.host.as_mut().and_then(|h| h.cache_mut(layer));
        if let Some(cache) = cache.as_deref_mut() {
            cache.invalidate(&stored_slots(seqs, geo.block_size));
        }
        // 3. Attend: a decode-shaped step through the row cache, any other from the pool.
        let (outs, reads) = match cache.filter(|_| cached_step(seqs)) {
            Some(cache) => {
                let pool = pools.layers.get(&layer).ok_or_else(|| no_pool(OP, layer))?;
                attend.through_cache(cache, pool)
            }
            None => {
                let pools: &Pools = pools;
                let (outs, direct) = attend.over_pool(pools, pools.layer(OP, layer)?);
                let reads = RowReads {
                    direct,
                    ..RowReads::default()
                };
                (outs, reads)
            }
        };
        let width = attend.heads.hq * attend.heads.d;
        if offloaded {
            self.count_host_reads(layer, reads, geo.row);
        }
        if trace.on {
            let mut recorded = trace.rows.into_inner().unwrap();
            recorded.sort_by_key(|r| (r.state, r.pos));
            if let Some(t) = self.qsa_trace.lock().unwrap().as_mut() {
                t.extend(recorded);
            }
        }
        Ok(Self::stack(seqs, width, outs))
    }
}

/// A pool's geometry: positions per block, values per K/V row, bytes per index-key entry.
#[derive(Debug, Clone, Copy)]
struct Geo {
    block_size: usize,
    row: usize,
    idx_row: usize,
}

impl Geo {
    /// Every index key of positions `0..len` of a sequence, dequantised (`[len, dI]`).
    fn index_keys(&self, pool: &KvPool, s: &SeqChunk<'_>, len: usize, di: usize) -> Vec<f32> {
        let mut keys = vec![0f32; len * di];
        for (pos, kd) in keys.chunks_exact_mut(di).enumerate() {
            let o = pool_offset(s.blocks, self.block_size, self.idx_row, pos);
            ops::dequantize_index_key(&pool.idx[o..o + self.idx_row], kd);
        }
        keys
    }
}
