//! Truncation of the temperature-scaled distribution (top-k → top-p → min-p) and the weighted draw.
//!
//! Tokens are ranked by a total order: larger weight first, lower id first among equal weights. Each
//! filter keeps a prefix of that ranking:
//! - top-k keeps the first `k`;
//! - top-p keeps the shortest prefix whose mass reaches `top_p` times the mass left by top-k
//!   (the token that crosses the threshold is kept, as in vLLM);
//! - min-p keeps tokens whose weight is at least `min_p` times the largest weight.
//!
//! Sorting the whole row is avoided: one pass builds a histogram of weights (8 buckets per octave over 24
//! octaves below the maximum, one bucket for the rest), which tells how far down the ranking the cut can
//! reach. Only tokens above that bucket's lower edge are gathered, top-k uses `select_nth_unstable`, and
//! top-p without top-k sorts only the bucket the cut falls in.

use std::cmp::Ordering;

use super::math::CHUNK;
use super::rng::Rng;

/// A surviving token: `(id, weight)`.
pub(crate) type Candidate = (u32, f32);

/// Mantissa bits that subdivide an octave into buckets.
const SUB_BITS: u32 = 3;
const SHIFT: u32 = 23 - SUB_BITS;
/// Octaves below the maximum weight with their own buckets.
const OCTAVES: u32 = 24;
/// Bucket key of weight 1.0 (the maximum).
const ONE_KEY: u32 = 1.0f32.to_bits() >> SHIFT;
/// Bucket of all weights below `2^-OCTAVES`, zero included.
const CATCH_ALL: usize = ((OCTAVES << SUB_BITS) + 1) as usize;
const BUCKETS: usize = CATCH_ALL + 1;
/// Bit pattern of `2^-OCTAVES`, the smallest weight with a bucket of its own.
const FLOOR_BITS: u32 = (127 - OCTAVES) << 23;

/// The ranking: larger weight first, then lower id.
pub(crate) fn by_rank(a: &Candidate, b: &Candidate) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Smallest bit pattern of a weight in buckets `0..=b` (weights are non-negative, so bit order is value
/// order); the catch-all bucket starts at the smallest positive weight.
fn lower_bits(b: usize) -> u32 {
    if b >= CATCH_ALL {
        1
    } else {
        (ONE_KEY - b as u32) << SHIFT
    }
}

/// The truncation filters of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Truncation {
    pub top_k: Option<usize>,
    pub top_p: f32,
    pub min_p: f32,
}

/// Counts and masses of weights per bucket.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    count: [u32; BUCKETS],
    mass: [f64; BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            count: [0; BUCKETS],
            mass: [0.0; BUCKETS],
        }
    }
}

impl Histogram {
    /// Buckets `weights` (all in `[0, 1]`) whose sum is `total`.
    fn build(&mut self, weights: &[f32], total: f64) {
        self.count = [0; BUCKETS];
        self.mass = [0.0; BUCKETS];
        for &w in weights {
            let bits = w.to_bits();
            if bits >= FLOOR_BITS {
                let b = (ONE_KEY.saturating_sub(bits >> SHIFT) as usize).min(CATCH_ALL - 1);
                self.count[b] += 1;
                self.mass[b] += w as f64;
            }
        }
        let counted: u64 = self.count.iter().map(|&c| c as u64).sum();
        self.count[CATCH_ALL] = (weights.len() as u64).saturating_sub(counted) as u32;
        self.mass[CATCH_ALL] = (total - self.mass.iter().sum::<f64>()).max(0.0);
    }

    /// First bucket by which at least `k` weights have been seen.
    fn bucket_for_count(&self, k: usize) -> usize {
        let mut seen = 0usize;
        for (b, &c) in self.count.iter().enumerate() {
            seen += c as usize;
            if seen >= k {
                return b;
            }
        }
        CATCH_ALL
    }

    /// First bucket by which at least `target` mass has been seen.
    fn bucket_for_mass(&self, target: f64) -> usize {
        let mut seen = 0.0f64;
        for (b, &m) in self.mass.iter().enumerate() {
            seen += m;
            if seen >= target {
                return b;
            }
        }
        CATCH_ALL
    }
}

/// Gathers every `(id, w)` with `w.to_bits() >= min_bits` into `out`.
fn gather(weights: &[f32], min_bits: u32, out: &mut Vec<Candidate>) {
    out.clear();
    for (i, &w) in weights.iter().enumerate() {
        if w.to_bits() >= min_bits {
            out.push((i as u32, w));
        }
    }
}

fn mass(cands: &[Candidate]) -> f64 {
    cands.iter().map(|c| c.1 as f64).sum()
}

/// Keeps the first `k` candidates of the ranking (in no particular order).
pub(crate) fn keep_top_k(cands: &mut Vec<Candidate>, k: usize) {
    if k == 0 || cands.len() <= k {
        return;
    }
    cands.select_nth_unstable_by(k - 1, by_rank);
    cands.truncate(k);
}

