//! The QSA K/V rows in pinned host memory (`--qsa-kv-offload`, [`CacheSpec::kv_host`]) as the CPU
//! backend reads them: each QSA layer's row cache, the CPU twin of the GPU's VRAM row cache
//! ([`RowCache`], whose module doc has the protocol), and the counters
//! [`Backend::kv_host_stats`](sanmai_model::Backend::kv_host_stats) reports.
//!
//! A cache line holds one position's K row followed by its V row (`2 · kv_heads · head_dim` values),
//! so one line is one row of [`KvHost::row_cache_rows`], which are split evenly over the QSA layers
//! (`rows / layers` lines each; 0 lines: no cache). A line is keyed by the physical cache slot
//! `block · block_size + offset`, so sequences sharing prefix blocks share cached rows.
//!
//! Per layer and step (`qsa.rs`): every step, whatever its shape, empties the lines of the slots its
//! K/V write went to ([`RowCache::invalidate`]); a decode-shaped step ([`cached_step`]) then plans
//! every selected slot of every row and reads each selected row through the cache; any other step
//! reads its rows from host memory directly. [`HostKv::invalidate_block`] does the same for the
//! destination of a block copy. The rows a read returns are bitwise the host rows, so a step's
//! outputs do not depend on the cache.

use std::collections::HashMap;

use sanmai_model::backend::{CacheSpec, KvHost, KvHostStats, RowCacheCounts, SeqChunk};

use super::rows::{pool_offset, slot_of, KvPool};
use super::CpuBackend;
use crate::ops::row_cache::{decode_shaped, lines_per_layer, RowCache};

/// Bytes of one value of the K/V rows (f32).
const ELEM_BYTES: u64 = 4;

/// The row caches of a stage whose QSA K/V rows are pinned in host memory.
pub(crate) struct HostKv {
    /// Each QSA layer's row cache; empty when the cache is off.
    caches: HashMap<usize, RowCache<f32>>,
}

impl HostKv {
    /// Empty caches for `spec.attn_layers` (the QSA layers) under `host`, with K and V rows of
    /// `row` values in a pool of `slots` positions. The lines per layer are capped at `slots` (a
    /// slot maps to line `slot % lines`, so more lines would never be used, and the hits and misses
    /// are the same). No cache when `host` turns it off ([`KvHost::row_cache`]), when not even one
    /// line per layer fits, or when the slots do not fit the cache's `u32` keys.
    pub(crate) fn new(host: &KvHost, spec: &CacheSpec, row: usize, slots: usize) -> Self {
        let lines = lines_per_layer(host.row_cache_rows, spec.attn_layers.len(), 1).min(slots);
        let keyed = u32::try_from(slots).is_ok();
        let caches = if host.row_cache && lines > 0 && row > 0 && keyed {
            spec.attn_layers
                .iter()
                .map(|&l| (l, RowCache::new(lines, 2 * row)))
                .collect()
        } else {
            HashMap::new()
        };
        HostKv { caches }
    }

    /// Layer `layer`'s row cache, `None` when the cache is off.
    pub(crate) fn cache_mut(&mut self, layer: usize) -> Option<&mut RowCache<f32>> {
        self.caches.get_mut(&layer)
    }

    /// Block `block` (of `block_size` positions) was written in every layer (a block copy): empties
    /// its slots' lines in every layer's cache.
    pub(crate) fn invalidate_block(&mut self, block: u32, block_size: usize) {
        let first = block as usize * block_size;
        let slots: Vec<u32> = (first..first + block_size).map(|s| s as u32).collect();
        for cache in self.caches.values_mut() {
            cache.invalidate(&slots);
        }
    }
}

/// The zeroed counters of a stage whose QSA layers are `spec.attn_layers`.
pub(crate) fn fresh_stats(spec: &CacheSpec) -> KvHostStats {
    let mut layers = spec.attn_layers.clone();
    layers.sort_unstable();
    KvHostStats {
        layers: layers
            .into_iter()
            .map(|layer| RowCacheCounts {
                layer,
                ..RowCacheCounts::default()
            })
            .collect(),
        host_bytes_read: 0,
    }
}

