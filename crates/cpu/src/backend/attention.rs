//! Gated attention ([`Backend::attention`](sanmai_model::Backend::attention)), and the prologue it
//! shares with QSA attention (`qsa.rs`): the `[q | gate]` split, the zero-centred q/k norms, RoPE,
//! and the write of the step's K/V rows into the sequences' blocks.

use std::sync::RwLockWriteGuard;

use rayon::prelude::*;
use sanmai_model::backend::{AttnCall, OpResult, SeqChunk};

use super::cache::{gather, Pools};
use super::rows::{pool_offset, KvPool};
use super::{ensure, step_rows, CpuBackend, CpuTensor, CpuWeight};
use crate::ops::{self, Causal, Heads};

/// One sequence's attention inputs after the prologue, `[len, heads·head_dim]` each: the query
/// heads and gates split from the `[q | gate]` rows, the queries and keys normed and roped.
pub(super) struct Prepared {
    pub(super) q: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) k: Vec<f32>,
}

/// Index-key entries to write with the K/V: `entries[i]` holds sequence `i`'s `[len, width]` bytes.
pub(super) struct IndexEntries<'a> {
    pub(super) width: usize,
    pub(super) entries: &'a [Vec<u8>],
}

/// The heads of a call's shape, scores scaled by `head_dim^-0.5`.
pub(super) fn heads(c: &AttnCall<'_, CpuTensor, CpuWeight>) -> Heads {
    let d = c.shape.head_dim;
    Heads {
        hq: c.shape.num_heads,
        hkv: c.shape.num_kv_heads,
        d,
        scale: (d as f32).powf(-0.5),
    }
}

/// One sequence's split, norms and RoPE.
fn prepare(s: &SeqChunk<'_>, c: &AttnCall<'_, CpuTensor, CpuWeight>) -> Prepared {
    let (sh, rope) = (c.shape, c.rope);
    let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
    let t = s.len;
    let mut q = vec![0f32; t * nh * d];
    let mut gate = vec![0f32; t * nh * d];
    for (r, row) in c
        .q_gate
        .row_range(s.start, t)
        .chunks_exact(2 * nh * d)
        .enumerate()
    {
        for h in 0..nh {
            let src = &row[h * 2 * d..(h + 1) * 2 * d];
            q[(r * nh + h) * d..(r * nh + h + 1) * d].copy_from_slice(&src[..d]);
            gate[(r * nh + h) * d..(r * nh + h + 1) * d].copy_from_slice(&src[d..]);
        }
    }
    let mut k = c.k.row_range(s.start, t).to_vec();
    ops::rms_norm(&mut q, &c.w.q_norm.data, d, sh.eps, 1.0);
    ops::rms_norm(&mut k, &c.w.k_norm.data, d, sh.eps, 1.0);
    let (rot, freq, mscale) = (rope.rot_dim, &rope.inv_freq, rope.mscale);
    match c.mrope {
        None => {
            let positions: Vec<u32> = (s.pos0..s.pos0 + t).map(|p| p as u32).collect();
            ops::rope_neox(&mut q, nh, d, rot, &positions, freq, mscale);
            ops::rope_neox(&mut k, nkv, d, rot, &positions, freq, mscale);
        }
        Some(m) => {
            let p = ops::MropePositions {
                positions: &m.positions[s.start..s.start + t],
                sections: &m.sections,
            };
            ops::rope_mrope_interleaved(&mut q, nh, d, rot, p, freq, mscale);
            ops::rope_mrope_interleaved(&mut k, nkv, d, rot, p, freq, mscale);
        }
    }
    Prepared { q, gate, k }
}

/// `Err` unless the call's tensors, weights and rotary table fit its shape and the step.
fn check(op: &'static str, c: &AttnCall<'_, CpuTensor, CpuWeight>) -> OpResult<()> {
    let sh = c.shape;
    let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
    ensure(nkv > 0 && d > 0 && nh.is_multiple_of(nkv), op, || {
        format!("{nh} query heads over {nkv} KV heads of width {d}")
    })?;
    c.q_gate.check_step(op, "q|gate", 2 * nh * d, c.seqs)?;
    c.k.check_step(op, "k", nkv * d, c.seqs)?;
    c.v.check_step(op, "v", nkv * d, c.seqs)?;
    ensure(
        c.w.q_norm.data.len() == d && c.w.k_norm.data.len() == d,
        op,
        || {
            format!(
                "q/k norms of {} and {} values for heads of {d}",
                c.w.q_norm.data.len(),
                c.w.k_norm.data.len()
            )
        },
    )?;
    let r = c.rope;
    ensure(
        r.rot_dim.is_multiple_of(2) && r.rot_dim <= d && r.inv_freq.len() == r.rot_dim / 2,
        op,
        || {
            format!(
                "RoPE over {} dims with {} frequencies for heads of {d}",
                r.rot_dim,
                r.inv_freq.len()
            )
        },
    )?;
    if let Some(m) = &c.mrope {
        let rows = step_rows(c.seqs);
        ensure(m.positions.len() >= rows, op, || {
            format!(
                "{} MRoPE positions, the step's chunks cover {rows} rows",
                m.positions.len()
            )
        })?;
        ensure(
            m.sections.iter().sum::<usize>() == r.rot_dim / 2,
            op,
            || {
                format!(
                    "MRoPE sections {:?} for {} rotary frequencies",
                    m.sections,
                    r.rot_dim / 2
                )
            },
        )?;
    }
    Ok(())
}

