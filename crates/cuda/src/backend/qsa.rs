//! QSA attention on the device (spec §2): the attention inputs as for gated attention (q/k norms and
//! RoPE, the K/V write), the index-key write into the layer's index pool, then the selection and the
//! attention over the selected rows only.
//!
//! A step of one-token chunks runs the batched decode form, whose launch shapes depend only on the
//! batch, the model shape and the span (see `graph`): the indexer scan over the span (blocks past a
//! sequence's context exit at once; a sequence whose context is at most topk is not scored), the
//! exact top-k (every position when the context is at most topk), and the attention over the
//! gathered selected rows (splits covering topk), each sequence's context and block table read from
//! the step metadata on the device. Such steps can be recorded into CUDA graphs. Other steps run per
//! sequence: the dense paged prefill kernel while its context fits topk, else the scan, the top-k and
//! the gathered attention over groups of its query rows.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
use half::bf16;
use sanmai_model::backend::{AttnCall, BackendError, OpResult, QsaCall, SeqChunk, MAX_CACHED_ROWS};

use super::attn::{attn_dims, Prepared};
use super::cache::{Arena, QsaPick};
use super::host_rows::Rows;
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend, State};
use crate::error::{CudaError, Result};
use crate::ops::{
    AttnDims, ChunkRows, IndexCache, IndexHeads, IndexProj, IndexQueries, KeyNorm, KvPools,
    PagedCache, Queries, RopeArgs, ScoreRows, Selection, SeqKv, StagingArena,
};
use crate::Gpu;

/// Epsilon of the indexer's key LayerNorm.
pub(super) const INDEX_NORM_EPS: f32 = 1e-6;
/// Score scratch per group of query rows, in f32 values (128 MiB).
const SCORE_BUDGET: usize = 32 << 20;
/// Query rows per score / select / attend launch at most (the grid's y limit).
const MAX_GROUP_ROWS: usize = 65535;

/// Refuses explicit MRoPE positions (images in a prompt) in QSA attention, as the CPU backend
/// does: its indexer's keys are turned at the sequence positions, with no MRoPE. Dense attention
/// takes them (`attn.rs`).
pub(super) fn refuse_mrope(
    op: &'static str,
    c: &AttnCall<'_, CudaTensor, CudaWeight>,
) -> OpResult<()> {
    match c.mrope {
        None => Ok(()),
        Some(_) => Err(BackendError::invalid(
            op,
            "explicit MRoPE positions (image tokens) are not supported by QSA attention: \
             its indexer's keys have no MRoPE",
        )),
    }
}

impl CudaBackend {
    /// Starts (`true`) or stops recording QSA selections (each query row's selected positions; a
    /// device synchronisation per QSA call while on, so decode steps run eagerly, unrecorded: for
    /// tests and diagnostics).
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

    pub(crate) fn qsa_impl(&self, c: &QsaCall<'_, CudaTensor, CudaWeight>) -> Result<CudaTensor> {
        let (iq, ik, iw) = (c.iq, c.ik, c.iw);
        let (ni, di) = (c.qsa.n_heads, c.qsa.head_dim);
        let rows = c.attn.q_gate.rows;
        let bad = |msg: String| CudaError::Shape {
            op: "qsa_attention",
            msg,
        };
        if iq.cols != ni * di || ik.cols != di || iw.cols != ni {
            return Err(bad(format!(
                "iq {} / ik {} / iw {} columns do not match {ni} indexer heads of {di}",
                iq.cols, ik.cols, iw.cols
            )));
        }
        if [iq.rows, ik.rows, iw.rows].iter().any(|&r| r != rows) {
            return Err(bad("the inputs differ in rows".into()));
        }
        let mut st = self.lock();
        let st = &mut *st;
        // The arena is lent to this call (and returned whatever it answers), so the K/V pools it
        // stages rows from stay borrowed alongside it.
        let mut arena = st.kv.arena.take();
        let res = self.qsa_locked(st, c, arena.as_mut());
        st.kv.arena = arena;
        res
    }