/// Top-p over candidates already sorted by rank: keeps the shortest prefix reaching `target` mass.
fn cut_sorted(cands: &mut Vec<Candidate>, start_mass: f64, from: usize, target: f64) {
    let mut seen = start_mass;
    for i in from..cands.len() {
        seen += cands[i].1 as f64;
        if seen >= target {
            cands.truncate(i + 1);
            return;
        }
    }
}

/// Top-p over the whole candidate set: sorts it and keeps the prefix reaching `top_p` of its mass.
pub(crate) fn keep_top_p(cands: &mut Vec<Candidate>, top_p: f32) {
    let target = top_p as f64 * mass(cands);
    cands.sort_unstable_by(by_rank);
    cut_sorted(cands, 0.0, 0, target);
}

/// Top-p when the candidates are every weight of buckets `0..=b` and `target` mass lies in bucket `b`:
/// earlier buckets are kept whole, only bucket `b` is sorted.
fn keep_top_p_in_bucket(cands: &mut Vec<Candidate>, b: usize, target: f64) {
    let split = if b == 0 { u32::MAX } else { lower_bits(b - 1) };
    let mut whole = 0;
    for i in 0..cands.len() {
        if cands[i].1.to_bits() >= split {
            cands.swap(i, whole);
            whole += 1;
        }
    }
    let whole_mass = mass(&cands[..whole]);
    if whole_mass >= target {
        // Rounding put the cut above bucket `b`: resolve it among the whole buckets.
        cands.truncate(whole);
        cands.sort_unstable_by(by_rank);
        cut_sorted(cands, 0.0, 0, target);
        return;
    }
    cands[whole..].sort_unstable_by(by_rank);
    cut_sorted(cands, whole_mass, whole, target);
}

/// Keeps candidates of weight at least `min_p` (the largest weight being 1).
pub(crate) fn keep_min_p(cands: &mut Vec<Candidate>, min_p: f32) {
    if min_p > 0.0 {
        cands.retain(|c| c.1 >= min_p);
    }
}

/// Applies the filters to `weights` (largest exactly 1, sum `total`).
///
/// Returns `false` when nothing is filtered out (draw from the whole row), else `true` with the kept
/// tokens in `cands`.
pub(crate) fn truncate(
    weights: &[f32],
    total: f64,
    t: &Truncation,
    hist: &mut Histogram,
    cands: &mut Vec<Candidate>,
) -> bool {
    let top_k = t.top_k.filter(|&k| k < weights.len());
    let top_p = t.top_p < 1.0;
    match (top_k, top_p) {
        (None, false) => {
            if t.min_p <= 0.0 {
                return false;
            }
            gather(weights, t.min_p.to_bits().max(1), cands);
            return true;
        }
        (Some(k), _) => {
            hist.build(weights, total);
            gather(weights, lower_bits(hist.bucket_for_count(k)), cands);
            keep_top_k(cands, k);
            if top_p {
                keep_top_p(cands, t.top_p);
            }
        }
        (None, true) => {
            hist.build(weights, total);
            let target = t.top_p as f64 * total;
            let b = hist.bucket_for_mass(target);
            gather(weights, lower_bits(b), cands);
            keep_top_p_in_bucket(cands, b, target);
        }
    }
    keep_min_p(cands, t.min_p);
    true
}

/// Draws a token with probability proportional to its weight among `cands`.
pub(crate) fn draw_from(cands: &[Candidate], rng: &mut Rng) -> Option<u32> {
    let total = mass(cands);
    if !(total > 0.0) {
        return None;
    }
    let u = rng.next_f64() * total;
    let mut seen = 0.0f64;
    for c in cands {
        seen += c.1 as f64;
        if u < seen {
            return Some(c.0);
        }
    }
    // `u` can only pass the end through rounding: take the last token with weight.
    cands.iter().rev().find(|c| c.1 > 0.0).map(|c| c.0)
}

/// Draws from the whole row of `weights`, whose per-[`CHUNK`] sums are `chunk_sums` (total `total`).
pub(crate) fn draw_from_row(
    weights: &[f32],
    chunk_sums: &[f64],
    total: f64,
    rng: &mut Rng,
) -> Option<u32> {
    if !(total > 0.0) {
        return None;
    }
    let mut u = rng.next_f64() * total;
    let mut last = None;
    for (c, &s) in chunk_sums.iter().enumerate() {
        if s <= 0.0 {
            continue;
        }
        last = Some(c);
        if u >= s {
            u -= s;
            continue;
        }
        return pick_in_chunk(weights, c, u);
    }
    // Rounding carried `u` past the last chunk: take its last token with weight.
    last.and_then(|c| pick_in_chunk(weights, c, f64::INFINITY))
}

