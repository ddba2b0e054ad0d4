//! The VRAM row cache of sparse-attention (QSA) layers, as a CPU twin of its GPU kernels.
//!
//! QSA layers keep their K/V rows in pinned host memory; each step the GPU reads only the rows the
//! indexer selects (up to 2,048 per layer per query row) through UVA. The row cache keeps recently read
//! rows in VRAM: one direct-mapped cache per layer, keyed by the physical cache slot
//! (`slot = block · block_size + offset`), so requests sharing prefix blocks share cached rows. Slot `s`
//! lives in line `s % L`. This type holds the same state as the GPU and runs the same three phases, so
//! the kernels are tested against it and the logic is tested against a plain model of host memory.
//!
//! # State (per layer, `L ≥ 1` lines of `row` elements)
//! - `tag[line]`: `slot + 1` of the row the line holds, 0 when empty;
//! - `hitmark[line]`: the epoch of the last step that hit the line;
//! - `claim[line]`: `(epoch << 32) | slot` of the last miss that claimed the line (the maximum wins);
//! - `rows`: `L × row` elements (f32 on the CPU backend, bf16 bits `u16` on the GPU);
//! - `epoch`: starts at 0 and step `n` runs under epoch `n`, so zeroed hitmarks and claims never match.
//!
//! # One step of one layer
//! 1. [`RowCache::invalidate`] (the invalidate kernel): every slot stored to this step (the step's own
//!    K/V write, and any block reuse, which goes through a store) empties its line if the line holds it;
//!    then the epoch advances. Every store of the step must come before this phase.
//! 2. [`RowCache::plan`] (the plan kernel): every slot read this step (all query rows' selections,
//!    duplicates allowed) either hits (`tag == slot + 1`: the line's hitmark becomes the epoch) or misses
//!    (the line's claim becomes `max(claim, (epoch << 32) | slot)`).
//! 3. [`RowCache::read`] (the attention's one load per selected row): a read hits when the line's hitmark
//!    is this epoch and its tag is the slot, and then the row comes from the cache; otherwise it comes
//!    from the host, and when the line's claim is this read's `(epoch << 32) | slot` and the line has no
//!    hit this step, the host row is written into the line and the tag set to the slot. Several readers of
//!    one slot write the same bytes, which is harmless.
//!
//! The GPU decides hit or miss for all reads of a step from the state left by `plan`, before any write
//! of phase 3. The twin gives the same results in any read order: phase 3 writes only lines whose
//! hitmark is not this epoch, and reads of those lines are always misses this step (their tag is never
//! consulted), while the lines that can hit are never written; hitmarks and claims do not change in
//! phase 3, and each written line gets the single slot its claim names, always with that slot's host
//! row. So hit or miss, the row returned, and the final state do not depend on the order of the reads.
//! A line that a step both hits and misses keeps its row (the hitting readers are still using it).
//!
//! [`RowCache::invalidate_all`] empties every line: the cache lives in the prefill staging arena, and a
//! staged prefill overwrites it. The tags, hitmarks and claims (20 bytes a line) must live outside the
//! arena: garbage claims left by an overwrite could outrank every later claim and stop all writes.
//!
//! Only decode-shaped steps ([`decode_shaped`]: at most [`MAX_CACHED_ROWS`] query rows, the fixed launch
//! shapes captured in CUDA graphs) run `plan` and `read`; larger steps read every row from the host but
//! still run `invalidate`, so the cache never holds a row older than its slot's last store.

/// Most query rows a step may have to use the row cache; larger steps read every row from the host.
pub const MAX_CACHED_ROWS: usize = 12;

/// Whether a step of `rows` query rows uses the row cache (`rows ≤ MAX_CACHED_ROWS`).
pub fn decode_shaped(rows: usize) -> bool {
    rows <= MAX_CACHED_ROWS
}

