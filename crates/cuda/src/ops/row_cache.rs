//! The VRAM row cache of QSA layers whose K/V rows live in pinned host memory (`--qsa-kv-offload`,
//! `kernels/qsa_cache.cu` and the cached form of `qsa_attn_partial` in `kernels/qsa.cu`).
//!
//! Offloaded K/V rows are read by the attention through unified addressing, over the host link. A
//! decode step's selections change little from one step to the next (about 70% of a row's selected
//! positions stay), so each QSA layer keeps recently read rows in a direct-mapped cache in VRAM, keyed
//! by the PHYSICAL cache slot `slot = table[pos / bs] · bs + pos % bs` (sequences that share prefix
//! blocks share cached rows): slot `s` lives in line `s % L`. The state of one layer ([`RowCache`],
//! borrowed by the ops as [`RowCacheBufs`]) is all on the device, so a recorded CUDA graph replays it
//! without host parameters: `tags [L]` u64 (`slot + 1`, 0 empty), `hitmark [L]` u32, `claim [L]` u64
//! (`epoch << 32 | slot`), `epoch [1]` u32, `stats [2]` u64 (hits, misses) and the rows `k`, `v`
//! `[L, hkv·d]` bf16. The kernels reproduce the state transitions of the CPU twin,
//! `sanmai_cpu::ops::row_cache::RowCache`, exactly (the GPU tests compare the two).
//!
//! # One step of one layer
//! 1. [`Gpu::qsa_rc_invalidate`], every step whatever its shape, after all of the step's K/V stores:
//!    each stored slot empties its line if the line holds it, then the epoch advances (at `u32::MAX`
//!    hitmarks and claims are zeroed and the epoch restarts at 1). So the cache never holds a row
//!    older than its slot's last store. A block rewritten between steps (`copy_block`) goes through
//!    [`Gpu::qsa_rc_invalidate_range`] (no epoch bump), and a staged prefill that overwrote the
//!    rows' memory through [`Gpu::qsa_rc_invalidate_all`] (the tags zeroed).
//! 2. [`Gpu::qsa_rc_plan`], decode-shaped steps only (at most `MAX_CACHED_ROWS` query rows), after
//!    the selection: every row the attention will read is a hit (`tag == slot + 1`: the line's
//!    hitmark becomes the epoch) or claims its line (`claim = max(claim, epoch << 32 | slot)`).
//! 3. [`Gpu::qsa_attention_gather_decode_cached`]: each selected row is a hit when the line's hitmark
//!    is the epoch and its tag the slot (then it comes from the line), else it comes from the host
//!    pool, and when the line's claim is this read's and the line has no hit this step, the read
//!    copies the row into the line and sets the tag.
//!
//! # Why the output is bit for bit the uncached attention's
//! The cached kernel is the uncached one with one difference: the address a row is loaded from. A
//! line's row is a byte copy of the pool row its tag names, made by an earlier step's fill; phase 1
//! empties the line whenever that slot is stored to, so a tagged line always equals the pool's current
//! row. In phase 3 the lines that can hit (hitmark = epoch) are never written, and the lines that are
//! written are never read as hits (their hitmark is not the epoch, and their tag is not even read),
//! so every read sees the same bytes as the pool holds, whatever the order of the blocks. The
//! arithmetic on them is the same code (one load path, the pointer chosen per row), so the scores,
//! the weights and the output are the same bits. Every head block of a row fills its KV head's part
//! of a claimed line (K in the score loop, V in the V loop, V loaded even when its weight is 0), so the
//! whole row is in the line when the step ends; blocks that fill one line write the same bytes (the
//! claim names one slot).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{AttnDims, KvPools, PagedCache, Queries, Selection};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Most lines one layer's cache may have (line indices are 32-bit in the kernels).
pub const ROW_CACHE_MAX_LINES: usize = u32::MAX as usize;

const GRID_YZ_MAX: usize = 65535;

