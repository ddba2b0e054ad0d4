//! Truncation of the temperature-scaled distribution (top-k → top-p → min-p) and the weighted draw.
//!
//! Tokens are ranked by a total order: larger logit first, lower id first among equal logits. Each filter
//! keeps a prefix of that ranking:
//! - top-k keeps the first `k`;
//! - top-p keeps the shortest prefix whose mass reaches `top_p` times the mass left by top-k
//!   (the token that crosses the threshold is kept, as in vLLM);
//! - min-p keeps tokens whose probability is at least `min_p` times the largest.
//!
//! The draw is an inverse CDF over the kept tokens **in id order** with one uniform from the request's
//! stream: `u · mass` lands on the first token whose cumulative weight exceeds it. Id order (not rank
//! order) is what a device kernel can walk without sorting, so host and device pick the same token for
//! the same uniform (up to rounding of the cumulative sums).
//!
//! Nothing sorts the row. Candidates are gathered by a logit threshold from the blocks whose maximum
//! reaches it: for top-k the threshold is the k-th largest block maximum (at least `k` tokens lie above
//! it; with fewer blocks than `k`, the k-th largest value among the leading blocks), for top-p it is
//! lowered in steps until the gathered mass reaches the target. The survivors are
//! then cut with `select_nth_unstable` (top-k) and a select-based partition on cumulative mass (top-p).

use std::cmp::Ordering;
use std::f32::consts::LN_2;

use super::math::{block, exp_nonpos, LevelMass, BLOCK, LEVELS};

/// A token still in the running.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    pub id: u32,
    /// Its (edited) logit.
    pub z: f32,
    /// Its unnormalised probability `e^((z - max) / T)`.
    pub w: f32,
}

/// The ranking: larger logit first, then lower id.
pub(crate) fn by_rank(a: &Candidate, b: &Candidate) -> Ordering {
    b.z.total_cmp(&a.z).then(a.id.cmp(&b.id))
}

fn mass(cands: &[Candidate]) -> f64 {
    cands.iter().map(|c| c.w as f64).sum()
}

/// The truncation filters of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Truncation {
    /// `None` when off or not smaller than the vocabulary.
    pub top_k: Option<usize>,
    pub top_p: f32,
    pub min_p: f32,
}

impl Truncation {
    /// Whether [`select`] needs the total mass of the row (top-p without top-k, or no filter at all).
    pub fn needs_total(&self) -> bool {
        self.top_k.is_none() && (self.top_p < 1.0 || self.min_p <= 0.0)
    }

    /// Whether [`select`] can use the level masses of the weights pass (top-p without top-k).
    pub fn uses_levels(&self) -> bool {
        self.top_k.is_none() && self.top_p < 1.0
    }
}

/// The edited row as the filters see it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scaled<'a> {
    pub row: &'a [f32],
    /// Maximum of every block of `row`.
    pub maxima: &'a [f32],
    /// Maximum of `row` (finite).
    pub m: f32,
    /// `1 / temperature`.
    pub scale: f32,
}

impl Scaled<'_> {
    /// Unnormalised probability of logit `z`; exactly 1 at the maximum.
    pub fn weight(&self, z: f32) -> f32 {
        exp_nonpos((z - self.m) * self.scale)
    }

    /// Gathers every token with logit `>= tau` and positive weight, skipping blocks whose max is below.
    fn gather(&self, tau: f32, out: &mut Vec<Candidate>) {
        out.clear();
        for (b, &bm) in self.maxima.iter().enumerate() {
            if bm < tau {
                continue;
            }
            for (j, &z) in block(self.row, b).iter().enumerate() {
                if z >= tau {
                    let w = self.weight(z);
                    if w > 0.0 {
                        out.push(Candidate {
                            id: (b * BLOCK + j) as u32,
                            z,
                            w,
                        });
                    }
                }
            }
        }
    }
}

/// The `k`-th largest block maximum: at least `k` tokens have a logit at or above it.
fn kth_block_max(maxima: &[f32], k: usize, tmp: &mut Vec<f32>) -> f32 {
    if k == 0 || k > maxima.len() {
        return f32::NEG_INFINITY;
    }
    tmp.clear();
    tmp.extend_from_slice(maxima);
    *tmp.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a)).1
}

