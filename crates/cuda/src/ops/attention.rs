//! Gated attention over the paged K/V cache: decode (one query per sequence, a batch of sequences of
//! different lengths) and prefill (one chunk of one sequence, causal).
//!
//! Decode (and prefill at a head size the tensor-core kernel lacks) runs as split-K: a partial kernel
//! per (query row, span of context positions, group of up to 8 query heads sharing a KV head, so each
//! K/V row is read once per group), then a reduce kernel that merges the spans and multiplies by
//! `sigmoid(gate)` (the Qwen3-Next output gate, same `[rows, hq·head_dim]` layout as the output, so it
//! is fused into the reduce).
//!
//! The number of spans per row is fixed by the host from `max_len` (for a recorded decode step, its
//! span) and the rows: for decode, enough spans that the grid holds [`DECODE_BLOCKS_PER_SM`] blocks
//! per multiprocessor (fewer where the longest context has fewer 32-position spans), so a short
//! context still spreads over many blocks and a long one over all of them; prefill takes spans of
//! [`PREFILL_SPLIT`]. Each row divides its own length over those spans on the device (spans of at
//! least 32 positions), so the spans past a row's length exit at once. A partial block reads its
//! span in one pass, K and V tiles together, the next tile in flight while one is summed.
//!
//! Prefill at head sizes 32, 64, 128 and 256 runs on the tensor cores (`attention_prefill.cu`,
//! flash-attention 2's forward pass): a block owns 64 (query, head) rows of one KV head's group and
//! walks the context in key tiles with an online softmax, gating and rounding its output itself. Only
//! when those blocks would leave the multiprocessors idle (a short chunk after a long prefix) does it
//! split the context too, into the same workspace the reduce kernel merges (`prefill_spans`).
//!
//! The cache layout is the CPU backend's: `k_pool`, `v_pool` are `[num_blocks, block_size,
//! hkv·head_dim]` bf16; position `p` of a sequence lies in block `table[p / block_size]`, row
//! `p % block_size`. The split workspace (`rows·hq·splits·(head_dim + 2)` f32) is allocated per call
//! from the stream-ordered pool, uninitialised (the reduce reads only what the partial kernel wrote).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceSlice};
use half::bf16;

use super::{row_threads, KvPools};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, int, Gpu};

/// The largest head size the kernels take.
pub const ATTN_MAX_HEAD_DIM: usize = 256;
/// Context positions of one split of a prefill launch of the partial kernel.
const PREFILL_SPLIT: usize = 256;
/// The granule of a split (`ATT_MIN_SPLIT` in `attention.cu`): a row's length is divided into splits
/// of a multiple of it.
const ATTN_MIN_SPLIT: usize = 32;
/// Partial-kernel blocks one multiprocessor holds at once (128 threads of about 220 registers; 68 KiB
/// of shared memory on sm_90, 36 KiB on sm_86): a decode launch splits the context until the grid
/// has this many per multiprocessor.
const DECODE_BLOCKS_PER_SM: usize = 2;
/// Query heads of one partial block at most (`ATT_HB` in `attention.cu`).
const HEADS_PER_BLOCK: usize = 8;
/// Threads of a partial-kernel block (`ATT_THREADS` in `attention.cu`).
const PARTIAL_THREADS: u32 = 128;
/// The dynamic shared memory of a partial-kernel block (`ATT_BUF` floats in `attention.cu`): the
/// K/V tiles it holds, four from compute capability 9.0 on, else two, of 16 KiB each.
fn partial_smem(compute_capability: (u32, u32)) -> usize {
    let stages = if compute_capability.0 >= 9 { 4 } else { 2 };
    stages * 2 * 4 * PARTIAL_THREADS as usize * 16
}
/// Thread groups of a reduce block, each over a share of the splits (`ATT_RED_GROUPS`).
const REDUCE_GROUPS: u32 = 4;
/// The hardware limit of grid dimensions y and z.
const GRID_YZ_MAX: usize = 65535;
/// (query, head) rows of one tensor-core prefill block (`AP_BM` in `attention_prefill.cu`).
const MMA_ROWS: usize = 64;
/// Threads of a tensor-core prefill block (`AP_THREADS` in `attention_prefill.cu`).
const MMA_THREADS: u32 = 128;
/// Tensor-core prefill blocks one multiprocessor holds at once at head size 256 on sm_90 (64 KiB of
/// shared memory and about 244 registers a thread each): the grid should offer this many per
/// multiprocessor before the context is split.
const MMA_BLOCKS_PER_SM: usize = 2;

