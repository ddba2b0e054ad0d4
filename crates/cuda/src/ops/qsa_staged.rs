//! QSA's gathered attention over a context longer than the VRAM arena (`kernels/qsa_staged.cu`): one
//! sequence's K/V rows live in pools the device reads slowly (pinned host memory through unified
//! addressing), and only `arena.rows` positions at a time fit the arena they are staged into with
//! [`Gpu::kv_stage`]. The attention runs in sections of positions `[a, b)` (ascending, each staged to
//! arena rows `0..b − a`), and its output is byte for byte [`Gpu::qsa_attention_gather`]'s over the
//! pools.
//!
//! # Why the bytes are the same
//!
//! `qsa_attn_partial` (`kernels/qsa.cu`, without the row cache) runs a block of 128 threads per (group
//! of the query heads of one KV head, span `sp` of `QSA_SPLIT` selection entries, query row `r`), and
//! computes each head `h` of its group as a block serving `h` alone would, in three phases: (1) each
//! entry's score by a warp (lane-strided dot of the f32 query with the K row, `warp_sum`, `× scale`);
//! (2) `m = block_max` of the span's scores, `e_j = exp(sc_j − m)` (0 for −inf) and `l = block_sum(e)`,
//! whose reduction orders depend only on the block size and the entry count; (3) thread `i`:
//! `acc = Σ e_j · v_j[i]` over the span's entries in ascending `j`, skipping `e_j == 0`, to `part_o`,
//! and `(m, l)` to `part_ml`. `qsa_attn_reduce` then merges the spans. Each phase's result for an
//! entry depends only on that entry's bytes (1), on all of the span's scores (2), or on a chain of
//! multiply-adds in `j` order (3). So, with the same block size and the same expressions:
//!
//! - pass A (per section, the arena holding its K rows): the score of every entry whose position lies
//!   in the section, computed as in (1), stored to a score buffer `S` `[rows, hq, sel_stride]` f32;
//! - pass B (once, after every section): (2) over the scores loaded from `S`; `e_j` back into `S`,
//!   `(m, l)` to `part_ml`;
//! - pass C (per section in ascending order, the arena holding its V rows): each thread continues its
//!   accumulator (0 in the first section, else the f32 it stored in `part_o`) over the section's
//!   entries in ascending `j` with the expression of (3).
//!
//! Positions ascend along a row's selection, so a section's entries of a span are a contiguous run
//! of `j`, and the sections in ascending order visit every entry in the kernel's order. f32 stores
//! and loads are exact, so every rounding step is the kernel's. The unchanged `qsa_attn_reduce` then
//! merges `part_o` and `part_ml`.
//!
//! The K/V bytes cross the bus once each (every position of the context staged once for K and once
//! for V), instead of once per selecting query row and head group as the gathered kernel reads them
//! from host memory.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::qsa::{Selection, QSA_SPLIT};
use super::{AttnDims, KvPools, Queries};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, int, Gpu};

/// The largest head size (`QSA_MAX_D` in `qsa.cu` and `qsa_staged.cu`).
const QSA_STAGED_MAX_HEAD_DIM: usize = 256;
/// Threads of a block of every pass: the block size `qsa_attn_partial` is launched with (the
/// gathered attention's launcher in `ops/qsa.rs`), which fixes the order of its block reductions.
const PARTIAL_THREADS: u32 = 128;
/// Threads of a `qsa_attn_reduce` block (as the gathered attention launches it).
const REDUCE_THREADS: u32 = 128;
/// The hardware limit of grid dimensions y and z.
const GRID_YZ_MAX: usize = 65535;

/// One sequence's K/V rows as the staged attention reads them: positions `0..context` of `pools`
/// (`[num_blocks, block_size, hkv·head_dim]` bf16 each, in VRAM or host memory the device can
/// address), position `p` in block `table[p / block_size]` (the sequence's block table, at least
/// `context.div_ceil(block_size)` ids).
pub struct SeqKv<'a, K: DevicePtr<bf16>, T: DevicePtr<u32>> {
    pub pools: KvPools<&'a K>,
    pub table: &'a T,
    pub context: usize,
}

