//! Per-sequence cache bookkeeping over the [`BlockPool`]: block tables, prefix matching by chain hash, and
//! GDN state checkpoints.
//!
//! GDN layers keep no per-token K/V, so a cached prefix is only usable where the recurrent + conv state at its
//! end was saved. Checkpoints are taken every `interval` tokens (prefill chunks are cut to land on those
//! boundaries), at the last block boundary before every prompt's end and at positions the request names
//! (where a chat's history ends): the points an agent's next turn branches off. The prompt's checkpoint
//! stops short of its end because a prefix hit leaves at least one token to compute: the same prompt
//! asked again, or extended, resumes there and recomputes under a block. They are keyed by the hash of the prefix they end. Each
//! checkpoint holds a state slot of its own, one of `checkpoint_slots` the memory plan sized out of the
//! same budget as the K/V blocks (the executor's slot pool is fixed at start): taking one when all are
//! held drops the oldest. A checkpoint is also dropped when the block its prefix ends in is evicted. A
//! prompt-end checkpoint that is not block-aligned also holds its partial last block (dropped, oldest
//! first, when the pool runs dry); a request that restores it copies that block before writing past it.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::block_pool::{BlockHash, BlockPool};
use crate::executor::Executor;

/// How far one step moved a sequence ([`CacheManager::after_step`]).
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    /// The sequence's tokens from position 0.
    pub tokens: &'a [u32],
    /// Computed tokens before and after the step.
    pub before: usize,
    pub after: usize,
    pub prompt_len: usize,
    /// Positions the request asked to checkpoint at (besides the interval's and the prompt's).
    pub checkpoint_at: &'a [usize],
}

/// A sequence's share of the caches.
#[derive(Debug, Default)]
pub struct SeqCache {
    /// Block table: block `i` holds positions `i·block_size ..`.
    pub blocks: Vec<u32>,
    /// Chain hashes of the leading full blocks registered so far.
    hashes: Vec<BlockHash>,
    /// GDN state slot.
    pub state: usize,
    /// Hash of the cache salt (root of the chain).
    root: BlockHash,
}

impl SeqCache {
    /// Positions before this many are hashed already: [`CacheManager::after_step`] reads the tokens
    /// from here on.
    pub fn hashed_tokens(&self, block_size: usize) -> usize {
        self.hashes.len() * block_size
    }
}

struct Checkpoint {
    state: usize,
    /// The partial block a non-aligned checkpoint holds.
    partial: Option<u32>,
    /// The block whose eviction makes this checkpoint unreachable.
    anchor: Option<u32>,
    /// `(parent hash, tokens past the last full block)` for non-aligned checkpoints.
    partial_of: Option<(BlockHash, usize)>,
    tick: u64,
}

/// Cache statistics for `/metrics`.
#[derive(Debug, Default, Clone, Copy)]
pub struct CacheStats {
    pub queries: u64,
    pub hits: u64,
}

pub struct CacheManager {
    pool: BlockPool,
    block_size: usize,
    prefix_caching: bool,
    /// The model has GDN layers: a prefix needs a state checkpoint to be reused.
    stateful: bool,
    interval: usize,
    /// Checkpoints held at most (each holds one state slot).
    checkpoint_slots: usize,
    checkpoints: HashMap<BlockHash, Checkpoint>,
    order: BTreeMap<u64, BlockHash>,
    partial_children: HashMap<BlockHash, Vec<(usize, BlockHash)>>,
    anchored: HashMap<u32, Vec<BlockHash>>,
    tick: u64,
    pub stats: CacheStats,
}

fn hash_of(parts: &[&dyn Fn(&mut std::collections::hash_map::DefaultHasher)]) -> BlockHash {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in parts {
        p(&mut h);
    }
    h.finish()
}

fn chain(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    hash_of(&[&|h| parent.hash(h), &|h| tokens.hash(h)])
}

fn partial_key(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    hash_of(&[&|h| "partial".hash(h), &|h| parent.hash(h), &|h| {
        tokens.hash(h)
    }])
}

fn root_hash(salt: &[u64]) -> BlockHash {
    hash_of(&[&|h| "root".hash(h), &|h| salt.hash(h)])
}