/// Head counts, head size and cache block size of an attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnDims {
    pub hq: usize,
    pub hkv: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl AttnDims {
    /// Elements of one cache row, `hkv·head_dim`.
    pub fn kv_row(&self) -> usize {
        self.hkv * self.head_dim
    }

    /// Elements of one query / gate / output row, `hq·head_dim`.
    pub fn q_row(&self) -> usize {
        self.hq * self.head_dim
    }
}

/// The queries of an attention call and their output gate, each `[rows, hq·head_dim]` (q normed and
/// roped; the output is `attention · sigmoid(gate)`).
pub struct Queries<'a, Q: DevicePtr<bf16>> {
    pub q: &'a Q,
    pub gate: &'a Q,
}

/// A layer's paged K/V cache as an attention kernel reads it: the pools and block tables, query row
/// `r` reading the table at `tables[r·stride ..]` (stride 0: one table every row reads, a chunk of
/// one sequence). Position `p` of a sequence lies in block `table[p / block_size]`, row
/// `p % block_size`; a block id beyond the pool masks its positions.
pub struct PagedCache<'a, K: DevicePtr<bf16>, T: DevicePtr<u32>> {
    pub pools: KvPools<&'a K>,
    pub tables: &'a T,
    pub stride: usize,
}

/// The sequences of a decode call: `batch` rows, row `r` the one query of sequence `r`, whose
/// context is `lens[r]` positions (device, the new token included); `max_len` ≥ every length sets
/// the number of splits (positions beyond it are not attended).
pub struct DecodeLens<'a, L: DevicePtr<u32>> {
    pub lens: &'a L,
    pub max_len: usize,
    pub batch: usize,
}

/// The queries of a prefill chunk of one sequence: `t` queries at positions `pos0 .. pos0 + t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRows {
    pub pos0: usize,
    pub t: usize,
}

/// Where the rows' lengths and block tables come from.
enum Rows {
    /// Row `r` is sequence `r` of `batch`: length `lens[r]` (device, at most `max_len`), table row
    /// `r` of `max_blocks` ids.
    Decode {
        lens: u64,
        max_blocks: usize,
        max_len: usize,
        batch: usize,
    },
    /// Row `r` is query `pos0 + r` of the chunk of one sequence whose table holds `max_blocks` ids.
    Prefill { chunk: ChunkRows, max_blocks: usize },
}

impl Rows {
    /// The query rows and the longest context.
    fn extent(&self) -> (usize, usize) {
        match *self {
            Rows::Decode { max_len, batch, .. } => (batch, max_len),
            Rows::Prefill { chunk, .. } => (chunk.t, chunk.pos0 + chunk.t),
        }
    }
}

impl Gpu {
    /// Decode attention of `seqs.batch` sequences, one query each. `q`, `gate`, `out`: `[batch,
    /// hq·head_dim]`; `cache.tables`: `[batch, stride]` block ids; the lengths are capped at
    /// `stride·block_size`. Matches `sanmai_cpu::ops::attention_causal` with `t = 1` times
    /// `sigmoid(gate)`.
    pub fn attention_paged_decode(
        &self,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        seqs: &DecodeLens<'_, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "attention_paged_decode";
        let (batch, max_blocks) = (seqs.batch, cache.stride);
        check_len(OP, "block_table", cache.tables, batch * max_blocks)?;
        check_len(OP, "seq_lens", seqs.lens, batch)?;
        let (lp, _gl) = seqs.lens.device_ptr(self.stream());
        let rows = Rows::Decode {
            lens: lp,
            max_blocks,
            max_len: seqs.max_len,
            batch,
        };
        self.attn_paged(OP, dims, queries, cache, rows, out)
    }