/// A logit that at least `k` tokens reach (any `k` values of the row bound its `k`-th largest from
/// below): the `k`-th largest block maximum, or with fewer than `k` blocks the `k`-th largest value of
/// the blocks with the largest maxima.
fn kth_lower_bound(s: &Scaled<'_>, k: usize, tmp: &mut Vec<f32>) -> f32 {
    let blocks = s.maxima.len();
    if k <= blocks {
        return kth_block_max(s.maxima, k, tmp);
    }
    // Enough whole blocks to hold `k` values even if one of them is the short last block.
    let need = (k.div_ceil(BLOCK) + 1).min(blocks);
    let cut = kth_block_max(s.maxima, need, tmp);
    tmp.clear();
    for (b, &bm) in s.maxima.iter().enumerate() {
        if bm >= cut {
            tmp.extend(block(s.row, b).iter().filter(|z| !z.is_nan()));
        }
    }
    if tmp.len() < k {
        return f32::NEG_INFINITY;
    }
    *tmp.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a)).1
}

/// Keeps the first `k` candidates of the ranking (in no particular order).
pub(crate) fn keep_top_k(cands: &mut Vec<Candidate>, k: usize) {
    if k == 0 || cands.len() <= k {
        return;
    }
    cands.select_nth_unstable_by(k - 1, by_rank);
    cands.truncate(k);
}

/// Candidates at or below this many are sorted outright instead of partitioned further.
const SORT_BELOW: usize = 64;

/// Reorders `cands` so that the shortest prefix of the ranking reaching `target` mass comes first and
/// returns its length (all of them if the target is never reached).
fn top_p_prefix(cands: &mut [Candidate], target: f64) -> usize {
    // Invariant: [0, lo) ranks before [lo, hi), which ranks before [hi, len); `before` is the mass of
    // [0, lo), which is below the target; the cut lies in [lo, hi).
    let (mut lo, mut hi, mut before) = (0, cands.len(), 0.0f64);
    while hi - lo > SORT_BELOW {
        let mid = lo + (hi - lo) / 2;
        cands[lo..hi].select_nth_unstable_by(mid - lo, by_rank);
        let left = before + mass(&cands[lo..mid]);
        if left >= target {
            hi = mid;
            continue;
        }
        let through_mid = left + cands[mid].w as f64;
        if through_mid >= target {
            return mid + 1;
        }
        before = through_mid;
        lo = mid + 1;
    }
    cands[lo..hi].sort_unstable_by(by_rank);
    for (i, c) in cands[lo..hi].iter().enumerate() {
        before += c.w as f64;
        if before >= target {
            return lo + i + 1;
        }
    }
    hi
}

/// Keeps candidates whose weight is at least `min_p` (the largest weight being 1).
fn keep_min_p(cands: &mut Vec<Candidate>, min_p: f32) {
    if min_p > 0.0 {
        cands.retain(|c| c.w >= min_p);
    }
}

/// The last-ranked candidate of the kept prefix `cands[..n]` after [`top_p_prefix`] or a top-k
/// selection placed it at `n - 1`; `None` when the whole set is kept.
fn cut_at(cands: &[Candidate], n: usize) -> Option<Candidate> {
    (n < cands.len() && n > 0).then(|| cands[n - 1])
}

/// Applies the filters. `total` is the row's total weight, read only when [`Truncation::needs_total`];
/// `levels`, when known, are the masses at the weight levels of [`LEVELS`] (where top-p starts looking).
///
/// Returns `false` when nothing is filtered out (draw from the whole row), else `true` with the kept
/// tokens in `cands`, in id order. `work` is scratch.
pub(crate) fn select(
    s: &Scaled<'_>,
    t: &Truncation,
    total: f64,
    levels: Option<&LevelMass>,
    tmp: &mut Vec<f32>,
    cands: &mut Vec<Candidate>,
    work: &mut Vec<Candidate>,
) -> bool {
    let top_p = t.top_p < 1.0;
    // The kept set is a prefix of the ranking: everything up to `cut` (gathered in id order).
    let mut cut = None;
    if let Some(k) = t.top_k {
        s.gather(kth_lower_bound(s, k, tmp), cands);
        work.clear();
        work.extend_from_slice(cands);
        if work.len() > k {
            keep_top_k(work, k);
            cut = Some(work[k - 1]);
        }
        if top_p {
            let target = t.top_p as f64 * mass(work);
            let n = top_p_prefix(work, target);
            cut = cut_at(work, n).or(cut);
        }
    } else if top_p {
        let target = t.top_p as f64 * total;
        // Gather tokens of weight >= 2^-j for growing j until they hold the target mass, starting at the
        // first level the weights pass saw reach it (the gathered mass is checked again: rounding).
        let first = levels.map_or(0, |lv| {
            lv.iter().position(|&m| m >= target).unwrap_or(LEVELS.len())
        });
        let found = LEVELS[first..].iter().any(|&j| {
            s.gather(s.m - j * LN_2 / s.scale, cands);
            mass(cands) >= target
        });
        if !found {
            s.gather(f32::NEG_INFINITY, cands);
        }
        work.clear();
        work.extend_from_slice(cands);
        let n = top_p_prefix(work, target);
        cut = cut_at(work, n);
    } else if t.min_p > 0.0 {
        // Weight >= min_p means z >= m + ln(min_p) · T; gather with a margin, then test the weights.
        s.gather(s.m + (t.min_p.ln() - 1e-3) / s.scale, cands);
    } else {
        return false;
    }
    if let Some(cut) = cut {
        cands.retain(|c| by_rank(c, &cut) != Ordering::Greater);
    }
    keep_min_p(cands, t.min_p);
    true
}