/// Whether a step reads through the row cache: every chunk is one token at row `i` (the batched
/// decode form) and there are at most
/// [`MAX_CACHED_ROWS`](crate::ops::row_cache::MAX_CACHED_ROWS) of them.
pub(crate) fn cached_step(seqs: &[SeqChunk<'_>]) -> bool {
    !seqs.is_empty()
        && decode_shaped(seqs.len())
        && seqs
            .iter()
            .enumerate()
            .all(|(i, s)| s.len == 1 && s.start == i)
}

/// The slots a step's K/V write went to: positions `pos0..pos0 + len` of every chunk.
pub(crate) fn stored_slots(seqs: &[SeqChunk<'_>], block_size: usize) -> Vec<u32> {
    seqs.iter()
        .flat_map(|s| (s.pos0..s.pos0 + s.len).map(move |pos| slot_of(s.blocks, block_size, pos)))
        .map(|slot| slot as u32)
        .collect()
}

/// The K and V rows of a sequence's selected positions, `[n, row]` each.
pub(crate) type KvRows = (Vec<f32>, Vec<f32>);

/// What one layer's step read: from the row cache (`hits`), and from host memory through the cache
/// (`misses`) or directly (`direct`), in rows.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RowReads {
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) direct: u64,
}

/// The K and V rows of each sequence's `positions`, gathered through `cache` (`[n, row]` each, in
/// order): the plan phase over every slot of the step, then one read per position.
pub(crate) fn gather_cached(
    cache: &mut RowCache<f32>,
    pool: &KvPool,
    seqs: &[SeqChunk<'_>],
    positions: &[Vec<usize>],
    (block_size, row): (usize, usize),
) -> (Vec<KvRows>, RowReads) {
    let slots: Vec<Vec<u32>> = seqs
        .iter()
        .zip(positions)
        .map(|(s, ps)| {
            ps.iter()
                .map(|&pos| slot_of(s.blocks, block_size, pos) as u32)
                .collect()
        })
        .collect();
    cache.plan(&slots.concat());
    let mut reads = RowReads::default();
    let mut host = Vec::with_capacity(2 * row);
    let gathered = slots
        .iter()
        .map(|slots| {
            let mut k = Vec::with_capacity(slots.len() * row);
            let mut v = Vec::with_capacity(slots.len() * row);
            for &slot in slots {
                let off = slot as usize * row;
                host.clear();
                host.extend_from_slice(&pool.k[off..off + row]);
                host.extend_from_slice(&pool.v[off..off + row]);
                let r = cache.read(slot, &host);
                if r.hit {
                    reads.hits += 1;
                } else {
                    reads.misses += 1;
                }
                k.extend_from_slice(&r.row[..row]);
                v.extend_from_slice(&r.row[row..]);
            }
            (k, v)
        })
        .collect();
    (gathered, reads)
}

/// The K and V rows of one sequence's `positions`, read from host memory (`[n, row]` each).
pub(crate) fn gather_host(
    pool: &KvPool,
    s: &SeqChunk<'_>,
    positions: &[usize],
    (block_size, row): (usize, usize),
) -> KvRows {
    let mut k = Vec::with_capacity(positions.len() * row);
    let mut v = Vec::with_capacity(positions.len() * row);
    for &pos in positions {
        let off = pool_offset(s.blocks, block_size, row, pos);
        k.extend_from_slice(&pool.k[off..off + row]);
        v.extend_from_slice(&pool.v[off..off + row]);
    }
    (k, v)
}

impl CpuBackend {
    /// Adds one step of layer `layer` to the counters: its hits and misses, and the bytes of the
    /// rows it read from host memory (K and V rows of `row` values each).
    pub(crate) fn count_host_reads(&self, layer: usize, reads: RowReads, row: usize) {
        let mut stats = self.kv_stats.lock().unwrap();
        let Some(stats) = stats.as_mut() else {
            return;
        };
        if let Some(l) = stats.layers.iter_mut().find(|l| l.layer == layer) {
            l.hits += reads.hits;
            l.misses += reads.misses;
        }
        let rows = reads.misses + reads.direct;
        stats.host_bytes_read += rows * 2 * row as u64 * ELEM_BYTES;
    }
}