    /// Causal prefill attention of one chunk of one sequence: `t` queries at positions `pos0 ..
    /// pos0 + t` (their K/V already written to the cache) against positions `0 ..= pos0 + i`.
    /// `q`, `gate`, `out`: `[t, hq·head_dim]`; `cache.tables`: the sequence's block ids (stride 0), at
    /// least `⌈(pos0 + t) / block_size⌉`. Matches `sanmai_cpu::ops::attention_causal` over the
    /// gathered cache of `pos0 + t` positions, times `sigmoid(gate)`.
    pub fn attention_paged_prefill(
        &self,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        chunk: ChunkRows,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "attention_paged_prefill";
        let ChunkRows { pos0, t } = chunk;
        ensure(cache.stride == 0, OP, || {
            "a chunk of one sequence reads one block table (stride 0)".into()
        })?;
        let max_blocks = cache.tables.len();
        ensure(
            dims.block_size > 0 && max_blocks * dims.block_size >= pos0 + t,
            OP,
            || {
                format!(
                    "{max_blocks} blocks of {} cannot hold {} positions",
                    dims.block_size,
                    pos0 + t
                )
            },
        )?;
        if let Some((kernel, key_tile)) = prefill_mma_kernel(dims.head_dim) {
            if self.prefill_mma_aligned(queries, &cache.pools, out) {
                let tiles = PrefillTiles {
                    kernel,
                    key_tile,
                    pos0,
                    t,
                };
                return self.attn_prefill_mma(OP, dims, queries, cache, tiles, out);
            }
        }
        let rows = Rows::Prefill { chunk, max_blocks };
        self.attn_paged(OP, dims, queries, cache, rows, out)
    }

