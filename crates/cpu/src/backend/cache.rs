//! The caches of [`CpuBackend`]: a K/V block pool per attention layer (with QSA's index-key entries
//! next to the K/V), and the state slots holding each sequence's GDN conv + recurrent state and PLE
//! conv state.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use sanmai_model::backend::{BackendError, CacheSpec, OpResult, SeqChunk};

use super::host_kv::{fresh_stats, HostKv};
use super::rows::{pin_rows, pool_offset, KvPool, Rows};
use super::{ensure, CpuBackend};

/// The block pools and their geometry.
#[derive(Default)]
pub(crate) struct Pools {
    pub(crate) num_blocks: usize,
    pub(crate) block_size: usize,
    /// `kv_heads · head_dim`.
    pub(crate) row: usize,
    /// Bytes of one index-key entry (`dI + 2`; 0 without QSA).
    pub(crate) idx_row: usize,
    pub(crate) layers: HashMap<usize, KvPool>,
    /// The row caches, when the QSA layers' K/V rows live in pinned host memory.
    pub(crate) host: Option<HostKv>,
}

impl Pools {
    /// Layer `layer`'s pool.
    pub(crate) fn layer(&self, op: &'static str, layer: usize) -> OpResult<&KvPool> {
        self.layers.get(&layer).ok_or_else(|| no_pool(op, layer))
    }

    pub(crate) fn layer_mut(&mut self, op: &'static str, layer: usize) -> OpResult<&mut KvPool> {
        self.layers
            .get_mut(&layer)
            .ok_or_else(|| no_pool(op, layer))
    }

    /// `Err` unless every chunk's block table covers its positions with blocks of the pool.
    pub(crate) fn check_blocks(&self, op: &'static str, seqs: &[SeqChunk<'_>]) -> OpResult<()> {
        for s in seqs {
            let need = s.pos0 + s.len;
            ensure(s.blocks.len() * self.block_size >= need, op, || {
                format!(
                    "{} blocks of {} cannot hold {need} positions",
                    s.blocks.len(),
                    self.block_size
                )
            })?;
            let used = need.div_ceil(self.block_size.max(1));
            if let Some(&b) = s.blocks[..used]
                .iter()
                .find(|&&b| b as usize >= self.num_blocks)
            {
                return Err(BackendError::invalid(
                    op,
                    format!("block {b} outside the pool of {}", self.num_blocks),
                ));
            }
        }
        Ok(())
    }
}

pub(crate) fn no_pool(op: &'static str, layer: usize) -> BackendError {
    BackendError::invalid(
        op,
        format!("no K/V pool for layer {layer}: init_cache first"),
    )
}

/// Copies positions `0..len` of a sequence's K or V out of the pool into a contiguous `[len, row]` buffer.
pub(crate) fn gather(
    pool: &[f32],
    blocks: &[u32],
    block_size: usize,
    row: usize,
    len: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len * row);
    let mut pos = 0;
    while pos < len {
        let n = (block_size - pos % block_size).min(len - pos);
        let o = pool_offset(blocks, block_size, row, pos);
        out.extend_from_slice(&pool[o..o + n * row]);
        pos += n;
    }
    out
}

#[derive(Clone)]
pub(crate) struct GdnState {
    pub(crate) conv: Vec<f32>,
    pub(crate) ssm: Vec<f32>,
}

/// The states of one state slot: GDN conv + recurrent state per GDN layer, PLE conv state
/// `[(kernel−1)·dilation, S·H]` per PLE layer.
#[derive(Default, Clone)]
pub(crate) struct SlotStates {
    pub(crate) gdn: HashMap<usize, GdnState>,
    pub(crate) ple: HashMap<usize, Vec<f32>>,
}

impl CpuBackend {
    pub(super) fn init_cache_impl(&self, spec: &CacheSpec) -> OpResult<()> {
        let row = spec.num_kv_heads * spec.head_dim;
        let n = spec.num_blocks * spec.block_size * row;
        let idx_row = if spec.index_head_dim > 0 {
            spec.index_head_dim + 2
        } else {
            0
        };
        ensure(spec.block_size > 0, "init_cache", || {
            "blocks of 0 positions".into()
        })?;
        ensure(
            spec.ple_layers.is_empty() || spec.ple.is_some(),
            "init_cache",
            || "PLE layers without a PLE shape".into(),
        )?;
        let mut pools = self.pools.write().unwrap();
        pools.num_blocks = spec.num_blocks;
        pools.block_size = spec.block_size;
        pools.row = row;
        pools.idx_row = idx_row;
        // Zero-filled allocations are lazily backed by the OS: only touched blocks cost memory. The
        // QSA layers' K and V rows may live in one pinned host pool instead.
        let layers = spec.attn_layers.len();
        let host = spec.kv_host.as_ref().filter(|_| idx_row > 0);
        // Old pools (pinned ones especially) go before new ones are made.
        pools.layers.clear();
        pools.host = None;
        *self.kv_stats.lock().unwrap() = None;
        let mut rows = match host {
            Some(host) => pin_rows(host, 2 * layers, n)?,
            None => (0..2 * layers).map(|_| Rows::Heap(vec![0.0; n])).collect(),
        }
        .into_iter();
        pools.layers = spec
            .attn_layers
            .iter()
            .map(|&l| {
                let (k, v) = (rows.next(), rows.next());
                let pool = KvPool {
                    k: k.expect("two row pools a layer"),
                    v: v.expect("two row pools a layer"),
                    idx: vec![0; spec.num_blocks * spec.block_size * idx_row],
                };
                (l, pool)
            })
            .collect();
        if let Some(host) = host {
            let slots = spec.num_blocks * spec.block_size;
            pools.host = Some(HostKv::new(host, spec, row, slots));
            *self.kv_stats.lock().unwrap() = Some(fresh_stats(spec));
        }
        *self.gdn.lock().unwrap() = Some((spec.gdn_layers.clone(), spec.gdn));
        *self.ple.lock().unwrap() = spec.ple.map(|sh| (spec.ple_layers.clone(), sh));
        Ok(())
    }