/// Lines per layer when an arena of `arena_elems` elements is split evenly across `layers` QSA layers of
/// rows of `row` elements: `⌊arena_elems / (layers · row)⌋`. Returns 0, meaning the cache is off, when
/// not even one line per layer fits (or `layers` or `row` is 0). The per-line metadata is not counted:
/// it lives outside the arena.
pub fn lines_per_layer(arena_elems: usize, layers: usize, row: usize) -> usize {
    match layers.checked_mul(row) {
        Some(per_line) if per_line > 0 => arena_elems / per_line,
        _ => 0,
    }
}

/// The row a [`RowCache::read`] gives the attention.
#[derive(Debug, Clone, Copy)]
pub struct Read<'a, T> {
    /// The row's `row` elements: the cached line on a hit, the host row on a miss.
    pub row: &'a [T],
    /// Whether the row came from the cache.
    pub hit: bool,
}

/// The row cache of one QSA layer (see the module doc).
#[derive(Debug, Clone)]
pub struct RowCache<T> {
    tag: Vec<u64>,
    hitmark: Vec<u32>,
    claim: Vec<u64>,
    rows: Vec<T>,
    row: usize,
    epoch: u32,
    hits: u64,
    misses: u64,
}

impl<T: Copy + Default> RowCache<T> {
    /// An empty cache of `lines` lines of `row` elements each, at epoch 0. Panics when either is 0.
    pub fn new(lines: usize, row: usize) -> Self {
        assert!(
            lines > 0 && row > 0,
            "RowCache::new: lines and row must be positive"
        );
        Self {
            tag: vec![0; lines],
            hitmark: vec![0; lines],
            claim: vec![0; lines],
            rows: vec![T::default(); lines * row],
            row,
            epoch: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// Number of lines `L`.
    pub fn lines(&self) -> usize {
        self.tag.len()
    }

    /// Elements per row.
    pub fn row_len(&self) -> usize {
        self.row
    }

    /// The line slot `slot` maps to: `slot % L`.
    #[inline]
    pub fn line(&self, slot: u32) -> usize {
        slot as usize % self.tag.len()
    }

    /// The epoch of the current step (0 before the first [`RowCache::invalidate`]).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Per line, `slot + 1` of the row it holds, 0 when empty.
    pub fn tags(&self) -> &[u64] {
        &self.tag
    }

    /// Per line, the epoch of the last step that hit it.
    pub fn hitmarks(&self) -> &[u32] {
        &self.hitmark
    }

    /// Per line, `(epoch << 32) | slot` of the largest miss that claimed it.
    pub fn claims(&self) -> &[u64] {
        &self.claim
    }

    /// The cached rows, `[L, row]`.
    pub fn rows(&self) -> &[T] {
        &self.rows
    }

    /// Reads served from the cache so far (each [`RowCache::read`] counts, duplicates included).
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Reads served from the host so far.
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Phase 1: empties the line of every slot in `stored` that holds that slot, then starts the next
    /// epoch. Runs every step, whatever its shape, after all of the step's stores.
    ///
    /// Once every `2^32 − 1` steps the epoch would wrap: hitmarks and claims are then zeroed and the
    /// epoch restarts at 1 (tags and rows stay valid).
    pub fn invalidate(&mut self, stored: &[u32]) {
        for &slot in stored {
            let line = self.line(slot);
            if self.tag[line] == u64::from(slot) + 1 {
                self.tag[line] = 0;
            }
        }
        if self.epoch == u32::MAX {
            self.hitmark.fill(0);
            self.claim.fill(0);
            self.epoch = 0;
        }
        self.epoch += 1;
    }

    /// Phase 2: records every slot the step reads (duplicates allowed) as a hit of its line or a claim
    /// on it.
    pub fn plan(&mut self, reads: &[u32]) {
        let epoch = self.epoch;
        for &slot in reads {
            let line = self.line(slot);
            if self.tag[line] == u64::from(slot) + 1 {
                self.hitmark[line] = epoch;
            } else {
                let claim = self.claim_of(slot);
                if claim > self.claim[line] {
                    self.claim[line] = claim;
                }
            }
        }
    }

    /// Phase 3: the attention's load of the selected row `slot`, whose host copy is `host` (`row`
    /// elements). Every slot read must have been passed to [`RowCache::plan`] this step. Gives the cached
    /// row on a hit; on a miss gives `host`, and fills the line with it when this read's slot holds the
    /// line's claim and the line has no hit this step. Results do not depend on the order of the reads.
    /// Panics when `host` is not `row` elements long.
    pub fn read<'a>(&'a mut self, slot: u32, host: &'a [T]) -> Read<'a, T> {
        assert_eq!(host.len(), self.row, "RowCache::read: host row length");
        let line = self.line(slot);
        let tag = u64::from(slot) + 1;
        let range = line * self.row..(line + 1) * self.row;
        if self.hitmark[line] == self.epoch {
            if self.tag[line] == tag {
                self.hits += 1;
                return Read {
                    row: &self.rows[range],
                    hit: true,
                };
            }
        } else if self.claim[line] == self.claim_of(slot) {
            self.rows[range].copy_from_slice(host);
            self.tag[line] = tag;
        }
        self.misses += 1;
        Read {
            row: host,
            hit: false,
        }
    }

    /// Empties every line: a staged prefill overwrote the arena the rows live in.
    pub fn invalidate_all(&mut self) {
        self.tag.fill(0);
    }

    #[inline]
    fn claim_of(&self, slot: u32) -> u64 {
        (u64::from(self.epoch) << 32) | u64::from(slot)
    }
}

#[cfg(test)]
mod tests {
    //! The cache against a plain model of host memory (slot → the row last stored to it): every read
    //! must give exactly that row, bit for bit.

    use std::collections::HashMap;

    use super::*;

    /// SplitMix64.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in `0..n` (`n > 0`).
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        /// True with probability `p`.
        fn chance(&mut self, p: f64) -> bool {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
        }

        fn shuffle<X>(&mut self, v: &mut [X]) {
            for i in (1..v.len()).rev() {
                v.swap(i, self.below(i + 1));
            }
        }
    }

    /// Element types the harness can fill with fresh values and compare bitwise.
    trait Elem: Copy + Default {
        fn from_rng(x: u64) -> Self;
        fn bits(self) -> u64;
    }

    impl Elem for f32 {
        fn from_rng(x: u64) -> Self {
            // Any bit pattern, NaNs included: the cache must move bits, not values.
            f32::from_bits(x as u32)
        }
        fn bits(self) -> u64 {
            u64::from(self.to_bits())
        }
    }

    impl Elem for u16 {
        fn from_rng(x: u64) -> Self {
            x as u16
        }
        fn bits(self) -> u64 {
            u64::from(self)
        }
    }

    /// A deliberate bug in how the harness drives the cache, to show the model check catches it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Bug {
        None,
        /// Stores are not invalidated (the epoch still advances).
        SkipInvalidate,
        /// The arena is overwritten without `invalidate_all`.
        SkipInvalidateAll,
    }

