//! The caches: a K/V block pool pair per attention layer (`[num_blocks, block_size, kv_heads·head_dim]`
//! bf16, the CPU backend's layout) and the GDN state slots, one conv pool (`[slots, kernel,
//! conv_dim]` bf16: a ring of projection outputs, exact in bf16, input `x_q` at entry `q mod kernel`)
//! and one recurrent pool (`[slots, hv, dk, dv]` f32) per GDN layer. Slot pools grow on demand
//! (doubling, contents copied on the device) until [`StateSlots::reserve`] sizes them once and
//! fixes them (the server's memory plan does, at start); a fresh slot is zeroed. QSA layers also keep an
//! index-key pool (`[num_blocks, block_size, dI + 2]` bytes: dI fp8 e4m3 bytes and the bf16 scale per
//! position) in the same blocks as their K/V, so `copy_block` carries it; PLE layers keep their conv
//! state (`[slots, (kernel−1)·dilation, S·H]` f32, normed conv inputs) in the state slots, so
//! `copy_state` carries it.

use std::collections::HashMap;

use cudarc::driver::{
    result, CudaSlice, CudaViewMut, DevicePtr, DeviceRepr, DeviceSlice, ValidAsZeroBits,
};
use half::bf16;
use sanmai_model::backend::{CacheSpec, GdnShape, KvHostStats, PleShape, RowCacheCounts};

use super::host_rows::{pin_rows, Rows};
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{RowCache, RowCacheBufs};

/// The K and V pools of one attention layer.
pub(crate) struct KvPool {
    pub k: Rows,
    pub v: Rows,
    /// QSA index keys `[num_blocks, block_size, idx_row]` bytes (`None` without QSA).
    pub idx: Option<CudaSlice<u8>>,
}

#[derive(Default)]
pub(crate) struct KvPools {
    pub block_size: usize,
    /// `kv_heads · head_dim`.
    pub row: usize,
    pub num_blocks: usize,
    /// Bytes of one index-key entry, `dI + 2` (0 without QSA).
    pub idx_row: usize,
    pub layers: HashMap<usize, KvPool>,
    /// QSA selections recorded while tracing is on (see `CudaBackend::trace_qsa`).
    pub qsa_trace: Option<Vec<QsaPick>>,
    /// The VRAM arena of K/V rows kept in host memory (`None` when they are on the device).
    pub arena: Option<Arena>,
    /// The topk of the QSA layers once one ran in one launch (`None` before): a recorded decode
    /// step whose contexts are all within it may have run them so (`graph`'s key).
    pub qsa_whole_topk: Option<usize>,
}

/// The staging arena of K/V rows kept in host memory (`KvHost::row_cache_rows` rows of K and of
/// V): a prefill step stages the rows a QSA layer reads into it and reads them from there, as from
/// the pools through the identity table. Between prefills it holds each QSA layer's row cache
/// (`lines` rows of it a layer, in layer order), which a staging empties.
pub(crate) struct Arena {
    pub k: CudaSlice<bf16>,
    pub v: CudaSlice<bf16>,
    /// Positions it holds: whole blocks.
    pub rows: usize,
    /// `0, 1, 2, …` (`rows / block_size` ids): the block table of the staged rows.
    pub table: CudaSlice<u32>,
    /// Each QSA layer's row-cache state (its rows in the arena), `(layer, cache)` in layer order;
    /// empty when decode steps read every row from host memory (`KvHost::row_cache` off).
    pub caches: Vec<(usize, RowCache)>,
    /// Lines of each layer's cache.
    pub lines: usize,
    /// Elements of one K (or V) row.
    pub row: usize,
    /// Rows read from host memory by uncached reads and stagings, since the caches were made.
    pub host_rows: u64,
    /// QSA layers of the stage, and the topk their calls select (set by the first call): what a
    /// replayed decode step without row caches reads.
    pub layers: usize,
    pub topk: usize,
    /// The counters as last read from the device, and when.
    pub read: Option<(std::time::Instant, KvHostStats)>,
}

impl super::CudaBackend {
    /// Bytes of one GDN state slot over `layers` GDN layers of shape `g`: conv state (bf16) plus
    /// recurrent state (f32). `Model::state_bytes(CACHE_ELEM_BYTES)` counts both at 2 bytes a value;
    /// this is the exact figure.
    pub fn state_bytes_per_slot(g: &GdnShape, layers: usize) -> usize {
        layers * (2 * conv_len(g) + 4 * ssm_len(g))
    }
}