    fn fresh_states(&self) -> SlotStates {
        let mut out = SlotStates::default();
        if let Some((layers, sh)) = self.ple.lock().unwrap().as_ref() {
            for &l in layers {
                out.ple
                    .insert(l, vec![0.0; sh.state_rows() * sh.channels()]);
            }
        }
        let guard = self.gdn.lock().unwrap();
        let Some((layers, g)) = guard.as_ref() else {
            return out;
        };
        let conv_dim = 2 * g.num_k_heads * g.k_head_dim + g.num_v_heads * g.v_head_dim;
        out.gdn = layers
            .iter()
            .map(|&l| {
                let st = GdnState {
                    conv: vec![0.0; (g.conv_kernel - 1) * conv_dim],
                    ssm: vec![0.0; g.num_v_heads * g.k_head_dim * g.v_head_dim],
                };
                (l, st)
            })
            .collect();
        out
    }

    pub(super) fn alloc_state_impl(&self) -> OpResult<usize> {
        let limit = *self.state_limit.lock().unwrap();
        let mut table = self.states.lock().unwrap();
        if let Some(limit) = limit.filter(|&l| table.len() >= l) {
            return Err(BackendError::invalid(
                "alloc_state",
                format!("all {limit} reserved state slots are live"),
            ));
        }
        let slot = self.next_state.fetch_add(1, Ordering::Relaxed);
        table.insert(slot, self.fresh_states());
        Ok(slot)
    }

    pub(super) fn reserve_states_impl(&self, slots: usize) -> OpResult<()> {
        let live = self.states.lock().unwrap().len();
        if live > slots {
            return Err(BackendError::invalid(
                "reserve_states",
                format!("{live} state slots are live, more than the {slots} asked for"),
            ));
        }
        *self.state_limit.lock().unwrap() = Some(slots);
        Ok(())
    }

    pub(super) fn free_state_impl(&self, slot: usize) {
        self.states.lock().unwrap().remove(&slot);
    }

    pub(super) fn copy_state_impl(&self, src: usize, dst: usize) -> OpResult<()> {
        let mut table = self.states.lock().unwrap();
        let copy = table
            .get(&src)
            .ok_or_else(|| {
                BackendError::invalid("copy_state", format!("state slot {src} is not allocated"))
            })?
            .clone();
        table.insert(dst, copy);
        Ok(())
    }

    pub(super) fn copy_block_impl(&self, src: u32, dst: u32) -> OpResult<()> {
        let mut pools = self.pools.write().unwrap();
        let nb = pools.num_blocks;
        ensure(
            (src as usize) < nb && (dst as usize) < nb,
            "copy_block",
            || format!("blocks {src} -> {dst} in a pool of {nb} (init_cache first)"),
        )?;
        let n = pools.block_size * pools.row;
        let (s, d) = (src as usize * n, dst as usize * n);
        let ni = pools.block_size * pools.idx_row;
        let (si, di) = (src as usize * ni, dst as usize * ni);
        for pool in pools.layers.values_mut() {
            pool.k.copy_within(s..s + n, d);
            pool.v.copy_within(s..s + n, d);
            pool.idx.copy_within(si..si + ni, di);
        }
        let bs = pools.block_size;
        if let Some(host) = pools.host.as_mut() {
            host.invalidate_block(dst, bs);
        }
        Ok(())
    }

    /// Takes the state slots of the step's sequences out of the table (so they can be worked on in
    /// parallel); `Err`, with the table unchanged, when a slot is not allocated (or appears twice).
    fn take(&self, op: &'static str, seqs: &[SeqChunk<'_>]) -> OpResult<Vec<SlotStates>> {
        let mut table = self.states.lock().unwrap();
        let mut taken = Vec::with_capacity(seqs.len());
        for s in seqs {
            match table.remove(&s.state) {
                Some(st) => taken.push(st),
                None => {
                    for (s, st) in seqs.iter().zip(taken) {
                        table.insert(s.state, st);
                    }
                    return Err(BackendError::invalid(
                        op,
                        format!(
                            "state slot {} is not allocated (or is in the step twice)",
                            s.state
                        ),
                    ));
                }
            }
        }
        Ok(taken)
    }

    fn put_back(&self, seqs: &[SeqChunk<'_>], states: Vec<SlotStates>) {
        let mut table = self.states.lock().unwrap();
        for (s, st) in seqs.iter().zip(states) {
            table.insert(s.state, st);
        }
    }

    /// Runs `f` on the state `pick` finds in each of the step's state slots (`what` names it),
    /// taking the slots out of the table meanwhile (so `f` can work on them in parallel); `Err`
    /// without running `f` when a slot is not allocated or lacks that state.
    pub(crate) fn with_states<S, R>(
        &self,
        op: &'static str,
        seqs: &[SeqChunk<'_>],
        what: &str,
        pick: impl Fn(&mut SlotStates) -> Option<&mut S>,
        f: impl FnOnce(&mut [&mut S]) -> R,
    ) -> OpResult<R> {
        let mut states = self.take(op, seqs)?;
        let mut picked: Vec<&mut S> = states.iter_mut().filter_map(pick).collect();
        let out = (picked.len() == seqs.len()).then(|| f(&mut picked));
        drop(picked);
        self.put_back(seqs, states);
        out.ok_or_else(|| {
            BackendError::invalid(
                op,
                format!("no {what} in the state slots: init_cache first"),
            )
        })
    }
}