impl CpuBackend {
    /// The prologue of dense and QSA attention: checks the call, prepares every sequence (in
    /// parallel, no shared state), then writes each sequence's new K and V rows (and `index`'s
    /// entries, for QSA) into layer `c.layer`'s blocks. Nothing is written unless the whole call
    /// fits. Returns the prepared inputs and the pools, still locked for the attend phase.
    pub(super) fn attention_prologue(
        &self,
        op: &'static str,
        c: &AttnCall<'_, CpuTensor, CpuWeight>,
        index: Option<IndexEntries<'_>>,
    ) -> OpResult<(Vec<Prepared>, RwLockWriteGuard<'_, Pools>)> {
        check(op, c)?;
        let prepared: Vec<Prepared> = c.seqs.par_iter().map(|s| prepare(s, c)).collect();
        let mut pools = self.pools.write().unwrap();
        let (bs, row, irow) = (pools.block_size, pools.row, pools.idx_row);
        let kv = c.shape.num_kv_heads * c.shape.head_dim;
        ensure(row == kv, op, || {
            format!("the cache's K/V rows are {row} wide, the layer's {kv}")
        })?;
        if let Some(ix) = &index {
            ensure(irow == ix.width, op, || {
                format!(
                    "the cache's index-key entries are {irow} bytes, the layer's {}",
                    ix.width
                )
            })?;
        }
        pools.check_blocks(op, c.seqs)?;
        let pool: &mut KvPool = pools.layer_mut(op, c.layer)?;
        for (i, (s, p)) in c.seqs.iter().zip(&prepared).enumerate() {
            let vs = c.v.row_range(s.start, s.len);
            for j in 0..s.len {
                let o = pool_offset(s.blocks, bs, row, s.pos0 + j);
                pool.k[o..o + row].copy_from_slice(&p.k[j * row..(j + 1) * row]);
                pool.v[o..o + row].copy_from_slice(&vs[j * row..(j + 1) * row]);
                if let Some(ix) = &index {
                    let oi = pool_offset(s.blocks, bs, irow, s.pos0 + j);
                    pool.idx[oi..oi + irow]
                        .copy_from_slice(&ix.entries[i][j * irow..(j + 1) * irow]);
                }
            }
        }
        Ok((prepared, pools))
    }

    pub(super) fn attention_impl(
        &self,
        c: &AttnCall<'_, CpuTensor, CpuWeight>,
    ) -> OpResult<CpuTensor> {
        let (prepared, guard) = self.attention_prologue("attention", c, None)?;
        let pools: &Pools = &guard;
        let pool = pools.layer("attention", c.layer)?;
        let heads = heads(c);
        // Attend over positions 0..pos0 + len, in parallel across sequences.
        let outs: Vec<Vec<f32>> = c
            .seqs
            .par_iter()
            .zip(&prepared)
            .map(|(s, p)| attend_all(pools, pool, s, p, heads))
            .collect();
        Ok(Self::stack(c.seqs, heads.hq * heads.d, outs))
    }
}

/// One sequence's gated attention over every position `0..pos0 + len` of its blocks:
/// `attention_causal` of the prepared queries, times `sigmoid(gate)`; `[len, hq·d]`.
pub(super) fn attend_all(
    pools: &Pools,
    pool: &KvPool,
    s: &SeqChunk<'_>,
    p: &Prepared,
    heads: Heads,
) -> Vec<f32> {
    let (bs, row) = (pools.block_size, pools.row);
    let len = s.pos0 + s.len;
    let kc = gather(&pool.k, s.blocks, bs, row, len);
    let vc = gather(&pool.v, s.blocks, bs, row, len);
    attend_gathered(&kc, &vc, s, p, heads)
}

/// [`attend_all`] over the sequence's K and V rows of positions `0..pos0 + len` already gathered
/// (`[pos0 + len, kv_heads·d]` each): the same arithmetic on the same values.
pub(super) fn attend_gathered(
    kc: &[f32],
    vc: &[f32],
    s: &SeqChunk<'_>,
    p: &Prepared,
    heads: Heads,
) -> Vec<f32> {
    let mut out = vec![0f32; s.len * heads.hq * heads.d];
    let causal = Causal {
        t: s.len,
        len: s.pos0 + s.len,
        heads,
    };
    ops::attention_causal(&p.q, kc, vc, &causal, &mut out);
    out.iter_mut()
        .zip(&p.gate)
        .for_each(|(o, g)| *o *= ops::sigmoid(*g));
    out
}