    fn bits<T: Elem>(r: &[T]) -> Vec<u64> {
        r.iter().map(|x| x.bits()).collect()
    }

    /// Every field of the state, bitwise.
    fn state<T: Elem>(c: &RowCache<T>) -> impl PartialEq + std::fmt::Debug {
        (
            c.tag.clone(),
            c.hitmark.clone(),
            c.claim.clone(),
            bits(&c.rows),
            c.epoch,
            c.hits,
            c.misses,
        )
    }

    /// A cache, the host memory it fronts (the plain model) and the checks.
    struct Sim<T> {
        cache: RowCache<T>,
        host: HashMap<u32, Vec<T>>,
        rng: Rng,
        bug: Bug,
        reads: u64,
        mismatches: u64,
        steps: u64,
    }

    impl<T: Elem> Sim<T> {
        fn new(cache: RowCache<T>, seed: u64, bug: Bug) -> Self {
            Self {
                cache,
                host: HashMap::new(),
                rng: Rng(seed),
                bug,
                reads: 0,
                mismatches: 0,
                steps: 0,
            }
        }

        fn fresh_row(&mut self) -> Vec<T> {
            (0..self.cache.row)
                .map(|_| T::from_rng(self.rng.next()))
                .collect()
        }

        /// A staged prefill overwrites the arena with garbage.
        fn arena_overwrite(&mut self) {
            for x in self.cache.rows.iter_mut() {
                *x = T::from_rng(self.rng.next());
            }
            if self.bug != Bug::SkipInvalidateAll {
                self.cache.invalidate_all();
            }
        }