    /// The split-K partial and reduce launches over the rows `rows` describes.
    fn attn_paged(
        &self,
        op: &'static str,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        rows: Rows,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let Queries { q, gate } = *queries;
        let KvPools {
            k: k_pool,
            v: v_pool,
        } = cache.pools;
        let block_table = cache.tables;
        let (n, max_len) = rows.extent();
        let AttnDims {
            hq,
            hkv,
            head_dim: d,
            block_size: bs,
        } = dims;
        ensure(hkv > 0 && hq > 0 && hq % hkv == 0, op, || {
            format!("hq = {hq} must be a positive multiple of hkv = {hkv}")
        })?;
        ensure(d > 0 && d <= ATTN_MAX_HEAD_DIM, op, || {
            format!("head_dim = {d} must be in 1..={ATTN_MAX_HEAD_DIM}")
        })?;
        ensure(bs > 0, op, || "block_size must be positive".into())?;
        // The kernel divides positions by the block size with a 32-bit multiply, exact while
        // position · block_size < 2^32 (kernels/attention.cu, att_div).
        let cap = match rows {
            Rows::Decode { max_blocks, .. } | Rows::Prefill { max_blocks, .. } => max_blocks * bs,
        };
        ensure(
            (cap as u64).saturating_mul(bs as u64) <= 1 << 32,
            op,
            || {
                format!("{cap} positions of blocks of {bs} exceed the kernel's 32-bit position arithmetic")
            },
        )?;
        let group = hq / hkv;
        let chunks = group.div_ceil(HEADS_PER_BLOCK);
        let (splits, max_split) = match rows {
            Rows::Decode { .. } => {
                let sms = self.info().multiprocessors as usize;
                decode_splits(max_len, hkv * chunks * n, sms)
            }
            Rows::Prefill { .. } => (max_len.div_ceil(PREFILL_SPLIT).max(1), PREFILL_SPLIT),
        };
        ensure(n <= GRID_YZ_MAX && splits <= GRID_YZ_MAX, op, || {
            format!("{n} rows or {splits} splits exceed {GRID_YZ_MAX}")
        })?;
        let num_blocks = check_paged(op, dims, queries, &cache.pools, &*out, n)?;
        if n == 0 {
            return Ok(());
        }
        let (lens, pos0, max_blocks, table_stride) = match rows {
            Rows::Decode {
                lens, max_blocks, ..
            } => (lens, 0, max_blocks, max_blocks),
            Rows::Prefill { chunk, max_blocks } => (0u64, chunk.pos0, max_blocks, 0),
        };
        let (hqi, hkvi, di, bsi) = (
            int(op, "hq", hq)?,
            int(op, "hkv", hkv)?,
            d as i32,
            int(op, "block_size", bs)?,
        );
        let (stride_i, mb_i, pos0_i, splits_i) = (
            int(op, "table stride", table_stride)?,
            int(op, "max_blocks", max_blocks)?,
            int(op, "pos0 + rows", pos0 + n).map(|_| pos0 as i32)?,
            splits as i32,
        );
        let scale = (d as f64).powf(-0.5) as f32;
        let hb = group.div_ceil(chunks);
        let (max_split_i, hb_i) = (max_split as i32, hb as i32);
        let s = self.stream();
        // SAFETY: plain device allocations; the partial kernel writes every part_ml slot and the
        // part_o slots of every split whose max is finite, the only ones the reduce reads.
        let mut part_o = unsafe { s.alloc::<f32>(n * hq * splits * d) }?;
        let mut part_ml = unsafe { s.alloc::<f32>(n * hq * splits * 2) }?;
        let smem = partial_smem(self.info().compute_capability);
        let f = self.kernel("attn_paged_partial")?;
        // Above 48 KiB of dynamic shared memory a kernel must opt in (a host-side attribute).
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let mut l = self.launch(f);
        l.ptr(q)
            .ptr(k_pool)
            .ptr(v_pool)
            .ptr(block_table)
            .arg(&stride_i)
            .arg(&mb_i)
            .arg(&lens)
            .arg(&pos0_i)
            .ptr_mut(&mut part_o)
            .ptr_mut(&mut part_ml)
            .arg(&hqi)
            .arg(&hkvi)
            .arg(&di)
            .arg(&bsi)
            .arg(&num_blocks)
            .arg(&splits_i)
            .arg(&max_split_i)
            .arg(&hb_i)
            .arg(&scale);
        let grid = ((hkv * chunks) as u32, n as u32, splits as u32);
        // SAFETY: argument types match the kernel; q and the pools' lengths checked above; the table
        // holds `n` rows of `max_blocks` ids (decode, checked by the caller) or one row (prefill,
        // stride 0); the kernel caps every length at max_blocks·block_size and masks block ids at or
        // beyond num_blocks; the workspace holds n·hq·splits slots.
        unsafe { l.launch(cfg(grid, PARTIAL_THREADS, smem as u32)) }?;
        drop(l);
        let mut l = self.launch(self.kernel("attn_paged_reduce")?);
        l.ptr(&part_o)
            .ptr(&part_ml)
            .ptr(gate)
            .ptr_mut(out)
            .arg(&hqi)
            .arg(&di)
            .arg(&splits_i);
        // SAFETY: argument types match the kernel; gate and out hold n·hq·head_dim elements; the
        // block has at least head_dim threads in each of its groups.
        unsafe { l.launch(cfg((hq as u32, n as u32, 1), reduce_threads(d), 0)) }?;
        Ok(())
    }
}