impl Arena {
    /// The counters ([`Backend::kv_host_stats`]): read from the device (a synchronisation) at most
    /// once a second, else as last read.
    ///
    /// [`Backend::kv_host_stats`]: sanmai_model::Backend::kv_host_stats
    pub fn stats(&mut self, gpu: &Gpu) -> Result<KvHostStats> {
        if let Some((at, s)) = &self.read {
            if at.elapsed() < std::time::Duration::from_secs(1) {
                return Ok(s.clone());
            }
        }
        let mut layers = Vec::with_capacity(self.caches.len());
        for (layer, rc) in &self.caches {
            let (hits, misses) = rc.counts(gpu)?;
            layers.push(RowCacheCounts {
                layer: *layer,
                hits,
                misses,
            });
        }
        let misses: u64 = layers.iter().map(|c| c.misses).sum();
        let row_bytes = (2 * self.row * std::mem::size_of::<bf16>()) as u64;
        let stats = KvHostStats {
            layers,
            host_bytes_read: (self.host_rows + misses) * row_bytes,
        };
        self.read = Some((std::time::Instant::now(), stats.clone()));
        Ok(stats)
    }

    /// Runs `f` on layer `layer`'s cache and its rows in the arena, as the row-cache ops take them;
    /// `None` when the layer has no cache.
    pub fn with_cache<T>(
        &mut self,
        layer: usize,
        f: impl FnOnce(&mut CacheBufs<'_, '_>) -> Result<T>,
    ) -> Option<Result<T>> {
        let i = self.caches.iter().position(|(l, _)| *l == layer)?;
        let span = i * self.lines * self.row..(i + 1) * self.lines * self.row;
        let (mut k, mut v) = (self.k.slice_mut(span.clone()), self.v.slice_mut(span));
        let mut rc = self.caches[i].1.bufs_with_rows(&mut k, &mut v);
        Some(f(&mut rc))
    }

    /// Runs `f` on every layer's cache.
    pub fn each_cache(&mut self, f: impl Fn(&mut CacheBufs<'_, '_>) -> Result<()>) -> Result<()> {
        let layers: Vec<usize> = self.caches.iter().map(|(l, _)| *l).collect();
        for l in layers {
            self.with_cache(l, &f).transpose()?;
        }
        Ok(())
    }
}

/// One layer's row cache in the arena, as the ops take it.
pub(crate) type CacheBufs<'a, 'v> =
    RowCacheBufs<'a, CudaSlice<u64>, CudaSlice<u32>, CudaViewMut<'v, bf16>>;

/// One query row's QSA selection: `(layer, state slot, position, selected positions ascending)`.
pub type QsaPick = (usize, usize, usize, Vec<usize>);

impl KvPools {
    /// The pools of attention layer `layer`.
    pub fn pool(&self, layer: usize) -> Result<&KvPool> {
        self.layers.get(&layer).ok_or_else(|| no_pool(layer))
    }

    /// The pools of attention layer `layer`, to write.
    pub fn pool_mut(&mut self, layer: usize) -> Result<&mut KvPool> {
        self.layers.get_mut(&layer).ok_or_else(|| no_pool(layer))
    }

    /// Device bytes of the pools and the arena (K/V rows in host memory not counted).
    pub fn bytes(&self) -> usize {
        let on_device = |r: &Rows| if r.on_host() { 0 } else { 2 * r.len() };
        let arena = self
            .arena
            .as_ref()
            .map_or(0, |a| 2 * (a.k.len() + a.v.len()));
        self.layers
            .values()
            .map(|p| on_device(&p.k) + on_device(&p.v) + p.idx.as_ref().map_or(0, |i| i.len()))
            .sum::<usize>()
            + arena
    }
}

fn no_pool(layer: usize) -> CudaError {
    CudaError::Shape {
        op: "kv_cache",
        msg: format!("no K/V pool for layer {layer}: init_cache first"),
    }
}

/// The state pools of one GDN layer.
pub(crate) struct StatePool {
    pub conv: CudaSlice<bf16>,
    pub ssm: CudaSlice<f32>,
}

