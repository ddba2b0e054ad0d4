//! QSA's lightning indexer and the attention over its selection (`kernels/qsa.cu`): the index-key
//! write (LayerNorm, RoPE, bf16 scale, fp8 e4m3), the indexer query preparation, the index scores over
//! the paged index-key pool, the exact top-k (ties to the larger position) and the gated attention
//! over the selected positions only.
//!
//! The index-key pool is `[num_blocks, block_size, dI + 2]` bytes (the CPU backend's layout). The
//! byte-, score- and selection-deciding arithmetic follows the CPU oracle's f32 operations in order,
//! so the fp8 bytes, the scores and the selected sets equal `sanmai_cpu::ops`'s on equal inputs.

use cudarc::driver::{result, CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::row_cache::RowCacheBufs;
use super::{AttnDims, KvPools, PagedCache, Queries, RopeArgs};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The largest indexer head size `dI` the kernels take.
pub const QSA_MAX_INDEX_DIM: usize = 256;
/// Selected positions per block of the gathered attention's partial kernel in its prefill form
/// (`QSA_SPLIT_WIDE` in qsa.cu, `qsa_attn_partial_wide`; `QSA_SPLIT` in qsa_staged.cu, whose passes
/// must equal it).
pub const QSA_SPLIT: usize = 256;
/// The same in the decode form (`QSA_SPLIT_DECODE`, `qsa_attn_partial`): a decode row's selection
/// spread over more blocks.
const QSA_SPLIT_DECODE: usize = 32;
/// Query heads (of one KV head) a block of `qsa_attn_partial` serves at most (`QSA_GROUP` in qsa.cu).
const QSA_GROUP: usize = 8;
/// The largest attention head size of the gathered attention.
const QSA_MAX_HEAD_DIM: usize = 256;
/// Largest `nI·dI + nI` floats of the score kernel's shared memory (48 KiB).
const SCORE_SMEM_FLOATS: usize = 12 * 1024;
const GRID_YZ_MAX: usize = 65535;
/// `u32` values of the wide top-k's per-row state (`WIDE_AUX` in `kernels/qsa_topk.cu`).
const WIDE_AUX: usize = 4096 + 8;
/// Positions a block of the wide top-k's passes covers, and its threads.
const WIDE_CHUNK: usize = 2048;
const WIDE_THREADS: u32 = 256;
/// The largest topk of the wide top-k.
const WIDE_MAX_TOPK: usize = 4096;
/// The shortest score row the wide top-k takes: below it one block a row is faster (on an H200 at
/// one row: 29 µs against the wide form's 56 µs at 8,192 positions, 194 µs against 62 µs at 65,536).
const WIDE_MIN_SPAN: usize = 32_768;
/// Query rows a block of the tiled prefill score kernels (`qsa_scores_di*`) stages at once.
const SCORE_ROWS: usize = 8;
/// The index head sizes with a tiled score kernel (the key decoded once into registers).
const TILED_INDEX_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Which score kernel a launch takes: the tiled one of its head size, `rows` query rows a block
/// (with the e4m3 table in shared memory too), when it has one and they fit; else the one for any
/// head size, one row a block. Both compute the same scores bit for bit.
#[derive(Debug, Clone, Copy)]
enum ScoreForm {
    Tiled { rows: usize },
    Any,
}

impl ScoreForm {
    fn of(ni: usize, di: usize, rows: usize) -> Self {
        if TILED_INDEX_DIMS.contains(&di) && 256 + rows * (ni * di + ni) <= SCORE_SMEM_FLOATS {
            ScoreForm::Tiled { rows }
        } else {
            ScoreForm::Any
        }
    }

    /// The entry point: `base` or `base_di{di}`.
    fn name(self, base: &str, di: usize) -> String {
        match self {
            ScoreForm::Tiled { .. } => format!("{base}_di{di}"),
            ScoreForm::Any => base.to_string(),
        }
    }

    /// Query rows a block scores.
    fn rows(self) -> usize {
        match self {
            ScoreForm::Tiled { rows } => rows,
            ScoreForm::Any => 1,
        }
    }

    /// Dynamic shared memory of a block.
    fn smem_bytes(self, ni: usize, di: usize) -> u32 {
        let floats = match self {
            ScoreForm::Tiled { rows } => 256 + rows * (ni * di + ni),
            ScoreForm::Any => ni * di + ni,
        };
        (floats * 4) as u32
    }
}

/// The indexer's query heads: `n_heads` (nI) of `head_dim` (dI).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexHeads {
    pub n_heads: usize,
    pub head_dim: usize,
}

