//! Where a K/V pool's rows live: on the heap, or in a range of one pinned host pool that every
//! attention layer's K and V share (`--qsa-kv-offload`, [`sanmai_pinned`]). Both read and write as
//! `[f32]`, so the ops do not tell them apart. Also the pool of one attention layer ([`KvPool`]) and
//! where a position's row is in it.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

use sanmai_model::backend::{BackendError, KvHost, OpResult};
use sanmai_pinned::{HostPool, PinRequest};

/// The values of one K or V pool.
pub(crate) enum Rows {
    Heap(Vec<f32>),
    Pinned(PinnedRows),
}

/// One range of a pinned pool; the ranges of one pool never overlap.
pub(crate) struct PinnedRows {
    ptr: NonNull<f32>,
    len: usize,
    /// Keeps the mapping alive as long as any of its ranges.
    _pool: Arc<HostPool>,
}

// SAFETY: a `PinnedRows` is the only handle to its range of the mapping (the ranges `pin_rows`
// hands out are disjoint and the pool itself is never read through the `Arc`), so it is shared and
// sent like the `&mut [f32]` it stands for.
unsafe impl Send for PinnedRows {}
// SAFETY: as for `Send`: `&PinnedRows` only reads its own range.
unsafe impl Sync for PinnedRows {}

impl Deref for Rows {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Rows::Heap(v) => v,
            // SAFETY: `ptr..ptr + len` lies inside the live mapping `_pool` holds, aligned for
            // f32, and no other handle reaches it (see `PinnedRows`).
            Rows::Pinned(p) => unsafe { std::slice::from_raw_parts(p.ptr.as_ptr(), p.len) },
        }
    }
}

impl DerefMut for Rows {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Rows::Heap(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes this the only reference to the range.
            Rows::Pinned(p) => unsafe { std::slice::from_raw_parts_mut(p.ptr.as_ptr(), p.len) },
        }
    }
}

/// Pins one pool of `count` ranges of `len` values each (zeroed) as `host` says, and splits it.
pub(crate) fn pin_rows(host: &KvHost, count: usize, len: usize) -> OpResult<Vec<Rows>> {
    let bytes = count * len * std::mem::size_of::<f32>();
    let mut pool = sanmai_pinned::pin(&PinRequest {
        bytes,
        what: &host.what,
        reserve: host.reserve,
        lock_path: &host.lock_path,
    })
    .map_err(|e| BackendError::device("init_cache", e))?;
    let base = pool
        .typed_mut::<f32>()
        .ok_or_else(|| BackendError::invalid("init_cache", "a pinned pool not of f32 values"))?
        .as_mut_ptr();
    let pool = Arc::new(pool);
    Ok((0..count)
        .map(|i| {
            // SAFETY: range `i` lies inside the `count · len` values of the pool.
            let ptr = unsafe { base.add(i * len) };
            Rows::Pinned(PinnedRows {
                ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
                len,
                _pool: pool.clone(),
            })
        })
        .collect())
}

/// K/V of one attention layer for every block: `[num_blocks, block_size, kv_heads·head_dim]` each,
/// and QSA's index-key entries `[num_blocks, block_size, dI + 2]` bytes (empty without QSA).
pub(crate) struct KvPool {
    pub(crate) k: Rows,
    pub(crate) v: Rows,
    pub(crate) idx: Vec<u8>,
}

/// The physical cache slot of position `pos`: `block · block_size + offset`.
pub(crate) fn slot_of(blocks: &[u32], block_size: usize, pos: usize) -> usize {
    blocks[pos / block_size] as usize * block_size + pos % block_size
}

/// Offset of position `pos`'s row in a pool.
pub(crate) fn pool_offset(blocks: &[u32], block_size: usize, row: usize, pos: usize) -> usize {
    slot_of(blocks, block_size, pos) * row
}