#[derive(Default)]
pub(crate) struct StateSlots {
    pub shape: Option<GdnShape>,
    pub layers: HashMap<usize, StatePool>,
    /// The PLE conv's shape and its state pool per PLE layer (`[cap, (kernel−1)·dilation, S·H]` f32).
    pub ple_shape: Option<PleShape>,
    pub ple: HashMap<usize, CudaSlice<f32>>,
    /// Slots the pools hold.
    pub cap: usize,
    /// The pools were sized by [`StateSlots::reserve`]: they do not grow.
    fixed: bool,
    pub live: Vec<bool>,
    free: Vec<usize>,
}

/// Conv state values of one slot of one layer: a ring of `kernel` inputs (one more than the conv
/// reads, so a decode token writes its input where no reader of that step looks).
pub(crate) fn conv_len(g: &GdnShape) -> usize {
    g.conv_kernel * (2 * g.num_k_heads * g.k_head_dim + g.num_v_heads * g.v_head_dim)
}

/// PLE conv state values of one slot of one layer.
pub(crate) fn ple_len(p: &PleShape) -> usize {
    p.state_rows() * p.channels()
}

/// Recurrent state values of one slot of one layer.
pub(crate) fn ssm_len(g: &GdnShape) -> usize {
    g.num_v_heads * g.k_head_dim * g.v_head_dim
}

/// Copies `n` elements from element `src` to element `dst` of `buf` (or of `to`, when given).
fn copy_within<T: DeviceRepr, B: DevicePtr<T>>(
    gpu: &Gpu,
    buf: &B,
    to: Option<&B>,
    src: usize,
    dst: usize,
    n: usize,
) -> Result<()> {
    let sz = std::mem::size_of::<T>();
    let s = gpu.stream();
    let (sp, _g) = buf.device_ptr(s);
    let dp = to.map_or(sp, |t| t.device_ptr(s).0);
    // SAFETY: the caller keeps both ranges inside their buffers; the ranges of one buffer are disjoint.
    unsafe {
        result::memcpy_dtod_async(
            dp + (dst * sz) as u64,
            sp + (src * sz) as u64,
            n * sz,
            s.cu_stream(),
        )
    }?;
    Ok(())
}

/// Zeroes `n` elements from element `at` of `buf`.
fn zero<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &Gpu,
    buf: &CudaSlice<T>,
    at: usize,
    n: usize,
) -> Result<()> {
    let sz = std::mem::size_of::<T>();
    let s = gpu.stream();
    let (p, _g) = buf.device_ptr(s);
    // SAFETY: the range lies inside `buf` (callers pass slot ranges below the capacity).
    unsafe { result::memset_d8_async(p + (at * sz) as u64, 0, n * sz, s.cu_stream()) }?;
    Ok(())
}

impl KvPools {
    pub fn init(&mut self, gpu: &Gpu, spec: &CacheSpec) -> Result<()> {
        let row = spec.num_kv_heads * spec.head_dim;
        let n = (spec.num_blocks * spec.block_size * row).max(1);
        self.layers.clear();
        self.block_size = spec.block_size;
        self.row = row;
        self.num_blocks = spec.num_blocks;
        self.idx_row = if spec.index_head_dim > 0 {
            spec.index_head_dim + 2
        } else {
            0
        };
        let ni = (spec.num_blocks * spec.block_size * self.idx_row).max(1);
        // The QSA layers' K and V rows may live in one pinned host pool instead.
        let count = 2 * spec.attn_layers.len();
        let mut rows = match &spec.kv_host {
            Some(host) if self.idx_row > 0 => pin_rows(gpu, host, count, n)?,
            _ => (0..count)
                .map(|_| gpu.zeros(n).map(Rows::Device))
                .collect::<Result<Vec<_>>>()?,
        }
        .into_iter();
        for &l in &spec.attn_layers {
            let (k, v) = (rows.next(), rows.next());
            let pool = KvPool {
                k: k.expect("two row pools a layer"),
                v: v.expect("two row pools a layer"),
                idx: if self.idx_row > 0 {
                    Some(gpu.zeros(ni)?)
                } else {
                    None
                },
            };
            self.layers.insert(l, pool);
        }
        self.arena = None;
        if let Some(host) = spec.kv_host.as_ref().filter(|_| self.idx_row > 0) {
            let bs = spec.block_size.max(1);
            let blocks = host.row_cache_rows / bs;
            let layers = spec.attn_layers.len();
            // The cache's rows split evenly over the layers (whole rows a layer).
            let lines = host.row_cache_rows / layers.max(1);
            {
                let ids: Vec<u32> = (0..blocks.max(1) as u32).collect();
                let mut layer_ids = spec.attn_layers.clone();
                layer_ids.sort_unstable();
                let caches = match host.row_cache && lines > 0 {
                    true => layer_ids
                        .into_iter()
                        .map(|l| Ok((l, RowCache::without_rows(gpu, lines, row)?)))
                        .collect::<Result<Vec<_>>>()?,
                    false => Vec::new(),
                };
                self.arena = Some(Arena {
                    k: gpu.zeros(((blocks * bs).max(lines * layers) * row).max(1))?,
                    v: gpu.zeros(((blocks * bs).max(lines * layers) * row).max(1))?,
                    rows: blocks * bs,
                    table: gpu.upload(&ids)?,
                    caches,
                    lines,
                    row,
                    host_rows: 0,
                    layers,
                    topk: 0,
                    read: None,
                });
            }
        }
        Ok(())
    }