/// Draws a token with probability proportional to its weight among `cands` (in id order), given a
/// uniform `u` in `[0, 1)`.
pub(crate) fn draw_from(cands: &[Candidate], u: f64) -> Option<u32> {
    let total = mass(cands);
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let u = u * total;
    let mut seen = 0.0f64;
    for c in cands {
        seen += c.w as f64;
        if u < seen {
            return Some(c.id);
        }
    }
    // `u` can only pass the end through rounding: take the last token with weight.
    cands.iter().rev().find(|c| c.w > 0.0).map(|c| c.id)
}

/// Draws from the whole row, given the weight sum of every block (`sums`, total `total`) and a uniform
/// `u` in `[0, 1)`.
pub(crate) fn draw_from_row(s: &Scaled<'_>, sums: &[f32], total: f64, u: f64) -> Option<u32> {
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let mut u = u * total;
    let mut last = None;
    for (b, &bs) in sums.iter().enumerate() {
        if bs <= 0.0 {
            continue;
        }
        last = Some(b);
        if u >= bs as f64 {
            u -= bs as f64;
            continue;
        }
        return pick_in_block(s, b, u);
    }
    // Rounding carried `u` past the last block: take its last token with weight.
    last.and_then(|b| pick_in_block(s, b, f64::INFINITY))
}