impl CacheManager {
    /// `interval` must be a multiple of `block_size`; at most `checkpoint_slots` checkpoints are held.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        prefix_caching: bool,
        stateful: bool,
        interval: usize,
        checkpoint_slots: usize,
    ) -> Self {
        assert!(interval.is_multiple_of(block_size) && interval > 0);
        CacheManager {
            pool: BlockPool::new(num_blocks),
            block_size,
            prefix_caching,
            stateful,
            interval,
            checkpoint_slots,
            checkpoints: HashMap::new(),
            order: BTreeMap::new(),
            partial_children: HashMap::new(),
            anchored: HashMap::new(),
            tick: 0,
            stats: CacheStats::default(),
        }
    }

    /// Share of blocks in use, 0..=1.
    pub fn usage(&self) -> f64 {
        self.pool.num_used() as f64 / self.pool.num_blocks() as f64
    }

    /// Where a prompt of `prompt_len` tokens is checkpointed: the last block boundary before its end
    /// (0: none), the deepest point the same prompt asked again can resume from.
    fn prompt_checkpoint(&self, prompt_len: usize) -> usize {
        prompt_len.saturating_sub(1) / self.block_size * self.block_size
    }

    /// The next position a prefill chunk should stop at to take a checkpoint there: the next interval
    /// boundary, the prompt's checkpoint or a requested position (`extra`).
    pub fn next_boundary(
        &self,
        num_computed: usize,
        prompt_len: usize,
        extra: &[usize],
    ) -> Option<usize> {
        if !(self.prefix_caching && self.stateful) {
            return None;
        }
        let interval = (num_computed / self.interval + 1) * self.interval;
        Some(
            extra
                .iter()
                .copied()
                .chain([self.prompt_checkpoint(prompt_len)])
                .filter(|&p| p > num_computed)
                .fold(interval, usize::min),
        )
    }

    fn bump(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn drop_checkpoint(&mut self, exec: &mut dyn Executor, key: BlockHash) {
        let Some(c) = self.checkpoints.remove(&key) else {
            return;
        };
        self.order.remove(&c.tick);
        if let Some((parent, _)) = c.partial_of {
            if let Some(v) = self.partial_children.get_mut(&parent) {
                v.retain(|&(_, k)| k != key);
                if v.is_empty() {
                    self.partial_children.remove(&parent);
                }
            }
        }
        if let Some(a) = c.anchor {
            if let Some(v) = self.anchored.get_mut(&a) {
                v.retain(|&k| k != key);
                if v.is_empty() {
                    self.anchored.remove(&a);
                }
            }
        }
        exec.free_state(c.state);
        if let Some(p) = c.partial {
            self.pool.release(&[p]);
        }
    }

    /// One block, evicting cached blocks (and the checkpoints anchored on them) or, failing that, the oldest
    /// checkpoint that holds a partial block.
    fn allocate(&mut self, exec: &mut dyn Executor) -> Option<u32> {
        loop {
            if let Some((b, evicted)) = self.pool.allocate() {
                if evicted.is_some() {
                    for key in self.anchored.remove(&b).unwrap_or_default() {
                        self.drop_checkpoint(exec, key);
                    }
                }
                return Some(b);
            }
            let key = self
                .order
                .values()
                .copied()
                .find(|k| self.checkpoints[k].partial.is_some())?;
            self.drop_checkpoint(exec, key);
        }
    }

    /// Checkpoints held now.
    #[cfg(test)]
    fn num_checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    /// Makes sure `seq` has blocks for `positions` positions. False when the pool cannot provide them (the
    /// blocks taken so far stay with the sequence).
    pub fn ensure(
        &mut self,
        exec: &mut dyn Executor,
        seq: &mut SeqCache,
        positions: usize,
    ) -> bool {
        let needed = positions.div_ceil(self.block_size);
        while seq.blocks.len() < needed {
            match self.allocate(exec) {
                Some(b) => seq.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Admits a sequence: finds the longest cached prefix it can resume from (at most `tokens.len() - 1`
    /// tokens, so one token is always computed), takes its blocks and restores its state. Returns the cache
    /// and the number of tokens already computed.
    /// With `lookup` false (e.g. the request wants every prompt token's log-probability) nothing is reused.
    /// Fails, holding nothing, when the executor has no state slot to give.
    pub fn admit(
        &mut self,
        exec: &mut dyn Executor,
        tokens: &[u32],
        salt: &[u64],
        lookup: bool,
    ) -> Result<(SeqCache, usize), String> {
        let root = root_hash(salt);
        let mut seq = SeqCache {
            root,
            state: exec.alloc_state()?,
            ..Default::default()
        };
        if !self.prefix_caching || !lookup {
            return Ok((seq, 0));
        }
        let bs = self.block_size;
        let max_p = tokens.len().saturating_sub(1);
        // Walk the chain of cached full blocks; remember the deepest usable resume point.
        let mut chain_blocks = Vec::new();
        let mut chain_hashes = Vec::new();
        let mut best: (usize, Option<BlockHash>) = (0, None);
        let mut parent = root;
        let mut k = 0;
        loop {
            // Non-aligned checkpoints below this parent.
            if let Some(children) = self.partial_children.get(&parent) {
                for &(r, key) in children {
                    let p = k * bs + r;
                    if p <= max_p && p > best.0 && partial_key(parent, &tokens[k * bs..p]) == key {
                        best = (p, Some(key));
                    }
                }
            }
            if (k + 1) * bs > max_p {
                break;
            }
            let h = chain(parent, &tokens[k * bs..(k + 1) * bs]);
            let Some(b) = self.pool.lookup(h) else { break };
            chain_blocks.push(b);
            chain_hashes.push(h);
            k += 1;
            parent = h;
            if !self.stateful {
                best = (k * bs, None);
            } else if self.checkpoints.contains_key(&h) && k * bs > best.0 {
                best = (k * bs, Some(h));
            }
        }
        let (p, key) = best;
        if p == 0 {
            return Ok((seq, 0));
        }
        let full = p / bs;
        for &b in &chain_blocks[..full] {
            self.pool.touch(b);
        }
        seq.blocks = chain_blocks[..full].to_vec();
        seq.hashes = chain_hashes[..full].to_vec();
        if let Some(key) = key {
            let tick = self.bump();
            let c = self
                .checkpoints
                .get_mut(&key)
                .expect("matched checkpoint exists");
            self.order.remove(&c.tick);
            c.tick = tick;
            self.order.insert(tick, key);
            let (state, partial) = (c.state, c.partial);
            if exec.copy_state(state, seq.state).is_err() {
                // The checkpoint cannot be restored: compute the prompt from the start.
                self.free(exec, std::mem::take(&mut seq));
                return self.admit_uncached(exec, root);
            }
            if let Some(pb) = partial {
                // Copy-on-write: the partial block is shared with the checkpoint.
                self.pool.touch(pb);
                let copy = match self.allocate(exec) {
                    Some(nb) if exec.copy_block(pb, nb).is_ok() => Some(nb),
                    Some(nb) => {
                        self.pool.release(&[nb]);
                        None
                    }
                    None => None,
                };
                if let Some(nb) = copy {
                    seq.blocks.push(nb);
                }
                self.pool.release(&[pb]);
                if copy.is_none() {
                    // No room to resume mid-block: fall back to the block-aligned part, recomputing the state.
                    self.free(exec, std::mem::take(&mut seq));
                    return self.admit_uncached(exec, root);
                }
            }
        }
        Ok((seq, p))
    }

    /// Counts an admission that went through: `queried` prompt tokens looked up, `hit` of them reused.
    pub fn record_admission(&mut self, queried: usize, hit: usize) {
        if self.prefix_caching {
            self.stats.queries += queried as u64;
            self.stats.hits += hit as u64;
        }
    }

    fn admit_uncached(
        &mut self,
        exec: &mut dyn Executor,
        root: BlockHash,
    ) -> Result<(SeqCache, usize), String> {
        let seq = SeqCache {
            root,
            state: exec.alloc_state()?,
            ..Default::default()
        };
        Ok((seq, 0))
    }

    /// Registers the sequence's newly completed blocks and takes the checkpoints due after a step that moved
    /// it from `p.before` to `p.after` computed tokens.
    pub fn after_step(&mut self, exec: &mut dyn Executor, seq: &mut SeqCache, p: &Progress<'_>) {
        let Progress {
            tokens,
            before,
            after,
            prompt_len,
            checkpoint_at: extra,
        } = *p;
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        while (seq.hashes.len() + 1) * bs <= after {
            let i = seq.hashes.len();
            let parent = seq.hashes.last().copied().unwrap_or(seq.root);
            let h = chain(parent, &tokens[i * bs..(i + 1) * bs]);
            self.pool.register(seq.blocks[i], h);
            seq.hashes.push(h);
        }
        if !self.stateful {
            return;
        }
        let crossed_interval =
            after / self.interval > before / self.interval && after.is_multiple_of(self.interval);
        // Chunks stop at every checkpoint position (`next_boundary`), so the state is at one only when a
        // step lands on it exactly.
        let landed = after > before
            && (extra.contains(&after) || after == self.prompt_checkpoint(prompt_len));
        if crossed_interval || landed {
            self.checkpoint(exec, seq, tokens, after);
        }
    }

    /// Saves the sequence's state as the checkpoint for its first `p` tokens (the state must be at `p`).
    fn checkpoint(
        &mut self,
        exec: &mut dyn Executor,
        seq: &mut SeqCache,
        tokens: &[u32],
        p: usize,
    ) {
        let bs = self.block_size;
        let k = p / bs;
        let parent = if k == 0 { seq.root } else { seq.hashes[k - 1] };
        let aligned = p.is_multiple_of(bs);
        let key = if aligned {
            parent
        } else {
            partial_key(parent, &tokens[k * bs..p])
        };
        if p == 0 || self.checkpoint_slots == 0 || self.checkpoints.contains_key(&key) {
            return;
        }
        // Every checkpoint slot held: the oldest checkpoint gives its slot up.
        while self.checkpoints.len() >= self.checkpoint_slots {
            let Some(&oldest) = self.order.values().next() else {
                break;
            };
            self.drop_checkpoint(exec, oldest);
        }
        // A checkpoint is an optimisation: without a state slot for it, the step goes on without one.
        let Ok(state) = exec.alloc_state() else {
            return;
        };
        if exec.copy_state(seq.state, state).is_err() {
            exec.free_state(state);
            return;
        }
        let partial = (!aligned).then(|| {
            let b = seq.blocks[k];
            self.pool.touch(b);
            b
        });
        let anchor = if k > 0 { Some(seq.blocks[k - 1]) } else { None };
        if let Some(a) = anchor {
            self.anchored.entry(a).or_default().push(key);
        }
        let partial_of = (!aligned).then_some((parent, p - k * bs));
        if let Some((par, r)) = partial_of {
            self.partial_children.entry(par).or_default().push((r, key));
        }
        let tick = self.bump();
        self.order.insert(tick, key);
        self.checkpoints.insert(
            key,
            Checkpoint {
                state,
                partial,
                anchor,
                partial_of,
                tick,
            },
        );
    }

    /// Returns a sequence's blocks (deepest first into the LRU queue) and its state slot.
    pub fn free(&mut self, exec: &mut dyn Executor, seq: SeqCache) {
        self.pool.release(&seq.blocks);
        exec.free_state(seq.state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::ModelExecutor;
    use sanmai_config::ModelConfig;
    use sanmai_cpu::CpuBackend;
    use sanmai_model::Model;
    use sanmai_weights::Dummy;

    /// The tiny Qwen3-Next fixture (GDN layers: prefixes need checkpoints) with random weights.
    fn executor() -> ModelExecutor<CpuBackend> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen3_next_tiny/config.json");
        let cfg = ModelConfig::from_file(&dir).unwrap();
        ModelExecutor::new(Model::load(cfg, &Dummy::new(1), CpuBackend::new()).unwrap())
    }

    #[test]
    fn checkpoints_stay_within_their_slots() {
        let mut exec = executor();
        let (bs, slots) = (16, 3);
        exec.init_cache(64, bs).unwrap();
        // One running sequence and the checkpoint slots: the pool never grows past them.
        exec.reserve_states(1 + slots).unwrap();
        let mut cache = CacheManager::new(64, bs, true, true, bs, slots);
        let tokens: Vec<u32> = (0..20 * bs as u32).collect();
        let (mut seq, cached) = cache.admit(&mut exec, &tokens, &[], true).unwrap();
        assert_eq!(cached, 0);
        let mut before = 0;
        for after in (1..=20).map(|k| k * bs) {
            assert!(cache.ensure(&mut exec, &mut seq, after));
            let p = Progress {
                tokens: &tokens,
                before,
                after,
                prompt_len: tokens.len(),
                checkpoint_at: &[],
            };
            cache.after_step(&mut exec, &mut seq, &p);
            before = after;
            assert!(cache.num_checkpoints() <= slots, "at {after} tokens");
        }
        // Twenty interval checkpoints were due; the newest three are kept, in their slots.
        assert_eq!(cache.num_checkpoints(), slots);
        assert!(
            exec.alloc_state().is_err(),
            "every reserved slot is held by the sequence or a checkpoint"
        );
        cache.free(&mut exec, seq);
        // A prompt sharing the first 19 blocks resumes from the newest checkpoint inside it.
        let mut again = tokens[..19 * bs].to_vec();
        again.push(7);
        let (seq, cached) = cache.admit(&mut exec, &again, &[], true).unwrap();
        assert_eq!(cached, 19 * bs);
        cache.free(&mut exec, seq);
        // Without checkpoint slots none is taken.
        let mut none = CacheManager::new(64, bs, true, true, bs, 0);
        let (mut seq, _) = none.admit(&mut exec, &tokens[..2 * bs], &[], true).unwrap();
        assert!(none.ensure(&mut exec, &mut seq, 2 * bs));
        let p = Progress {
            tokens: &tokens[..2 * bs],
            before: 0,
            after: 2 * bs,
            prompt_len: 2 * bs,
            checkpoint_at: &[],
        };
        none.after_step(&mut exec, &mut seq, &p);
        assert_eq!(none.num_checkpoints(), 0);
        none.free(&mut exec, seq);
    }
}