fn pick_in_chunk(weights: &[f32], c: usize, u: f64) -> Option<u32> {
    let start = c * CHUNK;
    let chunk = weights.get(start..(start + CHUNK).min(weights.len()))?;
    let mut seen = 0.0f64;
    for (i, &w) in chunk.iter().enumerate() {
        seen += w as f64;
        if u < seen {
            return Some((start + i) as u32);
        }
    }
    chunk
        .iter()
        .rposition(|&w| w > 0.0)
        .map(|i| (start + i) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::math::{exp_weights, max};

    /// The kept set by definition: rank everything, then apply each filter to the ranked list.
    /// `total` is the row's mass as the sampler computed it (the top-p base when top-k is off).
    fn reference(weights: &[f32], total: f64, t: &Truncation) -> Vec<u32> {
        let mut ranked: Vec<Candidate> = weights
            .iter()
            .enumerate()
            .filter(|(_, &w)| w > 0.0)
            .map(|(i, &w)| (i as u32, w))
            .collect();
        ranked.sort_by(by_rank);
        if let Some(k) = t.top_k {
            ranked.truncate(k);
        }
        if t.top_p < 1.0 {
            let base = match t.top_k {
                Some(k) if k < weights.len() => ranked.iter().map(|c| c.1 as f64).sum::<f64>(),
                _ => total,
            };
            let target = t.top_p as f64 * base;
            let mut seen = 0.0;
            let end = ranked
                .iter()
                .position(|c| {
                    seen += c.1 as f64;
                    seen >= target
                })
                .map_or(ranked.len(), |i| i + 1);
            ranked.truncate(end);
        }
        ranked.retain(|c| c.1 >= t.min_p);
        let mut ids: Vec<u32> = ranked.iter().map(|c| c.0).collect();
        ids.sort_unstable();
        ids
    }

    fn kept(weights: &[f32], total: f64, t: &Truncation) -> Vec<u32> {
        let mut hist = Histogram::default();
        let mut cands = Vec::new();
        let mut ids: Vec<u32> = if truncate(weights, total, t, &mut hist, &mut cands) {
            cands.iter().map(|c| c.0).collect()
        } else {
            (0..weights.len() as u32)
                .filter(|&i| weights[i as usize] > 0.0)
                .collect()
        };
        ids.sort_unstable();
        ids
    }

    #[test]
    fn truncation_matches_the_definition_on_random_rows() {
        let mut rng = Rng::seeded(99);
        let mut weights = vec![];
        let mut chunk_sums = vec![];
        for case in 0..400 {
            let n = 1 + (rng.next_u64() % 6000) as usize;
            // Mix of spreads (peaked to flat), quantised values (many exact ties), and -inf entries.
            let spread = [0.5f64, 2.0, 6.0, 20.0][case % 4];
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    let u = rng.next_f64();
                    if u < 0.02 {
                        f32::NEG_INFINITY
                    } else if case % 3 == 0 {
                        ((u * 8.0).floor() * spread / 4.0) as f32
                    } else {
                        (u * u * spread) as f32
                    }
                })
                .collect();
            let m = max(&logits);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let temp = [0.3f32, 0.7, 1.0, 1.5][(case / 4) % 4];
            weights.resize(n, 0.0);
            let total = exp_weights(&logits, m, 1.0 / temp, &mut weights, &mut chunk_sums);
            let top_k = [
                None,
                Some(1),
                Some(7),
                Some(50),
                Some(n / 3 + 1),
                Some(n + 5),
            ][case % 6];
            let top_p = [1.0f32, 0.9, 0.5, 0.999, 0.05][(case / 6) % 5];
            let min_p = [0.0f32, 0.0, 0.01, 0.3][(case / 30) % 4];
            let t = Truncation {
                top_k,
                top_p,
                min_p,
            };
            assert_eq!(
                kept(&weights, total, &t),
                reference(&weights, total, &t),
                "case {case}: {t:?} n={n}"
            );
        }
    }

    #[test]
    fn draws_follow_the_weights() {
        let weights = [0.0f32, 1.0, 0.5, 0.0, 0.25, 0.25];
        let cands: Vec<Candidate> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| (i as u32, w))
            .collect();
        let mut rng = Rng::seeded(3);
        let mut from_cands = [0u32; 6];
        let mut from_row = [0u32; 6];
        let chunk_sums = [2.0f64];
        for _ in 0..40_000 {
            from_cands[draw_from(&cands, &mut rng).unwrap() as usize] += 1;
            from_row[draw_from_row(&weights, &chunk_sums, 2.0, &mut rng).unwrap() as usize] += 1;
        }
        for counts in [from_cands, from_row] {
            assert_eq!(counts[0] + counts[3], 0);
            for (i, &w) in weights.iter().enumerate() {
                let p = counts[i] as f64 / 40_000.0;
                assert!((p - w as f64 / 2.0).abs() < 0.01, "{counts:?}");
            }
        }
        assert_eq!(draw_from(&[(4, 0.0)], &mut rng), None);
        assert_eq!(draw_from_row(&[0.0; 4], &[0.0], 0.0, &mut rng), None);
    }
}