    fn qsa_locked(
        &self,
        st: &mut State,
        c: &QsaCall<'_, CudaTensor, CudaWeight>,
        arena: Option<&mut Arena>,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (attn, qsa) = (&c.attn, c.qsa);
        let (nh, d, layer, seqs) = (
            attn.shape.num_heads,
            attn.shape.head_dim,
            attn.layer,
            attn.seqs,
        );
        let (iq, ik, iw) = (c.iq, c.ik, c.iw);
        let (ni, di, topk) = (qsa.n_heads, qsa.head_dim, qsa.topk.max(1));
        let rows = attn.q_gate.rows;
        let bad = |msg: String| CudaError::Shape {
            op: "qsa_attention",
            msg,
        };
        if st.kv.idx_row != di + 2 {
            return Err(bad(format!(
                "the cache has no index keys of width dI = {di}: init_cache with index_head_dim"
            )));
        }
        // 1. q (normed, roped), gate and the normed, roped k, as the dense attention; 2. K, V and the
        // index-key entries into the sequences' blocks.
        let Prepared { q, gate, meta: m } = self.attn_prologue(st, attn, "qsa_attention")?;
        let bs = st.kv.block_size;
        let tracing = st.kv.qsa_trace.is_some();
        let qi_rope = st.rope_table(g, &qsa.rope.inv_freq)?;
        let index_freq = &st.rope[qi_rope].1;
        let positions = st.meta.view(m.positions, rows);
        let kv_dst = st.meta.view(m.kv_dst, rows);
        let index_rope = RopeArgs {
            positions: &positions,
            inv_freq: index_freq,
            rot_dim: qsa.rope.rot_dim,
            mscale: 1.0,
        };
        let pool = st.kv.pool_mut(layer)?;
        let idx = pool
            .idx
            .as_mut()
            .ok_or_else(|| bad(format!("layer {layer} has no index-key pool")))?;
        let norm = KeyNorm {
            w: c.indexer.k_norm.bf16()?,
            b: c.indexer.k_norm_bias.bf16()?,
            eps: INDEX_NORM_EPS,
            dim: di,
        };
        g.qsa_index_key_write(&ik.buf, &norm, &index_rope, &kv_dst, idx, rows)?;
        // Every store leaves the layer's row cache (the K/V write above is ordered before it).
        let mut arena = arena;
        if let Some(a) = arena.as_deref_mut() {
            a.topk = topk;
            a.with_cache(layer, |rc| g.qsa_rc_invalidate(rc, &kv_dst, rows))
                .transpose()?;
        }
        let pool = &*pool;
        let idx = pool
            .idx
            .as_ref()
            .ok_or_else(|| bad(format!("layer {layer} has no index-key pool")))?;
        // 3. The indexer queries (roped) and head weights of every row.
        let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
        let mut qi = self.scratch::<f32>(rows * ni * di)?;
        let mut wts = self.scratch::<f32>(rows * ni)?;
        let proj = IndexProj {
            iq: &iq.buf,
            iw: &iw.buf,
            rows,
        };
        let heads = IndexHeads {
            n_heads: ni,
            head_dim: di,
        };
        g.qsa_query_prep(&proj, &index_rope, heads, head_scale, &mut qi, &mut wts)?;
        let tables = st.meta.view(m.tables, m.n_seq * m.stride);
        let x = Select {
            layer,
            dims: attn_dims(attn.shape, bs),
            ni,
            di,
            topk,
            q: &q.buf,
            gate: &gate.buf,
            qi: &qi,
            wts: &wts,
            k: &pool.k,
            v: &pool.v,
            idx,
            tables: &tables,
            stride: m.stride,
        };
        let mut out = self.zeros(rows, nh * d)?;
        // 4. Select and attend: batched for a decode step, else per sequence.
        let trace = if all_decode(seqs) {
            let longest = seqs.iter().map(|s| s.pos0 + 1).max().unwrap_or(1);
            let ld = st.decode_span.map_or(longest, |span| span.max(longest));
            let lens = st.meta.view(m.lens, m.n_seq);
            // Decode-shaped steps read through the layer's row cache, when it has one; other
            // steps read each sequence's selected rows (its context up to topk) from host memory.
            let on_host = x.k.on_host();
            let use_cache = arena
                .as_deref()
                .is_some_and(|a| on_host && seqs.len() <= MAX_CACHED_ROWS && !a.caches.is_empty());
            if let Some(a) = arena.as_deref_mut().filter(|_| on_host && !use_cache) {
                a.host_rows += seqs
                    .iter()
                    .map(|s| (s.pos0 + 1).min(topk) as u64)
                    .sum::<u64>();
            }
            let cached = arena.filter(|_| use_cache);
            let (sel, counts) = self.qsa_decode(&x, &lens, ld, &mut out, seqs.len(), cached)?;
            if tracing {
                self.decode_trace(layer, seqs, topk, &sel, &counts)?
            } else {
                Vec::new()
            }
        } else {
            self.qsa_chunks(&x, seqs, &mut out, tracing, arena)?
        };
        if let Some(t) = st.kv.qsa_trace.as_mut() {
            t.extend(trace);
        }
        Ok(out)
    }