    pub fn copy_block(&mut self, gpu: &Gpu, src: u32, dst: u32) -> Result<()> {
        let n = self.block_size * self.row;
        if src as usize >= self.num_blocks || dst as usize >= self.num_blocks {
            return Err(CudaError::Shape {
                op: "copy_block",
                msg: format!("block {src} or {dst} outside a pool of {}", self.num_blocks),
            });
        }
        if src == dst {
            return Ok(());
        }
        // The destination block's rows change: its slots leave every layer's row cache.
        let bs = self.block_size;
        if let Some(a) = self.arena.as_mut() {
            a.each_cache(|rc| gpu.qsa_rc_invalidate_range(rc, dst as usize * bs, bs))?;
        }
        let (s, d) = (src as usize * n, dst as usize * n);
        let ni = self.block_size * self.idx_row;
        for p in self.layers.values() {
            copy_within(gpu, &p.k, None, s, d, n)?;
            copy_within(gpu, &p.v, None, s, d, n)?;
            if let Some(idx) = &p.idx {
                copy_within(gpu, idx, None, src as usize * ni, dst as usize * ni, ni)?;
            }
        }
        Ok(())
    }
}

impl StateSlots {
    /// (Re)allocates the pools for the spec's GDN layers at the current capacity, zeroed.
    pub fn init(&mut self, gpu: &Gpu, spec: &CacheSpec) -> Result<()> {
        self.shape = Some(spec.gdn);
        self.layers.clear();
        let cap = self.cap;
        self.cap = 0;
        for &l in &spec.gdn_layers {
            self.layers.insert(
                l,
                StatePool {
                    conv: gpu.zeros(1)?,
                    ssm: gpu.zeros(1)?,
                },
            );
        }
        self.ple_shape = spec.ple.filter(|_| !spec.ple_layers.is_empty());
        self.ple.clear();
        if self.ple_shape.is_some() {
            for &l in &spec.ple_layers {
                self.ple.insert(l, gpu.zeros(1)?);
            }
        }
        self.grow(gpu, cap)
    }

    /// Makes the pools hold at least `cap` slots, keeping the contents of the existing ones.
    fn grow(&mut self, gpu: &Gpu, cap: usize) -> Result<()> {
        if cap <= self.cap && self.cap > 0 {
            return Ok(());
        }
        if let Some(g) = self.shape {
            let (cl, sl) = (conv_len(&g), ssm_len(&g));
            for p in self.layers.values_mut() {
                let conv: CudaSlice<bf16> = gpu.zeros((cap * cl).max(1))?;
                let ssm: CudaSlice<f32> = gpu.zeros((cap * sl).max(1))?;
                if self.cap > 0 {
                    copy_within(gpu, &p.conv, Some(&conv), 0, 0, self.cap * cl)?;
                    copy_within(gpu, &p.ssm, Some(&ssm), 0, 0, self.cap * sl)?;
                }
                *p = StatePool { conv, ssm };
            }
        }
        if let Some(ps) = self.ple_shape {
            let pl = ple_len(&ps);
            for p in self.ple.values_mut() {
                let st: CudaSlice<f32> = gpu.zeros((cap * pl).max(1))?;
                if self.cap > 0 {
                    copy_within(gpu, p, Some(&st), 0, 0, self.cap * pl)?;
                }
                *p = st;
            }
        }
        self.cap = cap;
        Ok(())
    }