/// The LayerNorm of the index keys: over `dim` (dI) values, weight `w` and bias `b` `[dim]`, `eps`.
pub struct KeyNorm<'a, W: DevicePtr<bf16>> {
    pub w: &'a W,
    pub b: &'a W,
    pub eps: f32,
    pub dim: usize,
}

/// The indexer projections of `rows` tokens: `iq` `[rows, nI·dI]` and `iw` `[rows, nI]` (bf16).
pub struct IndexProj<'a, B: DevicePtr<bf16>> {
    pub iq: &'a B,
    pub iw: &'a B,
    pub rows: usize,
}

/// The indexer queries of `rows` query rows as the score kernels read them: `qi` `[rows, nI·dI]`
/// f32 (roped) and `wts` `[rows, nI]` f32 (the scaled head weights).
pub struct IndexQueries<'a, Q: DevicePtr<f32>> {
    pub qi: &'a Q,
    pub wts: &'a Q,
    pub heads: IndexHeads,
    pub rows: usize,
}

/// The index-key pool (`[num_blocks, block_size, dI + 2]` bytes) as the score kernels read it,
/// through block tables: query row `r` reads `tables[r·stride ..]` (stride 0: one table every row
/// reads, the queries of one sequence).
pub struct IndexCache<'a, P: DevicePtr<u8>, T: DevicePtr<u32>> {
    pub pool: &'a P,
    pub tables: &'a T,
    pub stride: usize,
    pub block_size: usize,
}

/// Index score rows, `[rows, ld]` f32: row `r` at `scores[r·ld ..]`.
pub struct ScoreRows<'a, S: DevicePtr<f32>> {
    pub scores: &'a S,
    pub ld: usize,
    pub rows: usize,
}

/// The indexer's rotation: half its rotated dims, unscaled (the QSA spec's `mscale` is 1).
fn index_half(
    op: &'static str,
    rope: &RopeArgs<'_, impl DevicePtr<f32>, impl DevicePtr<u32>>,
) -> Result<usize> {
    ensure(rope.mscale == 1.0, op, || {
        format!("the indexer's RoPE is unscaled, not mscale {}", rope.mscale)
    })?;
    Ok(rope.rot_dim / 2)
}