    /// The batched decode form over `n` sequences of one query each (row `r` = sequence `r`, context
    /// `lens[r]`): the scan over `ld` positions a row (at least every context), the top-k, the
    /// gathered attention into `out`. Returns the selections `(sel [n, topk], counts [n])`.
    /// With an `arena` whose caches hold the layer, the rows are read through its row cache; else
    /// from the pools (counted in the arena's host reads when there is one).
    fn qsa_decode(
        &self,
        x: &Select<'_>,
        lens: &CudaView<'_, u32>,
        ld: usize,
        out: &mut CudaTensor,
        n: usize,
        arena: Option<&mut Arena>,
    ) -> Result<(CudaSlice<u32>, CudaSlice<u32>)> {
        let g = &self.gpu;
        let topk = x.topk;
        let mut scores = self.scratch::<f32>(n * ld)?;
        let mut sel = self.scratch::<u32>(n * topk)?;
        let mut counts = self.scratch::<u32>(n)?;
        let queries = IndexQueries {
            qi: x.qi,
            wts: x.wts,
            heads: x.heads(),
            rows: n,
        };
        g.qsa_scores_decode(
            &queries,
            &x.index_cache(x.tables, x.stride),
            lens,
            topk,
            &mut scores,
            ld,
        )?;
        let rows = ScoreRows {
            scores: &scores,
            ld,
            rows: n,
        };
        let mut work = self.scratch::<u32>(Gpu::qsa_topk_decode_work(n, ld))?;
        g.qsa_topk_decode(&rows, lens, topk, (&mut sel, &mut counts), &mut work)?;
        let selection = Selection {
            sel: &sel,
            stride: topk,
            counts: &counts,
            max_count: topk,
            rows: n,
        };
        let queries = Queries {
            q: x.q,
            gate: x.gate,
        };
        let cache = x.cache(x.tables, x.stride);
        let bs = x.dims.block_size;
        let cached = arena.and_then(|a| {
            a.with_cache(x.layer, |rc| {
                g.qsa_rc_plan(rc, &selection, x.tables, x.stride, bs)?;
                g.qsa_attention_gather_decode_cached(
                    x.dims,
                    &queries,
                    &cache,
                    &selection,
                    rc,
                    &mut out.buf,
                )
            })
        });
        match cached {
            Some(done) => done?,
            None => {
                g.qsa_attention_gather_decode(x.dims, &queries, &cache, &selection, &mut out.buf)?
            }
        }
        Ok((sel, counts))
    }