/// Checks that the pools are equal and hold whole blocks, and that q, gate and out hold `rows` query
/// rows; returns the number of blocks in the pools.
fn check_paged(
    op: &'static str,
    dims: AttnDims,
    queries: &Queries<'_, impl DevicePtr<bf16>>,
    pools: &KvPools<&impl DevicePtr<bf16>>,
    out: &impl DeviceSlice<bf16>,
    rows: usize,
) -> Result<u32> {
    let (k_pool, v_pool) = (pools.k, pools.v);
    let pool_rows = dims.block_size * dims.kv_row();
    ensure(
        k_pool.len() == v_pool.len() && k_pool.len() % pool_rows == 0,
        op,
        || {
            format!(
                "k_pool ({}) and v_pool ({}) must be equal multiples of block_size·hkv·head_dim = {pool_rows}",
                k_pool.len(),
                v_pool.len()
            )
        },
    )?;
    check_len(op, "q", queries.q, rows * dims.q_row())?;
    check_len(op, "gate", queries.gate, rows * dims.q_row())?;
    check_len(op, "out", out, rows * dims.q_row())?;
    Ok(u32::try_from(k_pool.len() / pool_rows).unwrap_or(u32::MAX))
}

/// Threads of a reduce block: [`REDUCE_GROUPS`] groups of `row_threads(d)`, each summing every
/// [`REDUCE_GROUPS`]-th split (`ATT_RED_GROUPS` in `attention.cu`).
fn reduce_threads(d: usize) -> u32 {
    row_threads(d) * REDUCE_GROUPS
}

/// `(splits, max_split)` of a decode launch whose longest context is `max_len` and whose grid has
/// `blocks` blocks per split: as many splits as the multiprocessors hold at once
/// ([`DECODE_BLOCKS_PER_SM`] blocks each; at least one), but no more than the context has
/// [`ATTN_MIN_SPLIT`]-position spans; `max_split`,
/// a multiple of [`ATTN_MIN_SPLIT`], so that the splits cover `max_len` with none idle there.
fn decode_splits(max_len: usize, blocks: usize, sms: usize) -> (usize, usize) {
    let spans = max_len.div_ceil(ATTN_MIN_SPLIT).max(1);
    // Rounded down: one block past what the multiprocessors hold at once would run as a second wave.
    let splits = ((DECODE_BLOCKS_PER_SM * sms) / blocks.max(1)).clamp(1, spans);
    let max_split = max_len
        .div_ceil(splits)
        .next_multiple_of(ATTN_MIN_SPLIT)
        .max(ATTN_MIN_SPLIT);
    // Rounding the span up may leave the last splits idle at the longest context: drop them.
    (max_len.div_ceil(max_split).max(1), max_split)
}

/// The tensor-core prefill kernel of head size `d` and its key tile (keys per step of a block), or
/// `None` where there is none (the split-K kernels take that head size).
fn prefill_mma_kernel(d: usize) -> Option<(&'static str, usize)> {
    match d {
        256 => Some(("attn_prefill_mma_d256", 32)),
        128 => Some(("attn_prefill_mma_d128", 64)),
        64 => Some(("attn_prefill_mma_d64", 64)),
        32 => Some(("attn_prefill_mma_d32", 64)),
        _ => None,
    }
}

/// How a tensor-core prefill launch divides the context: `(splits, span)`, span `s` covering
/// positions `s·span .. (s + 1)·span`. `blocks` is the grid without splits (KV heads × row tiles),
/// `rows` the real (query, head) rows of one tile, `len` the positions the chunk's last query sees.
///
/// The context is split only while the grid offers fewer than [`MMA_BLOCKS_PER_SM`] blocks per
/// multiprocessor, and only into spans of at least `16·rows` positions (256 to 1024): a split adds
/// `8·head_dim` bytes of workspace traffic per row (written here, read by the reduce) to the
/// `4·span·head_dim` bytes of K/V a tile's span loads and the `4·span·head_dim` flops per row it
/// computes, so such spans keep the workspace below about a tenth of either. With Qwen3-Next's layer
/// (16 query heads, 2 KV heads: 8 rows of a tile per query) on 132 multiprocessors: a chunk of 512
/// queries is 128 blocks; from position 0 (512 positions) it stays whole, after a 4096-position
/// prefix it takes 3 spans of 1536; a single query at position 32767 takes 128 spans of 256, as the
/// split-K decode does; 2048 queries (512 blocks) never split.
fn prefill_spans(
    blocks: usize,
    rows: usize,
    len: usize,
    sms: usize,
    key_tile: usize,
) -> (usize, usize) {
    let want = (MMA_BLOCKS_PER_SM * sms).div_ceil(blocks.max(1));
    let min_span = (16 * rows).clamp(256, 1024);
    let splits = want.min(len / min_span).max(1);
    if splits == 1 {
        return (1, len.max(1));
    }
    let span = len.div_ceil(splits).next_multiple_of(key_tile);
    (len.div_ceil(span), span)
}