impl Gpu {
    /// Index-key entries of `rows` tokens: `kI = LayerNorm(ik; w, b, eps)` of `ik` `[rows, dI]`, NeoX
    /// RoPE at the rows' positions, then `s = bf16(max|kI| / 448)` (1 when 0) and `k8 =
    /// fp8_e4m3(kI / s)`, written as `dI` bytes + the bf16 scale (little-endian) to pool row `dst[r]`
    /// of `idx_pool` (`[pool_rows, dI + 2]` bytes; a `dst` beyond the pool is skipped). Matches
    /// `sanmai_cpu::ops::{layer_norm, rope_neox, quantize_index_key}` byte for byte.
    pub fn qsa_index_key_write(
        &self,
        ik: &impl DevicePtr<bf16>,
        norm: &KeyNorm<'_, impl DevicePtr<bf16>>,
        rope: &RopeArgs<'_, impl DevicePtr<f32>, impl DevicePtr<u32>>,
        dst: &impl DevicePtr<u32>,
        idx_pool: &mut impl DevicePtrMut<u8>,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "qsa_index_key_write";
        let KeyNorm { w, b, eps, dim: di } = *norm;
        let (positions, inv_freq) = (rope.positions, rope.inv_freq);
        let half = index_half(OP, rope)?;
        ensure((1..=QSA_MAX_INDEX_DIM).contains(&di), OP, || {
            format!("dI = {di} must be in 1..={QSA_MAX_INDEX_DIM}")
        })?;
        ensure(2 * half <= di, OP, || "rot_dim exceeds dI".into())?;
        check_len(OP, "ik", ik, rows * di)?;
        check_len(OP, "w", w, di)?;
        check_len(OP, "b", b, di)?;
        check_len(OP, "positions", positions, rows)?;
        check_len(OP, "inv_freq", inv_freq, half)?;
        check_len(OP, "dst", dst, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let pool_rows = u32::try_from(idx_pool.len() / (di + 2)).unwrap_or(u32::MAX);
        let (dii, ri, half) = (
            int(OP, "dI", di)?,
            int(OP, "rows", rows)?,
            int(OP, "half", half)?,
        );
        let mut l = self.launch(self.kernel("qsa_index_key_write")?);
        l.ptr(ik)
            .ptr(w)
            .ptr(b)
            .arg(&eps)
            .ptr(positions)
            .ptr(inv_freq)
            .arg(&half)
            .ptr(dst)
            .arg(&pool_rows)
            .ptr_mut(idx_pool)
            .arg(&dii)
            .arg(&ri);
        // A block a row, a thread a dim (dI rounded up to whole warps, at most 256).
        let threads = di.next_multiple_of(32) as u32;
        // SAFETY: argument types match the kernel; lengths checked; block `r` touches only row `r` of
        // `ik`, `positions`, `dst` and pool row `dst[r]` (skipped beyond the pool); the block is whole
        // warps of at most 256 threads, as its block reduction needs.
        unsafe { l.launch(cfg((grid_u32(OP, rows)?, 1, 1), threads, 0)) }?;
        Ok(())
    }

    /// The indexer queries and head weights of the `proj.rows` tokens: `qi` `[rows, nI·dI]` f32 =
    /// `iq` roped at the rows' positions; `wts` `[rows, nI]` f32 = `iw · head_scale`.
    pub fn qsa_query_prep(
        &self,
        proj: &IndexProj<'_, impl DevicePtr<bf16>>,
        rope: &RopeArgs<'_, impl DevicePtr<f32>, impl DevicePtr<u32>>,
        heads: IndexHeads,
        head_scale: f32,
        qi: &mut impl DevicePtrMut<f32>,
        wts: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "qsa_query_prep";
        let IndexProj { iq, iw, rows } = *proj;
        let (positions, inv_freq) = (rope.positions, rope.inv_freq);
        let half = index_half(OP, rope)?;
        let (ni, di) = (heads.n_heads, heads.head_dim);
        ensure((1..=QSA_MAX_INDEX_DIM).contains(&di), OP, || {
            format!("dI = {di} must be in 1..={QSA_MAX_INDEX_DIM}")
        })?;
        ensure(2 * half <= di, OP, || "rot_dim exceeds dI".into())?;
        check_len(OP, "iq", iq, rows * ni * di)?;
        check_len(OP, "iw", iw, rows * ni)?;
        check_len(OP, "positions", positions, rows)?;
        check_len(OP, "inv_freq", inv_freq, half)?;
        check_len(OP, "qi", qi, rows * ni * di)?;
        check_len(OP, "wts", wts, rows * ni)?;
        if rows == 0 || ni == 0 {
            return Ok(());
        }
        // A thread per (row, head, pair or unrotated value): dI − half of them a head.
        let threads = rows * ni * (di - half);
        let (nii, dii, ri, half) = (
            int(OP, "nI", ni)?,
            int(OP, "dI", di)?,
            int(OP, "rows", rows)?,
            int(OP, "half", half)?,
        );
        let mut l = self.launch(self.kernel("qsa_query_prep")?);
        l.ptr(iq)
            .ptr(iw)
            .ptr(positions)
            .ptr(inv_freq)
            .arg(&half)
            .arg(&head_scale)
            .ptr_mut(qi)
            .ptr_mut(wts)
            .arg(&nii)
            .arg(&dii)
            .arg(&ri);
        // SAFETY: argument types match the kernel; lengths checked above; threads past the last
        // (row, head, value) return at once.
        unsafe { l.launch(cfg((grid_u32(OP, threads.div_ceil(128))?, 1, 1), 128, 0)) }?;
        Ok(())
    }

    /// Index scores of the `queries.rows` queries of one sequence (row `r` is position `pos0 + r`):
    /// `scores[r·ld + s] = Σ_h wts[r,h] · ReLU(qi[r,h] · k̂_s)` for every `s ≤ pos0 + r`, the keys
    /// dequantised from the pool through the sequence's one block table (stride 0). Entries beyond a
    /// row's context are not written. Matches `sanmai_cpu::ops::index_scores` bit for bit.
    pub fn qsa_scores(
        &self,
        queries: &IndexQueries<'_, impl DevicePtr<f32>>,
        keys: &IndexCache<'_, impl DevicePtr<u8>, impl DevicePtr<u32>>,
        pos0: usize,
        scores: &mut impl DevicePtrMut<f32>,
        ld: usize,
    ) -> Result<()> {
        const OP: &str = "qsa_scores";
        let IndexQueries {
            qi,
            wts,
            heads,
            rows: n_rows,
        } = *queries;
        let (idx_pool, table) = (keys.pool, keys.tables);
        let (ni, di, bs) = (heads.n_heads, heads.head_dim, keys.block_size);
        ensure(keys.stride == 0, OP, || {
            "the queries of one sequence read one block table (stride 0)".into()
        })?;
        ensure((1..=QSA_MAX_INDEX_DIM).contains(&di), OP, || {
            format!("dI = {di} must be in 1..={QSA_MAX_INDEX_DIM}")
        })?;
        ensure(ni * di + ni <= SCORE_SMEM_FLOATS, OP, || {
            format!("nI·dI = {} exceeds the shared-memory limit", ni * di)
        })?;
        ensure(bs > 0, OP, || "block size must be positive".into())?;
        ensure(n_rows <= GRID_YZ_MAX, OP, || {
            "too many rows in one call".into()
        })?;
        let ctx = pos0 + n_rows;
        ensure(ld >= ctx, OP, || format!("ld {ld} below the context {ctx}"))?;
        check_len(OP, "qi", qi, n_rows * ni * di)?;
        check_len(OP, "wts", wts, n_rows * ni)?;
        check_len(OP, "table", table, ctx.div_ceil(bs))?;
        check_len(OP, "scores", scores, n_rows * ld)?;
        if n_rows == 0 {
            return Ok(());
        }
        // Every block id of the table must lie inside the pool: checked on the host by the caller
        // (the table comes from the step's chunks); the pool length bounds the largest entry.
        let pool_rows = idx_pool.len() / (di + 2);
        ensure(pool_rows >= bs, OP, || "index pool holds no block".into())?;
        let (nii, dii, bsi, p0) = (
            int(OP, "nI", ni)?,
            int(OP, "dI", di)?,
            int(OP, "block_size", bs)?,
            int(OP, "pos0", pos0)?,
        );
        let (ldl, nri) = (ld as i64, int(OP, "rows", n_rows)?);
        let tiled = ScoreForm::of(ni, di, SCORE_ROWS);
        let mut l = self.launch(self.kernel(&tiled.name("qsa_scores", di))?);
        l.ptr(qi)
            .ptr(wts)
            .ptr(idx_pool)
            .ptr(table)
            .arg(&p0)
            .arg(&nii)
            .arg(&dii)
            .arg(&bsi)
            .arg(&nri)
            .ptr_mut(scores)
            .arg(&ldl);
        let grid = (
            grid_u32(OP, ctx.div_ceil(128))?,
            n_rows.div_ceil(tiled.rows()) as u32,
            1,
        );
        let smem = tiled.smem_bytes(ni, di);
        // SAFETY: argument types match the kernel; lengths checked above; block ids come from the
        // caller's validated tables.
        unsafe { l.launch(cfg(grid, 128, smem)) }?;
        Ok(())
    }

    /// The selected set of the `rows.rows` queries of one sequence (row `r` is position `pos0 + r`, context
    /// `pos0 + r + 1`): all positions when the context is at most `topk`, else the `topk` of largest
    /// `scores[r·ld + s]` (NaN below every number, ties to the larger position), in increasing order,
    /// to `sel[r·topk ..]`; `counts[r]` = how many. Matches `sanmai_cpu::ops::topk_positions`.
    pub fn qsa_topk(
        &self,
        rows: &ScoreRows<'_, impl DevicePtr<f32>>,
        pos0: usize,
        topk: usize,
        sel: &mut impl DevicePtrMut<u32>,
        counts: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const OP: &str = "qsa_topk";
        let ScoreRows {
            scores,
            ld,
            rows: n_rows,
        } = *rows;
        ensure(topk > 0, OP, || "topk must be positive".into())?;
        ensure(ld >= pos0 + n_rows, OP, || "ld below the context".into())?;
        check_len(OP, "scores", scores, n_rows * ld)?;
        check_len(OP, "sel", sel, n_rows * topk)?;
        check_len(OP, "counts", counts, n_rows)?;
        if n_rows == 0 {
            return Ok(());
        }
        let (p0, k) = (int(OP, "pos0", pos0)?, int(OP, "topk", topk)?);
        int(OP, "context", pos0 + n_rows)?;
        let ldl = ld as i64;
        let mut l = self.launch(self.kernel("qsa_topk")?);
        l.ptr(scores)
            .arg(&ldl)
            .arg(&p0)
            .arg(&k)
            .ptr_mut(sel)
            .ptr_mut(counts);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { l.launch(cfg((grid_u32(OP, n_rows)?, 1, 1), 1024, 0)) }?;
        Ok(())
    }

    /// The decode form of [`Gpu::qsa_scores`]: row `r` is the one query of sequence `r`, its context
    /// `min(lens[r], ld)` and its block table row `r` of `keys.tables` (`[rows, stride]`) read on
    /// the device. A row whose context is at most `topk` is not scored (it selects every position);
    /// otherwise `scores[r·ld + s]` for every `s` of its context, as `qsa_scores`. The launch covers
    /// `ld` positions a row whatever the contexts: `ld` (a recorded step's span) must be at least
    /// every context, and `stride·block_size` must cover it.
    pub fn qsa_scores_decode(
        &self,
        queries: &IndexQueries<'_, impl DevicePtr<f32>>,
        keys: &IndexCache<'_, impl DevicePtr<u8>, impl DevicePtr<u32>>,
        lens: &impl DevicePtr<u32>,
        topk: usize,
        scores: &mut impl DevicePtrMut<f32>,
        ld: usize,
    ) -> Result<()> {
        const OP: &str = "qsa_scores_decode";
        let IndexQueries {
            qi,
            wts,
            heads,
            rows: n_rows,
        } = *queries;
        let (idx_pool, tables, table_stride) = (keys.pool, keys.tables, keys.stride);
        let (ni, di, bs) = (heads.n_heads, heads.head_dim, keys.block_size);
        ensure((1..=QSA_MAX_INDEX_DIM).contains(&di), OP, || {
            format!("dI = {di} must be in 1..={QSA_MAX_INDEX_DIM}")
        })?;
        ensure(ni * di + ni <= SCORE_SMEM_FLOATS, OP, || {
            format!("nI·dI = {} exceeds the shared-memory limit", ni * di)
        })?;
        ensure(bs > 0, OP, || "block size must be positive".into())?;
        ensure(n_rows <= GRID_YZ_MAX, OP, || {
            "too many rows in one call".into()
        })?;
        check_len(OP, "qi", qi, n_rows * ni * di)?;
        check_len(OP, "wts", wts, n_rows * ni)?;
        check_len(OP, "tables", tables, n_rows * table_stride)?;
        check_len(OP, "lens", lens, n_rows)?;
        check_len(OP, "scores", scores, n_rows * ld)?;
        if n_rows == 0 || ld == 0 {
            return Ok(());
        }
        let pool_rows = idx_pool.len() / (di + 2);
        ensure(pool_rows >= bs, OP, || "index pool holds no block".into())?;
        let (nii, dii, bsi, k) = (
            int(OP, "nI", ni)?,
            int(OP, "dI", di)?,
            int(OP, "block_size", bs)?,
            int(OP, "topk", topk)?,
        );
        // Positions past the table's reach are never read.
        let max_ctx = ld.min(table_stride * bs) as i64;
        let (ldl, ts) = (ld as i64, table_stride as i64);
        let tiled = ScoreForm::of(ni, di, 1);
        let mut l = self.launch(self.kernel(&tiled.name("qsa_scores_decode", di))?);
        l.ptr(qi)
            .ptr(wts)
            .ptr(idx_pool)
            .ptr(tables)
            .arg(&ts)
            .ptr(lens)
            .arg(&max_ctx)
            .arg(&k)
            .arg(&nii)
            .arg(&dii)
            .arg(&bsi)
            .ptr_mut(scores)
            .arg(&ldl);
        let grid = (grid_u32(OP, ld.div_ceil(128))?, n_rows as u32, 1);
        let smem = tiled.smem_bytes(ni, di);
        // SAFETY: argument types match the kernel; lengths checked above; each row reads at most
        // min(ld, table_stride·block_size) positions through its table row, whose block ids come from
        // the step's validated chunks.
        unsafe { l.launch(cfg(grid, 128, smem)) }?;
        Ok(())
    }

    /// The `u32` values of the work buffer [`Gpu::qsa_topk_decode`] takes for `rows` score rows of
    /// `ld` positions.
    pub fn qsa_topk_decode_work(rows: usize, ld: usize) -> usize {
        rows * (WIDE_AUX + ld)
    }

    /// The decode form of [`Gpu::qsa_topk`]: row `r` is the one query of sequence `r`, its context
    /// `min(lens[r], ld)` read on the device; every position when that is at most `topk`, else the
    /// `topk` of largest `scores[r·ld + s]` (as `qsa_scores_decode` wrote them; ties to the larger
    /// position), in increasing order, to `sel[r·topk ..]`; `counts[r]` = how many. `work` holds
    /// [`Gpu::qsa_topk_decode_work`] values (its contents do not matter).
    ///
    /// For rows of at least 32,768 positions and `topk` up to 4,096 this is the wide form
    /// (`kernels/qsa_topk.cu`): many blocks a row narrow the threshold to the positions whose score
    /// shares its top 24 bits, one block a row finishes among them, so a long context at batch 1
    /// keeps the GPU busy. Otherwise one block a row. Both select the same sets; every launch shape
    /// depends only on the rows, `ld` and `topk`.
    pub fn qsa_topk_decode(
        &self,
        rows: &ScoreRows<'_, impl DevicePtr<f32>>,
        lens: &impl DevicePtr<u32>,
        topk: usize,
        (sel, counts): (&mut impl DevicePtrMut<u32>, &mut impl DevicePtrMut<u32>),
        work: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const OP: &str = "qsa_topk_decode";
        let ScoreRows {
            scores,
            ld,
            rows: n_rows,
        } = *rows;
        ensure(topk > 0, OP, || "topk must be positive".into())?;
        ensure(n_rows <= GRID_YZ_MAX, OP, || {
            "too many rows in one call".into()
        })?;
        check_len(OP, "scores", scores, n_rows * ld)?;
        check_len(OP, "lens", lens, n_rows)?;
        check_len(OP, "sel", sel, n_rows * topk)?;
        check_len(OP, "counts", counts, n_rows)?;
        check_len(OP, "work", work, Self::qsa_topk_decode_work(n_rows, ld))?;
        if n_rows == 0 {
            return Ok(());
        }
        let k = int(OP, "topk", topk)?;
        int(OP, "ld", ld)?;
        let (ldl, max_ctx) = (ld as i64, ld as i64);
        if topk > WIDE_MAX_TOPK || ld < WIDE_MIN_SPAN {
            let mut l = self.launch(self.kernel("qsa_topk_decode")?);
            l.ptr(scores)
                .arg(&ldl)
                .ptr(lens)
                .arg(&max_ctx)
                .arg(&k)
                .ptr_mut(sel)
                .ptr_mut(counts);
            // SAFETY: argument types match the kernel; lengths checked above; contexts are capped
            // at ld.
            unsafe { l.launch(cfg((grid_u32(OP, n_rows)?, 1, 1), 1024, 0)) }?;
            return Ok(());
        }
        // The per-row histograms and state start at zero; the candidate lists after them need not.
        let aux_len = n_rows * WIDE_AUX;
        let (work_ptr, _rec) = work.device_ptr_mut(self.stream());
        // SAFETY: the work buffer holds at least aux_len u32 values (checked above).
        unsafe { result::memset_d8_async(work_ptr, 0, aux_len * 4, self.stream().cu_stream()) }?;
        let cand_ptr = work_ptr + (aux_len * 4) as u64;
        let grid = (grid_u32(OP, ld.div_ceil(WIDE_CHUNK))?, n_rows as u32, 1);
        for pass in [1i32, 2] {
            let mut l = self.launch(self.kernel("qsa_topk_wide_hist")?);
            l.ptr(scores)
                .arg(&ldl)
                .ptr(lens)
                .arg(&max_ctx)
                .arg(&k)
                .arg(&pass)
                .arg(&work_ptr);
            // SAFETY: argument types match the kernel; lengths checked above (aux rows of
            // WIDE_AUX values, contexts capped at ld).
            unsafe { l.launch(cfg(grid, WIDE_THREADS, 0)) }?;
        }
        {
            let mut l = self.launch(self.kernel("qsa_topk_wide_collect")?);
            l.ptr(scores)
                .arg(&ldl)
                .ptr(lens)
                .arg(&max_ctx)
                .arg(&k)
                .arg(&work_ptr)
                .ptr_mut(sel)
                .arg(&cand_ptr);
            // SAFETY: as above; each row appends at most topk selected and ld candidate positions.
            unsafe { l.launch(cfg(grid, WIDE_THREADS, 0)) }?;
        }
        let mut l = self.launch(self.kernel("qsa_topk_wide_finish")?);
        l.ptr(scores)
            .arg(&ldl)
            .ptr(lens)
            .arg(&max_ctx)
            .arg(&k)
            .arg(&work_ptr)
            .ptr_mut(sel)
            .arg(&cand_ptr)
            .ptr_mut(counts);
        // SAFETY: as above; topk ≤ WIDE_MAX_TOPK fits the block's shared sort buffer.
        unsafe { l.launch(cfg((grid_u32(OP, n_rows)?, 1, 1), 1024, 0)) }?;
        Ok(())
    }

    /// Gated attention of the `sel.rows` queries of one sequence over their selected positions: row
    /// `r` attends to `sel.sel[r·stride .. + counts[r]]` (positions, gathered through the one table
    /// of `cache`, stride 0); `q`, `gate`, `out` `[rows, hq·d]`; `max_count` ≥ every `counts[r]` sets
    /// the splits. `out = softmax(q·k·d^-0.5) v · sigmoid(gate)`. Matches
    /// `sanmai_cpu::ops::attend_rows`.
    pub fn qsa_attention_gather(
        &self,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        sel: &Selection<'_, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "qsa_attention_gather";
        ensure(cache.stride == 0, OP, || {
            "the queries of one sequence read one block table (stride 0)".into()
        })?;
        self.gather((OP, dims), queries, cache, sel, NO_CACHE, out)
    }

    /// The decode form of [`Gpu::qsa_attention_gather`]: row `r` is the one query of sequence `r`,
    /// whose K/V rows are gathered through row `r` of `cache.tables` (`[rows, stride]` block ids); its
    /// selection `sel[r·topk .. + counts[r]]` (from [`Gpu::qsa_topk_decode`]: stride and `max_count`
    /// both `topk`, so the splits cover topk and the launch shape depends only on the batch and the
    /// model shape).
    pub fn qsa_attention_gather_decode(
        &self,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        sel: &Selection<'_, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "qsa_attention_gather_decode";
        check_len(OP, "tables", cache.tables, sel.rows * cache.stride)?;
        self.gather((OP, dims), queries, cache, sel, NO_CACHE, out)
    }

    /// The partial and reduce launches of the gathered attention of the op `op`, through the row
    /// cache `rc` when given (its buffers checked by the caller), else reading every row from the
    /// pools (the kernel's cache pointers null).
    pub(super) fn gather(
        &self,
        (op, dims): (&'static str, AttnDims),
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        selection: &Selection<'_, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        rc: Option<
            &mut RowCacheBufs<
                '_,
                impl DevicePtrMut<u64>,
                impl DevicePtrMut<u32>,
                impl DevicePtrMut<bf16>,
            >,
        >,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let Selection {
            sel,
            stride: sel_stride,
            counts,
            max_count,
            rows: n_rows,
        } = *selection;
        let Queries { q, gate } = *queries;
        let KvPools {
            k: k_pool,
            v: v_pool,
        } = cache.pools;
        let (hq, hkv, d, bs) = (dims.hq, dims.hkv, dims.head_dim, dims.block_size);
        ensure(hkv > 0 && hq.is_multiple_of(hkv), op, || {
            format!("{hq} query heads are not a multiple of {hkv} KV heads")
        })?;
        ensure((1..=QSA_MAX_HEAD_DIM).contains(&d), op, || {
            format!("head_dim {d} must be in 1..={QSA_MAX_HEAD_DIM}")
        })?;
        ensure(bs > 0, op, || "block size must be positive".into())?;
        ensure(max_count <= sel_stride, op, || {
            "max_count exceeds sel_stride".into()
        })?;
        check_len(op, "q", q, n_rows * hq * d)?;
        check_len(op, "gate", gate, n_rows * hq * d)?;
        check_len(op, "out", out, n_rows * hq * d)?;
        check_len(op, "sel", sel, n_rows * sel_stride)?;
        check_len(op, "counts", counts, n_rows)?;
        ensure(k_pool.len() == v_pool.len(), op, || "pools differ".into())?;
        if n_rows == 0 {
            return Ok(());
        }
        ensure(n_rows <= GRID_YZ_MAX, op, || {
            "too many rows in one call".into()
        })?;
        // The prefill form (one sequence's rows on one table, stride 0) takes wide spans, the decode
        // form (a table a row) narrow ones.
        let (kernel, span) = match cache.stride {
            0 => ("qsa_attn_partial_wide", QSA_SPLIT),
            _ => ("qsa_attn_partial", QSA_SPLIT_DECODE),
        };
        let splits = max_count.div_ceil(span).max(1);
        ensure(splits <= GRID_YZ_MAX, op, || "too many splits".into())?;
        // Rows a launch pair takes: their split workspace stays within PART_BUDGET bytes (a prefill
        // chunk of many rows over a long selection would otherwise ask for gigabytes of it); rows are
        // independent, so the chunks' outputs are those of one launch.
        let per_row = hq * splits * (d + 2) * 4;
        let chunk = (PART_BUDGET / per_row).clamp(1, n_rows);
        let slots = chunk * hq * splits;
        let mut part_o = self.stream().alloc_zeros::<f32>(slots * d)?;
        let mut part_ml = self.stream().alloc_zeros::<f32>(slots * 2)?;
        let (hqi, hkvi, di, bsi, spi, ss) = (
            int(op, "hq", hq)?,
            int(op, "hkv", hkv)?,
            int(op, "d", d)?,
            int(op, "bs", bs)?,
            int(op, "splits", splits)?,
            int(op, "sel_stride", sel_stride)?,
        );
        let scale = (d as f32).powf(-0.5);
        let ts = cache.stride as i64;
        let rc_lines = rc.as_ref().map_or(0, |rc| rc.lines as i64);
        let mut rc = rc;
        // Row r0's place in each per-row buffer (bytes from its start).
        let (qa, ga, sa, ca, ta) = (
            self.addr(q),
            self.addr(gate),
            self.addr(sel),
            self.addr(counts),
            self.addr(cache.tables),
        );
        let oa = self.addr_mut(out);
        // A block a group of at most QSA_GROUP query heads of one KV head (`qsa_heads` in qsa.cu).
        let groups = (hq / hkv).div_ceil(QSA_GROUP);
        for r0 in (0..n_rows).step_by(chunk) {
            let rows = chunk.min(n_rows - r0);
            let at = |base: u64, per_row_bytes: usize| base + (r0 * per_row_bytes) as u64;
            let (qr, gr, or) = (at(qa, hq * d * 2), at(ga, hq * d * 2), at(oa, hq * d * 2));
            let (sr, cr, tr) = (at(sa, sel_stride * 4), at(ca, 4), at(ta, cache.stride * 4));
            let mut l = self.launch(self.kernel(kernel)?);
            l.arg(&qr)
                .ptr(k_pool)
                .ptr(v_pool)
                .arg(&tr)
                .arg(&ts)
                .arg(&sr)
                .arg(&ss)
                .arg(&cr)
                .ptr_mut(&mut part_o)
                .ptr_mut(&mut part_ml)
                .arg(&hqi)
                .arg(&hkvi)
                .arg(&di)
                .arg(&bsi)
                .arg(&spi)
                .arg(&scale);
            match rc.as_mut() {
                Some(rc) => l
                    .ptr_mut(&mut *rc.tags)
                    .ptr_mut(&mut *rc.hitmark)
                    .ptr_mut(&mut *rc.claim)
                    .ptr_mut(&mut *rc.epoch)
                    .ptr_mut(&mut *rc.k)
                    .ptr_mut(&mut *rc.v),
                None => l
                    .arg(&NULL_PTR)
                    .arg(&NULL_PTR)
                    .arg(&NULL_PTR)
                    .arg(&NULL_PTR)
                    .arg(&NULL_PTR)
                    .arg(&NULL_PTR),
            }
            .arg(&rc_lines);
            let grid = ((hkv * groups) as u32, splits as u32, rows as u32);
            // SAFETY: argument types match the kernel; lengths checked (rows r0 .. r0 + rows of every
            // per-row buffer lie inside it; the workspace holds `chunk` rows); the selected positions
            // come from qsa_topk (each below its row's context, which the table covers); with a row
            // cache, its buffers hold `lines` entries and rows of hkv·d (checked by the caller) and
            // every line index is a slot modulo lines.
            unsafe { l.launch(cfg(grid, 128, 0)) }?;
            drop(l);
            let mut l = self.launch(self.kernel("qsa_attn_reduce")?);
            l.ptr(&part_o)
                .ptr(&part_ml)
                .arg(&gr)
                .arg(&or)
                .arg(&hqi)
                .arg(&di)
                .arg(&spi);
            // SAFETY: as above; 128 threads take d ≤ QSA_MAX_HEAD_DIM (256) values, two a thread.
            unsafe { l.launch(cfg((hq as u32, rows as u32, 1), 128, 0)) }?;
        }
        Ok(())
    }
}

/// Bytes of split workspace (`part_o`, `part_ml`) one launch of the gathered attention takes at most.
const PART_BUDGET: usize = 256 << 20;

/// A null device pointer: the row-cache arguments of the uncached attention.
static NULL_PTR: u64 = 0;

/// No row cache (the uncached gathered attention).
const NO_CACHE: Option<&mut RowCacheBufs<'_, CudaSlice<u64>, CudaSlice<u32>, CudaSlice<bf16>>> =
    None;

/// The selected positions of the gathered attention over `rows` query rows: row `r` attends to
/// `sel[r·stride .. + counts[r]]`; `max_count` (≤ `stride`) ≥ every count sets the splits.
pub struct Selection<'a, S: DevicePtr<u32>, C: DevicePtr<u32>> {
    pub sel: &'a S,
    pub stride: usize,
    pub counts: &'a C,
    pub max_count: usize,
    pub rows: usize,
}