/// The VRAM arena the staged attention stages K and V rows into: `rows` positions of `hkv·head_dim`
/// values in each of `k` and `v` (the backend's `Arena`; its identity table is not needed). Their
/// contents are overwritten.
pub struct StagingArena<'a> {
    pub k: &'a mut CudaSlice<bf16>,
    pub v: &'a mut CudaSlice<bf16>,
    pub rows: usize,
}

/// The scalar arguments every pass shares.
struct PassArgs {
    sel_stride: i32,
    hq: i32,
    hkv: i32,
    d: i32,
    splits: i32,
    grid: (u32, u32, u32),
}

impl Gpu {
    /// [`Gpu::qsa_attention_gather`] of the `selection.rows` queries of one sequence over its K/V
    /// rows `kv`, staging `arena.rows` positions at a time into `arena` (sections of ascending
    /// positions: every K section, then every V section): `out = softmax(q·k·d^-0.5) v ·
    /// sigmoid(gate)` (`q`, `gate`, `out` `[rows, hq·d]`), byte for byte what
    /// `qsa_attention_gather` writes reading the pools through the table (the module docs say why).
    ///
    /// Every selected position must lie below `kv.context` (as [`Gpu::qsa_topk`]'s do: each below
    /// its row's context): a position at or past it is never staged and its entry's weight is not
    /// its score (the kernels read the arena only at staged rows, whatever the selection holds).
    /// Scratch: `rows·hq·sel_stride + rows·hq·splits·(d + 2)` f32 from the stream's pool.
    pub fn qsa_attention_gather_staged(
        &self,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        kv: &SeqKv<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        selection: &Selection<'_, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        arena: &mut StagingArena<'_>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "qsa_attention_gather_staged";
        let Selection {
            sel,
            stride: sel_stride,
            counts,
            max_count,
            rows: n_rows,
        } = *selection;
        let Queries { q, gate } = *queries;
        let SeqKv {
            pools,
            table,
            context,
        } = *kv;
        let (hq, hkv, d, bs) = (dims.hq, dims.hkv, dims.head_dim, dims.block_size);
        let row = hkv * d;
        ensure(hkv > 0 && hq.is_multiple_of(hkv), OP, || {
            format!("{hq} query heads are not a multiple of {hkv} KV heads")
        })?;
        ensure((1..=QSA_STAGED_MAX_HEAD_DIM).contains(&d), OP, || {
            format!("head_dim {d} must be in 1..={QSA_STAGED_MAX_HEAD_DIM}")
        })?;
        ensure(bs > 0, OP, || "block size must be positive".into())?;
        ensure(max_count <= sel_stride, OP, || {
            "max_count exceeds sel_stride".into()
        })?;
        ensure(arena.rows > 0, OP, || "the arena holds no row".into())?;
        check_len(OP, "q", q, n_rows * hq * d)?;
        check_len(OP, "gate", gate, n_rows * hq * d)?;
        check_len(OP, "out", out, n_rows * hq * d)?;
        check_len(OP, "sel", sel, n_rows * sel_stride)?;
        check_len(OP, "counts", counts, n_rows)?;
        check_len(OP, "table", table, context.div_ceil(bs))?;
        check_len(OP, "arena k", &*arena.k, arena.rows * row)?;
        check_len(OP, "arena v", &*arena.v, arena.rows * row)?;
        ensure(pools.k.len() == pools.v.len(), OP, || "pools differ".into())?;
        ensure(u32::try_from(context).is_ok(), OP, || {
            format!("context {context} past u32")
        })?;
        if n_rows == 0 {
            return Ok(());
        }
        ensure(n_rows <= GRID_YZ_MAX, OP, || {
            "too many rows in one call".into()
        })?;
        let splits = max_count.div_ceil(QSA_SPLIT).max(1);
        ensure(splits <= GRID_YZ_MAX, OP, || "too many splits".into())?;
        let args = PassArgs {
            sel_stride: int(OP, "sel_stride", sel_stride)?,
            hq: int(OP, "hq", hq)?,
            hkv: int(OP, "hkv", hkv)?,
            d: int(OP, "d", d)?,
            splits: int(OP, "splits", splits)?,
            grid: (hq as u32, splits as u32, n_rows as u32),
        };
        let slots = n_rows * hq * splits;
        let mut scores = self.stream().alloc_zeros::<f32>(n_rows * hq * sel_stride)?;
        let mut part_o = self.stream().alloc_zeros::<f32>(slots * d)?;
        let mut part_ml = self.stream().alloc_zeros::<f32>(slots * 2)?;
        // The sections: `arena.rows` positions each, ascending; one empty section for an empty
        // context (pass C's first section still writes every part_o).
        let sections: Vec<(u32, u32)> = (0..context.div_ceil(arena.rows).max(1))
            .map(|s| {
                let a = s * arena.rows;
                (a as u32, (a + arena.rows).min(context) as u32)
            })
            .collect();
        // Pass A: the scores, section by section (K rows staged).
        let scale = (d as f32).powf(-0.5);
        for &(a, b) in &sections {
            let staged = KvPools {
                k: Some(&mut *arena.k),
                v: None,
            };
            self.kv_stage(pools, table, bs, a as usize..b as usize, row, staged)?;
            let mut l = self.launch(self.kernel("qsa_staged_scores")?);
            l.ptr(q)
                .ptr(&*arena.k)
                .arg(&a)
                .arg(&b)
                .ptr(sel)
                .arg(&args.sel_stride)
                .ptr(counts)
                .ptr_mut(&mut scores)
                .arg(&args.hq)
                .arg(&args.hkv)
                .arg(&args.d)
                .arg(&scale);
            // SAFETY: argument types match the kernel; lengths checked above; the kernel reads the
            // arena only at rows p − a of positions p in [a, b), b − a ≤ arena.rows, and writes
            // scores at j < min(counts[r], sel_stride) of row (r, h).
            unsafe { l.launch(cfg(args.grid, PARTIAL_THREADS, 0)) }?;
        }
        // Pass B: the weights and the spans' (max, sum).
        let mut l = self.launch(self.kernel("qsa_staged_softmax")?);
        l.ptr(sel)
            .arg(&args.sel_stride)
            .ptr(counts)
            .ptr_mut(&mut scores)
            .ptr_mut(&mut part_ml)
            .arg(&args.hq)
            .arg(&args.splits);
        // SAFETY: as above; part_ml holds 2 values per (row, head, span).
        unsafe { l.launch(cfg(args.grid, PARTIAL_THREADS, 0)) }?;
        drop(l);
        // Pass C: the weighted V sums, section by section in ascending order (V rows staged).
        for (i, &(a, b)) in sections.iter().enumerate() {
            let staged = KvPools {
                k: None,
                v: Some(&mut *arena.v),
            };
            self.kv_stage(pools, table, bs, a as usize..b as usize, row, staged)?;
            let first = i32::from(i == 0);
            let mut l = self.launch(self.kernel("qsa_staged_values")?);
            l.ptr(&*arena.v)
                .arg(&a)
                .arg(&b)
                .ptr(sel)
                .arg(&args.sel_stride)
                .ptr(counts)
                .ptr(&scores)
                .ptr_mut(&mut part_o)
                .arg(&args.hq)
                .arg(&args.hkv)
                .arg(&args.d)
                .arg(&args.splits)
                .arg(&first);
            // SAFETY: as pass A; part_o holds d values per (row, head, span).
            unsafe { l.launch(cfg(args.grid, PARTIAL_THREADS, 0)) }?;
        }
        // The gathered attention's own merge of the spans (`kernels/qsa.cu`).
        let mut l = self.launch(self.kernel("qsa_attn_reduce")?);
        l.ptr(&part_o)
            .ptr(&part_ml)
            .ptr(gate)
            .ptr_mut(out)
            .arg(&args.hq)
            .arg(&args.d)
            .arg(&args.splits);
        // SAFETY: argument types match the kernel; part_o and part_ml hold every span's values,
        // gate and out n_rows·hq·d.
        unsafe { l.launch(cfg((hq as u32, n_rows as u32, 1), REDUCE_THREADS, 0)) }?;
        Ok(())
    }
}