    /// The selections of a decode step on the host (a device synchronisation).
    fn decode_trace(
        &self,
        layer: usize,
        seqs: &[SeqChunk<'_>],
        topk: usize,
        sel: &CudaSlice<u32>,
        counts: &CudaSlice<u32>,
    ) -> Result<Vec<QsaPick>> {
        let sel = self.gpu.download(sel)?;
        let counts = self.gpu.download(counts)?;
        Ok(seqs
            .iter()
            .enumerate()
            .map(|(r, s)| {
                let c = counts[r] as usize;
                let picked = sel[r * topk..r * topk + c]
                    .iter()
                    .map(|&p| p as usize)
                    .collect();
                (layer, s.state, s.pos0, picked)
            })
            .collect())
    }

    /// Per sequence: the dense paged prefill kernel while its context fits topk, else the scan, the
    /// top-k and the gathered attention over groups of its query rows. With the K/V rows in host
    /// memory and an `arena`, a sequence whose context fits the arena has its rows staged there first
    /// and read from VRAM (the same kernels through the identity table: the same arithmetic).
    /// Returns the selections when `tracing`.
    fn qsa_chunks(
        &self,
        x: &Select<'_>,
        seqs: &[SeqChunk<'_>],
        out: &mut CudaTensor,
        tracing: bool,
        mut arena: Option<&mut Arena>,
    ) -> Result<Vec<QsaPick>> {
        let g = &self.gpu;
        let bs = x.dims.block_size;
        let group = x.dims.hq / x.dims.hkv.max(1);
        let mut trace = Vec::new();
        let mut staged_any = false;
        for (i, s) in seqs.iter().enumerate().filter(|(_, s)| s.len > 0) {
            let ctx = s.pos0 + s.len;
            let nb = ctx.div_ceil(bs.max(1));
            let table = x.tables.slice(i * x.stride..i * x.stride + nb);
            let on_host = x.k.on_host();
            // Staging copies the context's rows once; reading in place reads each query row's
            // selected rows once a query head: stage when that reads more.
            let stage = on_host && s.len * ctx.min(x.topk) * group > ctx;
            match arena.as_deref_mut().filter(|a| stage && ctx <= a.rows) {
                Some(a) => {
                    staged_any = true;
                    a.host_rows += ctx as u64;
                    let pools = KvPools { k: x.k, v: x.v };
                    let staged = KvPools {
                        k: Some(&mut a.k),
                        v: Some(&mut a.v),
                    };
                    g.kv_stage(
                        pools,
                        &table,
                        bs,
                        0..ctx,
                        x.dims.hkv * x.dims.head_dim,
                        staged,
                    )?;
                    let cache = PagedCache {
                        pools: KvPools { k: &a.k, v: &a.v },
                        tables: &a.table,
                        stride: 0,
                    };
                    let to = ChunkOut {
                        out,
                        trace: tracing.then_some(&mut trace),
                    };
                    self.qsa_chunk(x, s, &table, &cache, None, to)?;
                }
                None => {
                    // Past the arena (and past topk, so the gathered form runs): the context in
                    // sections of it, each row staged once; else every selected row read in place.
                    let in_sections =
                        stage && ctx > x.topk && arena.as_deref().is_some_and(|a| a.rows > 0);
                    if let Some(a) = arena.as_deref_mut().filter(|_| on_host) {
                        a.host_rows += match in_sections {
                            true => ctx as u64,
                            // Each query row reads its selected rows (all its context up to topk).
                            false => (s.pos0..ctx).map(|p| (p + 1).min(x.topk) as u64).sum(),
                        };
                    }
                    staged_any |= in_sections;
                    let sectioned = arena.as_deref_mut().filter(|_| in_sections);
                    let cache = x.cache(&table, 0);
                    let to = ChunkOut {
                        out,
                        trace: tracing.then_some(&mut trace),
                    };
                    self.qsa_chunk(x, s, &table, &cache, sectioned, to)?;
                }
            }
        }
        // The staging overwrote the rows the layers' caches held.
        if staged_any {
            if let Some(a) = arena {
                a.each_cache(|rc| g.qsa_rc_invalidate_all(rc))?;
            }
        }
        Ok(trace)
    }

    /// One sequence's chunk of [`CudaBackend::qsa_chunks`]: the index keys through its block
    /// `table`, the K/V rows through `cache`; its selections go to `trace` when given.
    fn qsa_chunk<K: DevicePtr<bf16>, T: DevicePtr<u32>>(
        &self,
        x: &Select<'_>,
        s: &SeqChunk<'_>,
        table: &CudaView<'_, u32>,
        cache: &PagedCache<'_, K, T>,
        mut sections: Option<&mut Arena>,
        to: ChunkOut<'_>,
    ) -> Result<()> {
        let ChunkOut { out, mut trace } = to;
        let g = &self.gpu;
        let (layer, ni, di, topk) = (x.layer, x.ni, x.di, x.topk);
        let qr = x.dims.hq * x.dims.head_dim;
        if s.pos0 + s.len <= topk {
            let (a, b) = (s.start * qr, (s.start + s.len) * qr);
            let queries = Queries {
                q: &x.q.slice(a..b),
                gate: &x.gate.slice(a..b),
            };
            let chunk = ChunkRows {
                pos0: s.pos0,
                t: s.len,
            };
            g.attention_paged_prefill(
                x.dims,
                &queries,
                cache,
                chunk,
                &mut out.buf.slice_mut(a..b),
            )?;
            if let Some(t) = trace {
                for p in s.pos0..s.pos0 + s.len {
                    t.push((layer, s.state, p, (0..=p).collect()));
                }
            }
            return Ok(());
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
            let queries = IndexQueries {
                qi: &x.qi.slice(r0 * ni * di..(r0 + n) * ni * di),
                wts: &x.wts.slice(r0 * ni..(r0 + n) * ni),
                heads: x.heads(),
                rows: n,
            };
            g.qsa_scores(&queries, &x.index_cache(table, 0), p0, &mut scores, ld)?;
            let rows = ScoreRows {
                scores: &scores,
                ld,
                rows: n,
            };
            g.qsa_topk(&rows, p0, topk, &mut sel, &mut counts)?;
            let (qa, qb) = (r0 * qr, (r0 + n) * qr);
            let queries = Queries {
                q: &x.q.slice(qa..qb),
                gate: &x.gate.slice(qa..qb),
            };
            let selection = Selection {
                sel: &sel,
                stride: topk,
                counts: &counts,
                max_count: topk.min(ld),
                rows: n,
            };
            let mut rows_out = out.buf.slice_mut(qa..qb);
            match sections.as_deref_mut() {
                // The context in sections of the arena (the same arithmetic, in passes).
                Some(a) => {
                    let kv = SeqKv {
                        pools: KvPools { k: x.k, v: x.v },
                        table,
                        context: ctx_all,
                    };
                    let mut arena = StagingArena {
                        k: &mut a.k,
                        v: &mut a.v,
                        rows: a.rows,
                    };
                    g.qsa_attention_gather_staged(
                        x.dims,
                        &queries,
                        &kv,
                        &selection,
                        &mut arena,
                        &mut rows_out,
                    )?
                }
                None => {
                    g.qsa_attention_gather(x.dims, &queries, cache, &selection, &mut rows_out)?
                }
            }
            if let Some(t) = trace.as_deref_mut() {
                let sel = g.download(&sel)?;
                let counts = g.download(&counts)?;
                for (j, &c) in counts.iter().take(n).enumerate() {
                    let picked = sel[j * topk..j * topk + c as usize]
                        .iter()
                        .map(|&x| x as usize)
                        .collect();
                    t.push((layer, s.state, p0 + j, picked));
                }
            }
            a += n;
        }
        Ok(())
    }
}

/// Where one sequence's chunk of QSA attention goes: its rows of the call's output, and its
/// selections when traced.
struct ChunkOut<'o> {
    out: &'o mut CudaTensor,
    trace: Option<&'o mut Vec<QsaPick>>,
}

/// What the selection and the attention of one QSA call read: the attention shape, the indexer's
/// heads and topk, q and gate `[rows, hq·d]`, the indexer queries and head weights (f32), the layer's
/// K/V and index-key pools, and the step's block tables (`stride` ids a sequence).
struct Select<'a> {
    layer: usize,
    dims: AttnDims,
    ni: usize,
    di: usize,
    topk: usize,
    q: &'a CudaSlice<bf16>,
    gate: &'a CudaSlice<bf16>,
    qi: &'a CudaSlice<f32>,
    wts: &'a CudaSlice<f32>,
    k: &'a Rows,
    v: &'a Rows,
    idx: &'a CudaSlice<u8>,
    tables: &'a CudaView<'a, u32>,
    stride: usize,
}

impl<'a> Select<'a> {
    fn heads(&self) -> IndexHeads {
        IndexHeads {
            n_heads: self.ni,
            head_dim: self.di,
        }
    }

    /// The layer's index-key pool read through `tables` (`stride` ids a row; 0: one table).
    fn index_cache<'t, T: DevicePtr<u32>>(
        &self,
        tables: &'t T,
        stride: usize,
    ) -> IndexCache<'t, CudaSlice<u8>, T>
    where
        'a: 't,
    {
        IndexCache {
            pool: self.idx,
            tables,
            stride,
            block_size: self.dims.block_size,
        }
    }

    /// The layer's K/V pools read through `tables` (`stride` ids a row; 0: one table).
    fn cache<'t, T: DevicePtr<u32>>(&self, tables: &'t T, stride: usize) -> PagedCache<'t, Rows, T>
    where
        'a: 't,
    {
        PagedCache {
            pools: KvPools {
                k: self.k,
                v: self.v,
            },
            tables,
            stride,
        }
    }
}
