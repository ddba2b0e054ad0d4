//! The K/V block pool: reference counts, an O(1) LRU free queue (an intrusive doubly linked list over block
//! ids) and the map from block hash to cached block. A block whose count drops to zero keeps its contents
//! and its hash until it is reused, so a later request with the same prefix can take it back.

use std::collections::HashMap;

const NIL: u32 = u32::MAX;

/// Chain hash of a full block: parent's hash, the block's token ids, extra keys.
pub type BlockHash = u64;

pub struct BlockPool {
    refs: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize);
        let mut p = BlockPool {
            refs: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            in_free: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
        };
        for b in 0..num_blocks as u32 {
            p.push_back(b);
        }
        p
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that can be allocated now (free, cached or not).
    #[cfg(test)]
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.in_free[b as usize] = false;
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.in_free[b as usize] = true;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: u32) {
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.in_free[b as usize] = true;
        self.num_free += 1;
    }

    /// Takes the least recently freed block; returns it and the hash it was cached under (now evicted).
    pub fn allocate(&mut self) -> Option<(u32, Option<BlockHash>)> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        self.refs[b as usize] = 1;
        let evicted = self.hash[b as usize].take();
        if let Some(h) = evicted {
            if self.cached.get(&h) == Some(&b) {
                self.cached.remove(&h);
            }
        }
        Some((b, evicted))
    }

    /// Adds a reference to a cached block (taking it off the free queue if it was there).
    pub fn touch(&mut self, b: u32) {
        if self.in_free[b as usize] {
            self.unlink(b);
        }
        self.refs[b as usize] += 1;
    }

    /// Drops one reference per block, last block first, so that when they become free a sequence's deepest
    /// blocks sit nearer the front of the LRU queue than its root. Uncached blocks go to the very front:
    /// their contents are worth nothing.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let r = &mut self.refs[b as usize];
            assert!(*r > 0, "block {b} released more often than taken");
            *r -= 1;
            if *r == 0 {
                if self.hash[b as usize].is_some() {
                    self.push_back(b);
                } else {
                    self.push_front(b);
                }
            }
        }
    }

    pub fn lookup(&self, h: BlockHash) -> Option<u32> {
        self.cached.get(&h).copied()
    }

    /// Records that `b` (full, computed) holds the block with hash `h`. A hash already cached in another
    /// block is left alone (the duplicate stays uncached).
    pub fn register(&mut self, b: u32, h: BlockHash) {
        if self.hash[b as usize].is_none() && !self.cached.contains_key(&h) {
            self.hash[b as usize] = Some(h);
            self.cached.insert(h, b);
        }
    }

    #[cfg(test)]
    pub fn ref_count(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// Blocks in use (held by a sequence or a checkpoint).
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_deepest_blocks_of_a_finished_prefix_first() {
        let mut p = BlockPool::new(4);
        let blocks: Vec<u32> = (0..3).map(|_| p.allocate().unwrap().0).collect();
        for (i, &b) in blocks.iter().enumerate() {
            p.register(b, 100 + i as u64);
        }
        p.release(&blocks);
        assert_eq!(p.num_free(), 4);
        // The never-used block first, then the deepest cached block (hash 102), then 101, then the root.
        assert_eq!(p.allocate().unwrap(), (3, None));
        assert_eq!(p.allocate().unwrap(), (blocks[2], Some(102)));
        assert_eq!(p.lookup(102), None);
        assert_eq!(p.lookup(100), Some(blocks[0]));
        // Touching the root takes it off the queue; 101 goes next.
        p.touch(blocks[0]);
        assert_eq!(p.allocate().unwrap(), (blocks[1], Some(101)));
        assert!(p.allocate().is_none());
        p.release(&[blocks[0]]);
        assert_eq!(p.lookup(100), Some(blocks[0]));
    }

    #[test]
    fn shared_blocks_stay_until_the_last_reference_goes() {
        let mut p = BlockPool::new(2);
        let (b, _) = p.allocate().unwrap();
        p.register(b, 7);
        p.touch(b);
        p.release(&[b]);
        assert_eq!(p.num_free(), 1);
        p.release(&[b]);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.ref_count(b), 0);
        // A duplicate hash is not registered twice.
        let (c, _) = p.allocate().unwrap();
        p.register(c, 7);
        assert_eq!(p.lookup(7), Some(b));
    }
}