/// One layer's row-cache buffers as the ops take them (see the module doc): `tags`, `claim` `[lines]`
/// and `stats` `[2]` u64, `hitmark` `[lines]` and `epoch` `[1]` u32, the rows `k` and `v`
/// `[lines, row]` bf16 (`row` = `hkv·head_dim` of the layer; only the cached attention touches them,
/// so they may live in another allocation than the rest, e.g. a staging arena). Build it from a
/// [`RowCache`] ([`RowCache::bufs`], [`RowCache::bufs_with_rows`]) or from buffers of one's own.
pub struct RowCacheBufs<'a, W: DevicePtrMut<u64>, H: DevicePtrMut<u32>, R: DevicePtrMut<bf16>> {
    pub tags: &'a mut W,
    pub hitmark: &'a mut H,
    pub claim: &'a mut W,
    pub epoch: &'a mut H,
    pub stats: &'a mut W,
    pub k: &'a mut R,
    pub v: &'a mut R,
    /// Lines `L` (1 ..= [`ROW_CACHE_MAX_LINES`]).
    pub lines: usize,
    /// Elements of one row of `k` (and of `v`).
    pub row: usize,
}

/// The kernels' `lines` argument after checking the metadata buffers of `rc` (the rows are checked
/// where they are used).
fn check_meta(
    op: &'static str,
    rc: &RowCacheBufs<'_, impl DevicePtrMut<u64>, impl DevicePtrMut<u32>, impl DevicePtrMut<bf16>>,
) -> Result<i64> {
    let lines = rc.lines;
    ensure((1..=ROW_CACHE_MAX_LINES).contains(&lines), op, || {
        format!("{lines} lines: must be in 1..={ROW_CACHE_MAX_LINES}")
    })?;
    check_len(op, "tags", rc.tags, lines)?;
    check_len(op, "hitmark", rc.hitmark, lines)?;
    check_len(op, "claim", rc.claim, lines)?;
    check_len(op, "epoch", rc.epoch, 1)?;
    check_len(op, "stats", rc.stats, 2)?;
    Ok(lines as i64)
}

impl Gpu {
    /// Phase 1 of a step (every step, whatever its shape, after all of its K/V stores): empties the
    /// line of each of the `n` slots in `stored` (the step's K/V write destinations, read on the
    /// device; destinations past the pool are harmless) that holds it, then advances the epoch (at
    /// `u32::MAX`: hitmarks and claims zeroed, the epoch back to 1). One block.
    pub fn qsa_rc_invalidate(
        &self,
        rc: &mut RowCacheBufs<
            '_,
            impl DevicePtrMut<u64>,
            impl DevicePtrMut<u32>,
            impl DevicePtrMut<bf16>,
        >,
        stored: &impl DevicePtr<u32>,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "qsa_rc_invalidate";
        let lines = check_meta(OP, rc)?;
        check_len(OP, "stored", stored, n)?;
        let ni = int(OP, "n", n)?;
        let mut l = self.launch(self.kernel("qsa_rc_invalidate")?);
        l.ptr(stored)
            .arg(&ni)
            .ptr_mut(&mut *rc.tags)
            .ptr_mut(&mut *rc.hitmark)
            .ptr_mut(&mut *rc.claim)
            .ptr_mut(&mut *rc.epoch)
            .arg(&lines);
        // SAFETY: argument types match the kernel; `stored` holds n slots, the metadata `lines`
        // entries (every line index is a slot modulo lines); one block, as the kernel requires.
        unsafe { l.launch(cfg((1, 1, 1), 1024, 0)) }?;
        Ok(())
    }