    /// Resizes the pools to exactly `cap` slots (keeping the first `cap` slots' contents) and fixes
    /// them there. Every live slot must be below `cap`.
    pub fn reserve(&mut self, gpu: &Gpu, cap: usize) -> Result<()> {
        if let Some(live) = self.live.iter().rposition(|&l| l).filter(|&s| s >= cap) {
            return Err(CudaError::Shape {
                op: "reserve_states",
                msg: format!("state slot {live} is live, outside a pool of {cap}"),
            });
        }
        self.live.truncate(cap);
        self.free.retain(|&s| s < cap);
        let keep = self.cap.min(cap);
        if let Some(g) = self.shape {
            let (cl, sl) = (conv_len(&g), ssm_len(&g));
            for p in self.layers.values_mut() {
                let conv: CudaSlice<bf16> = gpu.zeros((cap * cl).max(1))?;
                let ssm: CudaSlice<f32> = gpu.zeros((cap * sl).max(1))?;
                if keep > 0 {
                    copy_within(gpu, &p.conv, Some(&conv), 0, 0, keep * cl)?;
                    copy_within(gpu, &p.ssm, Some(&ssm), 0, 0, keep * sl)?;
                }
                *p = StatePool { conv, ssm };
            }
        }
        if let Some(ps) = self.ple_shape {
            let pl = ple_len(&ps);
            for p in self.ple.values_mut() {
                let st: CudaSlice<f32> = gpu.zeros((cap * pl).max(1))?;
                if keep > 0 {
                    copy_within(gpu, p, Some(&st), 0, 0, keep * pl)?;
                }
                *p = st;
            }
        }
        self.cap = cap;
        self.fixed = true;
        Ok(())
    }

    pub fn alloc(&mut self, gpu: &Gpu) -> Result<usize> {
        if self.fixed && self.free.is_empty() && self.live.len() >= self.cap {
            return Err(CudaError::Shape {
                op: "alloc_state",
                msg: format!("all {} reserved state slots are live", self.cap),
            });
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.live.push(false);
                self.live.len() - 1
            }
        };
        self.live[slot] = true;
        if slot >= self.cap {
            self.grow(gpu, (2 * self.cap).max(slot + 1).max(8))?;
        }
        self.zero_slot(gpu, slot)?;
        Ok(slot)
    }

    fn zero_slot(&self, gpu: &Gpu, slot: usize) -> Result<()> {
        if let Some(g) = self.shape {
            let (cl, sl) = (conv_len(&g), ssm_len(&g));
            for p in self.layers.values() {
                zero(gpu, &p.conv, slot * cl, cl)?;
                zero(gpu, &p.ssm, slot * sl, sl)?;
            }
        }
        if let Some(ps) = self.ple_shape {
            let pl = ple_len(&ps);
            for p in self.ple.values() {
                zero(gpu, p, slot * pl, pl)?;
            }
        }
        Ok(())
    }

    pub fn free(&mut self, slot: usize) {
        if self.live.get(slot).copied().unwrap_or(false) {
            self.live[slot] = false;
            self.free.push(slot);
        }
    }

    pub fn check(&self, slot: usize) -> Result<()> {
        if self.live.get(slot).copied().unwrap_or(false) && slot < self.cap {
            Ok(())
        } else {
            Err(CudaError::Shape {
                op: "state slot",
                msg: format!("state slot {slot} is not allocated"),
            })
        }
    }

    pub fn copy(&self, gpu: &Gpu, src: usize, dst: usize) -> Result<()> {
        self.check(src)?;
        self.check(dst)?;
        if src == dst {
            return Ok(());
        }
        if let Some(g) = self.shape {
            let (cl, sl) = (conv_len(&g), ssm_len(&g));
            for p in self.layers.values() {
                copy_within(gpu, &p.conv, None, src * cl, dst * cl, cl)?;
                copy_within(gpu, &p.ssm, None, src * sl, dst * sl, sl)?;
            }
        }
        if let Some(ps) = self.ple_shape {
            let pl = ple_len(&ps);
            for p in self.ple.values() {
                copy_within(gpu, p, None, src * pl, dst * pl, pl)?;
            }
        }
        Ok(())
    }

    pub fn bytes(&self) -> usize {
        self.layers
            .values()
            .map(|p| 2 * p.conv.len() + 4 * p.ssm.len())
            .sum::<usize>()
            + self.ple.values().map(|p| 4 * p.len()).sum::<usize>()
    }
}