/// The shape of one tensor-core prefill launch: its kernel and key tile, and the chunk's queries.
struct PrefillTiles {
    kernel: &'static str,
    key_tile: usize,
    pos0: usize,
    t: usize,
}

impl Gpu {
    /// Whether the tensor-core prefill kernel can take these buffers: it copies q and the pools in
    /// 16-byte pieces and reads the gate and writes the output in bf16 pairs (a slice at an odd
    /// offset takes the split-K kernels instead).
    fn prefill_mma_aligned(
        &self,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        pools: &KvPools<&impl DevicePtr<bf16>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> bool {
        let (q, k, v) = (self.addr(queries.q), self.addr(pools.k), self.addr(pools.v));
        (q | k | v).is_multiple_of(16)
            && (self.addr(queries.gate) | self.addr_mut(out)).is_multiple_of(4)
    }

    /// Causal prefill of one chunk on the tensor cores (`attn_prefill_mma_d*`), plus the reduce when
    /// [`prefill_spans`] splits the context. Same contract as [`Gpu::attention_paged_prefill`], whose
    /// table check it relies on.
    fn attn_prefill_mma(
        &self,
        op: &'static str,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        tiles: PrefillTiles,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let Queries { q, gate } = *queries;
        let KvPools {
            k: k_pool,
            v: v_pool,
        } = cache.pools;
        let block_table = cache.tables;
        let AttnDims {
            hq,
            hkv,
            head_dim: d,
            block_size: bs,
        } = dims;
        let PrefillTiles {
            kernel,
            key_tile,
            pos0,
            t,
        } = tiles;
        ensure(hkv > 0 && hq > 0 && hq % hkv == 0, op, || {
            format!("hq = {hq} must be a positive multiple of hkv = {hkv}")
        })?;
        let num_blocks = check_paged(op, dims, queries, &cache.pools, &*out, t)?;
        if t == 0 {
            return Ok(());
        }
        let group = hq / hkv;
        let row_tiles = (t * group).div_ceil(MMA_ROWS);
        let len = pos0 + t;
        let sms = self.info().multiprocessors as usize;
        let (splits, span) = prefill_spans(
            hkv * row_tiles,
            (t * group).min(MMA_ROWS),
            len,
            sms,
            key_tile,
        );
        ensure(
            hkv <= GRID_YZ_MAX && splits <= GRID_YZ_MAX && (splits == 1 || t <= GRID_YZ_MAX),
            op,
            || format!("{hkv} KV heads, {splits} splits or {t} rows exceed {GRID_YZ_MAX}"),
        )?;
        let (mb_i, pos0_i, t_i) = (
            int(op, "max_blocks", block_table.len())?,
            int(op, "pos0 + t", len).map(|_| pos0 as i32)?,
            int(op, "t·hq / hkv", t * group).map(|_| t as i32)?,
        );
        let (hq_i, hkv_i, bs_i) = (
            int(op, "hq", hq)?,
            int(op, "hkv", hkv)?,
            int(op, "block_size", bs)?,
        );
        let (splits_i, span_i) = (splits as i32, int(op, "span", span)?);
        let scale_log2 = ((d as f64).powf(-0.5) * std::f64::consts::LOG2_E) as f32;
        let smem = (MMA_ROWS + 2 * key_tile) * d * 2;
        let f = self.kernel(kernel)?;
        // Above the default 48 KiB of dynamic shared memory a kernel must opt in (a host-side attribute
        // of the function, no stream operation); head size 256 takes 64 KiB, below sm_86's 99 KiB.
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let s = self.stream();
        // The split workspace, only with splits. SAFETY: plain device allocations; the kernel writes
        // every part_ml slot and the part_o slots of every finite max, the only ones the reduce reads.
        let mut part = if splits > 1 {
            let slots = t * hq * splits;
            Some(unsafe { (s.alloc::<f32>(slots * d)?, s.alloc::<f32>(slots * 2)?) })
        } else {
            None
        };
        let (pop, pmp, _gpart) = match part.as_mut() {
            Some((po, pm)) => {
                let (a, ga) = po.device_ptr_mut(s);
                let (b, gb) = pm.device_ptr_mut(s);
                (a, b, Some((ga, gb)))
            }
            None => (0, 0, None),
        };
        let mut l = self.launch(f);
        l.ptr(q)
            .ptr(k_pool)
            .ptr(v_pool)
            .ptr(block_table)
            .arg(&mb_i)
            .arg(&pos0_i)
            .arg(&t_i)
            .ptr(gate)
            .ptr_mut(out)
            .arg(&pop)
            .arg(&pmp)
            .arg(&hq_i)
            .arg(&hkv_i)
            .arg(&bs_i)
            .arg(&num_blocks)
            .arg(&splits_i)
            .arg(&span_i)
            .arg(&scale_log2);
        // row_tiles ≤ t·hq / hkv, checked to fit an i32 above.
        let grid = (row_tiles as u32, hkv as u32, splits as u32);
        // SAFETY: argument types match the kernel; q, gate, out hold t·hq·head_dim elements and the
        // pools whole blocks (checked above), all aligned as the kernel needs (the caller checked);
        // the kernel reads at most max_blocks table ids and masks ids at or beyond num_blocks; with
        // splits the workspace holds t·hq·splits slots (without, the kernel never touches it); shared
        // memory opted in above.
        unsafe { l.launch(cfg(grid, MMA_THREADS, smem as u32)) }?;
        drop(l);
        if splits > 1 {
            let d_i = d as i32;
            let mut l = self.launch(self.kernel("attn_paged_reduce")?);
            l.arg(&pop)
                .arg(&pmp)
                .ptr(gate)
                .ptr_mut(out)
                .arg(&hq_i)
                .arg(&d_i)
                .arg(&splits_i);
            // SAFETY: argument types match the kernel; gate and out hold t·hq·head_dim elements; the
            // block has at least head_dim threads in each of its groups.
            unsafe { l.launch(cfg((hq as u32, t as u32, 1), reduce_threads(d), 0)) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The splits cover the longest context in spans of whole granules, fill the multiprocessors
    /// (in one wave) where the context has enough granules, and never give a split nothing to do at
    /// the longest context.
    #[test]
    fn decode_splits_cover_the_context_and_fill_the_grid() {
        for sms in [82, 132] {
            for blocks in [1, 2, 16, 64, 300] {
                for max_len in [1, 31, 32, 33, 576, 4096, 16_384, 262_144] {
                    let (splits, max_split) = decode_splits(max_len, blocks, sms);
                    assert!(splits >= 1 && max_split % ATTN_MIN_SPLIT == 0);
                    assert!(splits * max_split >= max_len, "{max_len} {blocks} {sms}");
                    assert!(
                        (splits - 1) * max_split < max_len,
                        "an idle split at {max_len}"
                    );
                    let slots = DECODE_BLOCKS_PER_SM * sms;
                    assert!(splits == 1 || splits * blocks <= slots, "a second wave");
                    assert!(
                        max_split == ATTN_MIN_SPLIT
                            || blocks > slots
                            || 2 * splits * blocks >= slots,
                        "{max_len} {blocks} {sms}: {splits}"
                    );
                }
            }
        }
        assert_eq!(decode_splits(576, 2, 132), (18, 32));
        assert_eq!(decode_splits(16_384, 2, 132), (128, 128));
    }
}