    /// Empties the lines of slots `base_slot .. base_slot + n` that hold them, without advancing the
    /// epoch: for rows rewritten outside a step's K/V write, e.g. the destination block of a
    /// `copy_block` (`base_slot = block · block_size`, `n = block_size`). Call it between steps (before
    /// the next step's [`Gpu::qsa_rc_invalidate`]); it is then the twin's invalidate of those slots
    /// folded into that step's.
    pub fn qsa_rc_invalidate_range(
        &self,
        rc: &mut RowCacheBufs<
            '_,
            impl DevicePtrMut<u64>,
            impl DevicePtrMut<u32>,
            impl DevicePtrMut<bf16>,
        >,
        base_slot: usize,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "qsa_rc_invalidate_range";
        let lines = check_meta(OP, rc)?;
        ensure(base_slot as u64 + n as u64 <= 1 << 32, OP, || {
            format!("slots {base_slot} + {n} exceed 32 bits")
        })?;
        if n == 0 {
            return Ok(());
        }
        let (base, ni) = (base_slot as u32, int(OP, "n", n)?);
        let mut l = self.launch(self.kernel("qsa_rc_invalidate_range")?);
        l.arg(&base).arg(&ni).ptr_mut(&mut *rc.tags).arg(&lines);
        // SAFETY: argument types match the kernel; one thread per slot, each line index a slot modulo
        // lines.
        unsafe { l.launch(cfg((grid_u32(OP, n.div_ceil(256))?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Empties every line (the tags zeroed, a memset on the stream): the memory of the rows was
    /// overwritten (a staged prefill in the arena they live in) or their pool was reset. The epoch,
    /// hitmarks and claims stay, as the twin's `invalidate_all`.
    pub fn qsa_rc_invalidate_all(
        &self,
        rc: &mut RowCacheBufs<
            '_,
            impl DevicePtrMut<u64>,
            impl DevicePtrMut<u32>,
            impl DevicePtrMut<bf16>,
        >,
    ) -> Result<()> {
        check_meta("qsa_rc_invalidate_all", rc)?;
        self.stream().memset_zeros(&mut *rc.tags)?;
        Ok(())
    }

    /// Phase 2 of a decode-shaped step, after [`Gpu::qsa_rc_invalidate`] and the selection, before
    /// [`Gpu::qsa_attention_gather_decode_cached`] with the same selection and tables: every row the
    /// attention will read (row `r`'s `sel[r·stride .. + min(counts[r], stride)]`, through row `r` of
    /// `tables` `[rows, table_stride]` with `block_size` slots a block) hits its line (hitmark = epoch)
    /// or claims it (`claim = max(claim, epoch << 32 | slot)`), and is counted in `stats` (hits,
    /// misses), duplicates included.
    pub fn qsa_rc_plan(
        &self,
        rc: &mut RowCacheBufs<
            '_,
            impl DevicePtrMut<u64>,
            impl DevicePtrMut<u32>,
            impl DevicePtrMut<bf16>,
        >,
        selection: &Selection<'_, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        tables: &impl DevicePtr<u32>,
        table_stride: usize,
        block_size: usize,
    ) -> Result<()> {
        const OP: &str = "qsa_rc_plan";
        let lines = check_meta(OP, rc)?;
        let Selection {
            sel,
            stride,
            counts,
            rows,
            ..
        } = *selection;
        ensure(block_size > 0, OP, || "block size must be positive".into())?;
        ensure(rows <= GRID_YZ_MAX, OP, || {
            "too many rows in one call".into()
        })?;
        check_len(OP, "sel", sel, rows * stride)?;
        check_len(OP, "counts", counts, rows)?;
        check_len(OP, "tables", tables, rows * table_stride)?;
        if rows == 0 || stride == 0 {
            return Ok(());
        }
        let (ss, bs) = (
            int(OP, "stride", stride)?,
            int(OP, "block_size", block_size)?,
        );
        let ts = table_stride as i64;
        let mut l = self.launch(self.kernel("qsa_rc_plan")?);
        l.ptr(tables)
            .arg(&ts)
            .ptr(sel)
            .arg(&ss)
            .ptr(counts)
            .arg(&bs)
            .ptr_mut(&mut *rc.tags)
            .ptr_mut(&mut *rc.hitmark)
            .ptr_mut(&mut *rc.claim)
            .ptr_mut(&mut *rc.epoch)
            .ptr_mut(&mut *rc.stats)
            .arg(&lines);
        let grid = (grid_u32(OP, stride.div_ceil(256))?, rows as u32, 1);
        // SAFETY: argument types match the kernel; lengths checked; the selected positions come from
        // the top-k (each below its row's context, which its table row covers), line indices are
        // slots modulo lines.
        unsafe { l.launch(cfg(grid, 256, 0)) }?;
        Ok(())
    }

    /// [`Gpu::qsa_attention_gather_decode`] through the row cache `rc` of the layer (phase 3, after
    /// [`Gpu::qsa_rc_plan`] of the same selection and tables): hits read the cache's rows, misses
    /// the pools, and claimed misses fill their lines. The output is bit for bit the uncached op's
    /// (see the module doc). `rc.row` must be `hkv·head_dim` and the pools at most 2³² rows (slots
    /// are 32-bit).
    pub fn qsa_attention_gather_decode_cached(
        &self,
        dims: AttnDims,
        queries: &Queries<'_, impl DevicePtr<bf16>>,
        cache: &PagedCache<'_, impl DevicePtr<bf16>, impl DevicePtr<u32>>,
        sel: &Selection<'_, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        rc: &mut RowCacheBufs<
            '_,
            impl DevicePtrMut<u64>,
            impl DevicePtrMut<u32>,
            impl DevicePtrMut<bf16>,
        >,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "qsa_attention_gather_decode_cached";
        check_meta(OP, rc)?;
        let row = dims.hkv * dims.head_dim;
        ensure(rc.row == row, OP, || {
            format!("cache rows of {} elements, the layer's are {row}", rc.row)
        })?;
        check_len(OP, "rc.k", rc.k, rc.lines * row)?;
        check_len(OP, "rc.v", rc.v, rc.lines * row)?;
        let pool_rows = cache.pools.k.len() / row.max(1);
        ensure(pool_rows as u64 <= 1 << 32, OP, || {
            format!("{pool_rows} pool rows: slots must fit 32 bits")
        })?;
        check_len(OP, "tables", cache.tables, sel.rows * cache.stride)?;
        self.gather((OP, dims), queries, cache, sel, Some(rc), out)
    }
}

/// One layer's row cache, owned: the metadata and (unless the rows live elsewhere, see
/// [`RowCache::without_rows`]) the rows, allocated zeroed (every line empty, epoch 0) on a [`Gpu`]'s
/// stream. The backend holds one per QSA layer; the ops borrow it as [`RowCacheBufs`].
pub struct RowCache {
    tags: CudaSlice<u64>,
    hitmark: CudaSlice<u32>,
    claim: CudaSlice<u64>,
    epoch: CudaSlice<u32>,
    stats: CudaSlice<u64>,
    rows: Option<KvPools<CudaSlice<bf16>>>,
    lines: usize,
    row: usize,
}

/// A [`RowCache`]'s state on the host ([`RowCache::download`]), field for field the twin's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowCacheState {
    pub tags: Vec<u64>,
    pub hitmarks: Vec<u32>,
    pub claims: Vec<u64>,
    pub epoch: u32,
    pub hits: u64,
    pub misses: u64,
    /// The K rows `[lines, row]`, bf16 bits (empty when the rows live elsewhere).
    pub k: Vec<u16>,
    /// The V rows `[lines, row]`, bf16 bits (empty when the rows live elsewhere).
    pub v: Vec<u16>,
}

impl RowCache {
    /// Bytes of the metadata a line takes (tag, hitmark and claim).
    pub const META_BYTES_PER_LINE: usize = 8 + 4 + 8;

    /// A cache of `lines` lines (1 ..= [`ROW_CACHE_MAX_LINES`]) of rows of `row` elements
    /// (`hkv·head_dim`), its K and V rows included.
    pub fn new(gpu: &Gpu, lines: usize, row: usize) -> Result<Self> {
        let mut c = Self::without_rows(gpu, lines, row)?;
        c.rows = Some(KvPools {
            k: gpu.zeros(lines * row)?,
            v: gpu.zeros(lines * row)?,
        });
        Ok(c)
    }

    /// The metadata only: the rows live in memory of the caller's (e.g. a staging arena), passed
    /// to every use through [`RowCache::bufs_with_rows`].
    pub fn without_rows(gpu: &Gpu, lines: usize, row: usize) -> Result<Self> {
        const OP: &str = "RowCache::new";
        ensure((1..=ROW_CACHE_MAX_LINES).contains(&lines), OP, || {
            format!("{lines} lines: must be in 1..={ROW_CACHE_MAX_LINES}")
        })?;
        ensure(row > 0, OP, || "rows must be positive".into())?;
        Ok(Self {
            tags: gpu.zeros(lines)?,
            hitmark: gpu.zeros(lines)?,
            claim: gpu.zeros(lines)?,
            epoch: gpu.zeros(1)?,
            stats: gpu.zeros(2)?,
            rows: None,
            lines,
            row,
        })
    }

    /// Lines `L`.
    pub fn lines(&self) -> usize {
        self.lines
    }

    /// Elements of one row.
    pub fn row_len(&self) -> usize {
        self.row
    }

    /// Whether the cache owns its rows ([`RowCache::new`]).
    pub fn has_rows(&self) -> bool {
        self.rows.is_some()
    }

    /// Device bytes this cache owns (metadata, counters and the rows it holds).
    pub fn device_bytes(&self) -> usize {
        let rows = if self.has_rows() {
            2 * self.lines * self.row * std::mem::size_of::<bf16>()
        } else {
            0
        };
        self.lines * Self::META_BYTES_PER_LINE + 4 + 16 + rows
    }

    /// The buffers, its own rows included; an error when the rows live elsewhere
    /// ([`RowCache::without_rows`]: use [`RowCache::bufs_with_rows`]).
    pub fn bufs(
        &mut self,
    ) -> Result<RowCacheBufs<'_, CudaSlice<u64>, CudaSlice<u32>, CudaSlice<bf16>>> {
        let Some(KvPools { k, v }) = self.rows.as_mut() else {
            return Err(crate::error::CudaError::Shape {
                op: "RowCache::bufs",
                msg: "the rows live elsewhere: use bufs_with_rows".into(),
            });
        };
        Ok(RowCacheBufs {
            tags: &mut self.tags,
            hitmark: &mut self.hitmark,
            claim: &mut self.claim,
            epoch: &mut self.epoch,
            stats: &mut self.stats,
            k,
            v,
            lines: self.lines,
            row: self.row,
        })
    }

    /// The metadata with the rows `k` and `v` (`[lines, row]` each) of the caller's.
    pub fn bufs_with_rows<'a, R: DevicePtrMut<bf16>>(
        &'a mut self,
        k: &'a mut R,
        v: &'a mut R,
    ) -> RowCacheBufs<'a, CudaSlice<u64>, CudaSlice<u32>, R> {
        RowCacheBufs {
            tags: &mut self.tags,
            hitmark: &mut self.hitmark,
            claim: &mut self.claim,
            epoch: &mut self.epoch,
            stats: &mut self.stats,
            k,
            v,
            lines: self.lines,
            row: self.row,
        }
    }

    /// `(hits, misses)` counted so far (waits for the stream).
    pub fn counts(&self, gpu: &Gpu) -> Result<(u64, u64)> {
        let s = gpu.download(&self.stats)?;
        Ok((s[0], s[1]))
    }

    /// The whole state on the host (waits for the stream), for tests against the twin.
    pub fn download(&self, gpu: &Gpu) -> Result<RowCacheState> {
        let stats = gpu.download(&self.stats)?;
        let (k, v) = match &self.rows {
            Some(r) => (bits(gpu.download(&r.k)?), bits(gpu.download(&r.v)?)),
            None => (Vec::new(), Vec::new()),
        };
        Ok(RowCacheState {
            tags: gpu.download(&self.tags)?,
            hitmarks: gpu.download(&self.hitmark)?,
            claims: gpu.download(&self.claim)?,
            epoch: gpu.download(&self.epoch)?[0],
            hits: stats[0],
            misses: stats[1],
            k,
            v,
        })
    }

    /// Sets the epoch (queued on the stream), for tests of the wrap at `u32::MAX`.
    pub fn set_epoch(&mut self, gpu: &Gpu, epoch: u32) -> Result<()> {
        gpu.stream().memcpy_htod(&[epoch][..], &mut self.epoch)?;
        Ok(())
    }
}

/// The bits of bf16 values.
fn bits(x: Vec<bf16>) -> Vec<u16> {
    x.into_iter().map(bf16::to_bits).collect()
}