        /// One step: stores fresh rows to `stored` (phase 1), then, when `reads` is given (a
        /// decode-shaped step), plans and reads them in order and in a shuffled order on a clone, checks
        /// both give the same rows and state, and checks every row against the model.
        fn step(&mut self, stored: &[u32], reads: Option<&[u32]>) {
            self.steps += 1;
            for &slot in stored {
                let r = self.fresh_row();
                self.host.insert(slot, r);
            }
            if self.bug == Bug::SkipInvalidate {
                self.cache.invalidate(&[]);
            } else {
                self.cache.invalidate(stored);
            }
            let Some(reads) = reads else { return };
            self.cache.plan(reads);
            let mut other = self.cache.clone();
            let a: Vec<(Vec<u64>, bool)> = reads
                .iter()
                .map(|&s| {
                    let r = self.cache.read(s, &self.host[&s]);
                    (bits(r.row), r.hit)
                })
                .collect();
            let mut order: Vec<usize> = (0..reads.len()).collect();
            self.rng.shuffle(&mut order);
            let mut b = vec![(Vec::new(), false); reads.len()];
            for &i in &order {
                let r = other.read(reads[i], &self.host[&reads[i]]);
                b[i] = (bits(r.row), r.hit);
            }
            assert_eq!(a, b, "read results depend on the read order");
            assert_eq!(
                state(&self.cache),
                state(&other),
                "final state depends on the read order"
            );
            for (&s, (row, _)) in reads.iter().zip(&a) {
                self.reads += 1;
                if *row != bits(&self.host[&s]) {
                    self.mismatches += 1;
                }
            }
        }

        fn hit_rate(&self) -> f64 {
            self.cache.hits as f64 / (self.cache.hits + self.cache.misses).max(1) as f64
        }
    }

    /// Random stores and reads over `universe` slots: reads mostly repeat the previous step's reads,
    /// sometimes with duplicates; now and then an arena overwrite or a large (uncached) step.
    fn random_run<T: Elem>(sim: &mut Sim<T>, universe: u32, steps: usize) {
        let mut prev: Vec<u32> = Vec::new();
        for _ in 0..steps {
            if sim.rng.chance(0.02) {
                sim.arena_overwrite();
            }
            let n_store = sim.rng.below(4);
            let stored: Vec<u32> = (0..n_store)
                .map(|_| sim.rng.below(universe as usize) as u32)
                .collect();
            // Only slots stored at some point are read (attention reads written positions).
            let mut known: Vec<u32> = sim.host.keys().copied().collect();
            known.extend(stored.iter().copied());
            known.sort_unstable();
            known.dedup();
            if known.is_empty() || sim.rng.chance(0.05) {
                sim.step(&stored, None);
                continue;
            }
            // Reads: previous reads kept with probability 0.7, plus fresh known slots and duplicates.
            let mut reads: Vec<u32> = prev
                .iter()
                .copied()
                .filter(|_| sim.rng.chance(0.7))
                .collect();
            for _ in 0..1 + sim.rng.below(12) {
                reads.push(known[sim.rng.below(known.len())]);
            }
            for _ in 0..sim.rng.below(4) {
                let d = reads[sim.rng.below(reads.len())];
                reads.push(d);
            }
            reads.truncate(48);
            sim.step(&stored, Some(&reads));
            prev = reads;
        }
    }

    #[test]
    fn row_cache_heavy_collisions() {
        for (lines, seed) in [(1, 11), (2, 12), (3, 13)] {
            let mut sim = Sim::<f32>::new(RowCache::new(lines, 5), seed, Bug::None);
            random_run(&mut sim, 300, 1500);
            assert_eq!(sim.mismatches, 0, "L = {lines}: stale or wrong rows");
            assert!(sim.reads > 10_000);
            assert!(sim.cache.hits > 0, "L = {lines}: no hit at all");
            println!("L = {lines}: hit rate {:.3}", sim.hit_rate());
        }
    }