fn pick_in_block(s: &Scaled<'_>, b: usize, u: f64) -> Option<u32> {
    let mut seen = 0.0f64;
    let mut last = None;
    for (j, &z) in block(s.row, b).iter().enumerate() {
        let w = s.weight(z);
        if w > 0.0 {
            last = Some((b * BLOCK + j) as u32);
            seen += w as f64;
            if u < seen {
                return last;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::math::{block_exp_sums, block_maxima};
    use crate::sample::rng::TestRng as Rng;

    /// The kept set by definition: rank every token, then apply each filter to the ranked list.
    fn reference(s: &Scaled<'_>, total: f64, t: &Truncation) -> Vec<u32> {
        let mut ranked: Vec<Candidate> = (0..s.row.len())
            .map(|i| Candidate {
                id: i as u32,
                z: s.row[i],
                w: s.weight(s.row[i]),
            })
            .filter(|c| c.w > 0.0)
            .collect();
        ranked.sort_by(by_rank);
        if let Some(k) = t.top_k {
            ranked.truncate(k);
        }
        if t.top_p < 1.0 {
            let base = if t.top_k.is_some() {
                mass(&ranked)
            } else {
                total
            };
            let target = t.top_p as f64 * base;
            let mut seen = 0.0;
            let end = ranked
                .iter()
                .position(|c| {
                    seen += c.w as f64;
                    seen >= target
                })
                .map_or(ranked.len(), |i| i + 1);
            ranked.truncate(end);
        }
        ranked.retain(|c| c.w >= t.min_p);
        let mut ids: Vec<u32> = ranked.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids
    }

    fn kept(s: &Scaled<'_>, total: f64, levels: Option<&LevelMass>, t: &Truncation) -> Vec<u32> {
        let mut cands = Vec::new();
        let mut ids: Vec<u32> = if select(
            s,
            t,
            total,
            levels,
            &mut Vec::new(),
            &mut cands,
            &mut Vec::new(),
        ) {
            assert!(cands.windows(2).all(|w| w[0].id < w[1].id), "id order");
            cands.iter().map(|c| c.id).collect()
        } else {
            (0..s.row.len() as u32)
                .filter(|&i| s.weight(s.row[i as usize]) > 0.0)
                .collect()
        };
        ids.sort_unstable();
        ids
    }

    #[test]
    fn selection_matches_the_definition_on_random_rows() {
        let mut rng = Rng::seeded(99);
        let (mut maxima, mut sums) = (Vec::new(), Vec::new());
        for case in 0..600 {
            let n = 1 + (rng.next_u64() % 6000) as usize;
            // Peaked to flat spreads, quantised values (many exact ties), and some -inf entries.
            let spread = [0.5f64, 2.0, 6.0, 20.0, 200.0][case % 5];
            let row: Vec<f32> = (0..n)
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
            let m = block_maxima(&row, &mut maxima);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let temp = [0.3f32, 0.7, 1.0, 1.5][(case / 5) % 4];
            let s = Scaled {
                row: &row,
                maxima: &maxima,
                m,
                scale: 1.0 / temp,
            };
            let mut levels = [0.0; LEVELS.len()];
            let total = block_exp_sums(&row, m, s.scale, &mut sums, Some(&mut levels));
            let top_k = [
                None,
                Some(1),
                Some(7),
                Some(50),
                Some(n / 3 + 1),
                Some(n / 2 + 200),
            ][case % 6];
            let top_k = top_k.filter(|&k| k < n);
            let top_p = [1.0f32, 0.9, 0.5, 0.999, 0.05][(case / 6) % 5];
            let min_p = [0.0f32, 0.0, 0.01, 0.3, 1.0][(case / 30) % 5];
            let t = Truncation {
                top_k,
                top_p,
                min_p,
            };
            let want = reference(&s, total, &t);
            assert_eq!(kept(&s, total, None, &t), want, "case {case}: {t:?} n={n}");
            assert_eq!(
                kept(&s, total, Some(&levels), &t),
                want,
                "case {case} with levels"
            );
        }
    }

    #[test]
    fn top_p_prefix_finds_the_cut_in_large_sets() {
        let mut rng = Rng::seeded(5);
        for _ in 0..50 {
            let n = 1 + (rng.next_u64() % 5000) as usize;
            let mut cands: Vec<Candidate> = (0..n)
                .map(|i| {
                    let z = (rng.next_f64() * 10.0) as f32;
                    Candidate {
                        id: i as u32,
                        z,
                        w: (z as f64 - 10.0).exp() as f32,
                    }
                })
                .collect();
            let target = rng.next_f64() * mass(&cands);
            let mut sorted = cands.clone();
            sorted.sort_by(by_rank);
            let mut seen = 0.0;
            let want = sorted.iter().position(|c| {
                seen += c.w as f64;
                seen >= target
            });
            let got = top_p_prefix(&mut cands, target);
            let mut got_ids: Vec<u32> = cands[..got].iter().map(|c| c.id).collect();
            let mut want_ids: Vec<u32> = sorted[..want.map_or(n, |i| i + 1)]
                .iter()
                .map(|c| c.id)
                .collect();
            got_ids.sort_unstable();
            want_ids.sort_unstable();
            assert_eq!(got_ids, want_ids);
        }
    }

    #[test]
    fn draws_follow_the_weights() {
        let row = [
            f32::NEG_INFINITY,
            0.0,
            -std::f32::consts::LN_2,
            f32::NEG_INFINITY,
            -2.0 * LN_2,
            -2.0 * LN_2,
        ];
        let maxima = [0.0f32];
        let s = Scaled {
            row: &row,
            maxima: &maxima,
            m: 0.0,
            scale: 1.0,
        };
        let weights: Vec<f32> = row.iter().map(|&z| s.weight(z)).collect();
        let cands: Vec<Candidate> = (0..6)
            .map(|i| Candidate {
                id: i as u32,
                z: row[i],
                w: weights[i],
            })
            .collect();
        let total: f64 = weights.iter().map(|&w| w as f64).sum();
        let sums = [total as f32];
        let mut rng = Rng::seeded(3);
        let (mut from_cands, mut from_row) = ([0u32; 6], [0u32; 6]);
        for _ in 0..40_000 {
            from_cands[draw_from(&cands, rng.next_f64()).unwrap() as usize] += 1;
            from_row[draw_from_row(&s, &sums, total, rng.next_f64()).unwrap() as usize] += 1;
        }
        for counts in [from_cands, from_row] {
            assert_eq!(counts[0] + counts[3], 0);
            for (i, &w) in weights.iter().enumerate() {
                let p = counts[i] as f64 / 40_000.0;
                assert!((p - w as f64 / total).abs() < 0.01, "{counts:?}");
            }
        }
        assert_eq!(
            draw_from(
                &[Candidate {
                    id: 4,
                    z: 0.0,
                    w: 0.0
                }],
                rng.next_f64()
            ),
            None
        );
        assert_eq!(draw_from_row(&s, &[0.0], 0.0, rng.next_f64()), None);
    }
}