    #[test]
    fn row_cache_bf16_bits_and_epoch_wrap() {
        let mut cache = RowCache::<u16>::new(7, 3);
        cache.epoch = u32::MAX - 40;
        let mut sim = Sim::new(cache, 21, Bug::None);
        random_run(&mut sim, 60, 300);
        assert!(sim.cache.epoch < 300, "the epoch wrapped");
        let hits = sim.cache.hits;
        random_run(&mut sim, 60, 300);
        assert_eq!(sim.mismatches, 0);
        // Claims from before the wrap would outrank every later one had they not been cleared.
        assert!(sim.cache.hits > hits, "no hits after the wrap");
        // At the wrap, hitmarks and claims are cleared and the epoch restarts at 1; tags stay.
        let mut c = RowCache::<u16>::new(2, 1);
        c.epoch = u32::MAX;
        c.plan(&[3]);
        c.tag[0] = 5;
        c.invalidate(&[]);
        assert_eq!(
            (c.epoch(), c.claims(), c.hitmarks()),
            (1, &[0, 0][..], &[0, 0][..])
        );
        assert_eq!(c.tags(), [5, 0]);
        println!("bf16, wrap: hit rate {:.3}", sim.hit_rate());
    }

    /// A few sequences sharing prefix blocks decode one token each per step; each selects positions
    /// of its own, ~70% of them kept from the previous step. Finished sequences free their private
    /// blocks, which a new request reuses (its prefill rewrites them: a large, uncached step).
    fn realistic_run(sim: &mut Sim<f32>, steps: usize) {
        const BS: u32 = 16;
        const PREFIX_BLOCKS: usize = 3;
        const SEQS: usize = 4;
        const K: usize = 10;
        const MAX_LEN: usize = 160;
        let slot = |table: &[u32], pos: usize| table[pos / BS as usize] * BS + pos as u32 % BS;
        let mut free: Vec<u32> = (PREFIX_BLOCKS as u32..64).rev().collect();
        let prefix: Vec<u32> = (0..PREFIX_BLOCKS as u32).collect();
        // The shared prefix is written once by a prefill.
        let stored: Vec<u32> = prefix
            .iter()
            .flat_map(|&b| (0..BS).map(move |o| b * BS + o))
            .collect();
        sim.step(&stored, None);
        struct Seq {
            table: Vec<u32>,
            len: usize,
            sel: Vec<usize>,
        }
        let mut seqs: Vec<Seq> = Vec::new();
        for _ in 0..steps {
            let mut stored = Vec::new();
            // Admit new requests: prefill the prefix tail into a private block.
            while seqs.len() < SEQS {
                let mut table = prefix.clone();
                let len = PREFIX_BLOCKS * BS as usize + 1 + sim.rng.below(8);
                table.push(free.pop().unwrap());
                for pos in PREFIX_BLOCKS * BS as usize..len {
                    stored.push(slot(&table, pos));
                }
                seqs.push(Seq {
                    table,
                    len,
                    sel: Vec::new(),
                });
            }
            if !stored.is_empty() {
                if sim.rng.chance(0.5) {
                    sim.arena_overwrite();
                }
                sim.step(&stored, None);
                stored.clear();
            }
            // Decode: each sequence stores its new token, then selects K positions.
            let mut reads = Vec::new();
            for seq in &mut seqs {
                if seq.len == seq.table.len() * BS as usize {
                    seq.table.push(free.pop().unwrap());
                }
                stored.push(slot(&seq.table, seq.len));
                seq.len += 1;
                let keep: Vec<usize> = seq
                    .sel
                    .iter()
                    .copied()
                    .filter(|_| sim.rng.chance(0.7))
                    .collect();
                let mut sel = keep;
                while sel.len() < K {
                    // New picks favour the prefix and recent positions.
                    let pos = if sim.rng.chance(0.5) {
                        sim.rng.below(PREFIX_BLOCKS * BS as usize)
                    } else {
                        seq.len - 1 - sim.rng.below(seq.len.min(24))
                    };
                    sel.push(pos);
                }
                reads.extend(sel.iter().map(|&p| slot(&seq.table, p)));
                seq.sel = sel;
            }
            assert!(decode_shaped(seqs.len()));
            sim.step(&stored, Some(&reads));
            // Finished sequences give back their private blocks.
            seqs.retain(|seq| {
                let done = seq.len >= MAX_LEN;
                if done {
                    free.extend(seq.table[PREFIX_BLOCKS..].iter().copied());
                }
                !done
            });
        }
    }

    #[test]
    fn row_cache_realistic_shared_prefix() {
        let mut sim = Sim::new(RowCache::new(64, 8), 31, Bug::None);
        realistic_run(&mut sim, 3000);
        assert_eq!(sim.mismatches, 0, "stale or wrong rows");
        let rate = sim.hit_rate();
        println!(
            "realistic: {} steps, {} reads, hit rate {rate:.3}",
            sim.steps, sim.reads
        );
        assert!(rate > 0.5, "hit rate {rate}");
    }

    #[test]
    fn row_cache_broken_variants_are_caught() {
        for bug in [Bug::SkipInvalidate, Bug::SkipInvalidateAll] {
            let mut sim = Sim::new(RowCache::new(64, 8), 41, bug);
            realistic_run(&mut sim, 400);
            assert!(sim.mismatches > 0, "the model check missed a broken cache");
            let realistic = sim.mismatches;
            let mut sim = Sim::<f32>::new(RowCache::new(3, 5), 42, bug);
            random_run(&mut sim, 300, 400);
            assert!(sim.mismatches > 0, "the model check missed a broken cache");
            println!(
                "{bug:?}: {realistic} and {} stale rows caught",
                sim.mismatches
            );
        }
    }

    #[test]
    fn row_cache_duplicates_and_colliding_claims() {
        let mut c = RowCache::<f32>::new(4, 2);
        let host = |s: u32| [s as f32, -(s as f32)];
        // Slots 1, 5, 9, 13 all map to line 1; 13 is the largest claim and the only one written.
        c.invalidate(&[]);
        let reads = [5, 1, 13, 9, 13, 5];
        c.plan(&reads);
        for &s in &reads {
            let h = host(s);
            let r = c.read(s, &h);
            assert!(!r.hit);
            assert_eq!(r.row, h);
        }
        assert_eq!(c.tags(), [0, 14, 0, 0]);
        assert_eq!(&c.rows()[2..4], host(13));
        assert_eq!(c.claims()[1], (1 << 32) | 13);
        // Next step: 13 hits (twice); 9 misses on the hit line and does not evict it.
        c.invalidate(&[2]);
        let reads = [13, 9, 13];
        c.plan(&reads);
        let got: Vec<bool> = reads.iter().map(|&s| c.read(s, &host(s)).hit).collect();
        assert_eq!(got, [true, false, true]);
        assert_eq!(c.tags()[1], 14);
        assert_eq!((c.hits(), c.misses()), (2, 7));
        // A store to 13 evicts it; a store to a colliding slot does not.
        c.invalidate(&[1, 5]);
        assert_eq!(c.tags()[1], 14);
        c.invalidate(&[13]);
        assert_eq!(c.tags()[1], 0);
        c.plan(&[9]);
        assert!(!c.read(9, &host(9)).hit);
        assert_eq!(c.tags()[1], 10);
        c.invalidate_all();
        assert_eq!(c.tags(), [0; 4]);
    }

    #[test]
    fn row_cache_shapes_and_sizes() {
        assert!(decode_shaped(0) && decode_shaped(MAX_CACHED_ROWS));
        assert!(!decode_shaped(MAX_CACHED_ROWS + 1));
        assert_eq!(lines_per_layer(1000, 3, 10), 33);
        assert_eq!(lines_per_layer(29, 3, 10), 0);
        assert_eq!(lines_per_layer(30, 3, 10), 1);
        assert_eq!(lines_per_layer(1000, 0, 10), 0);
        assert_eq!(lines_per_layer(1000, 3, 0), 0);
        assert_eq!(lines_per_layer(usize::MAX, usize::MAX, 2), 0);
    }
}
