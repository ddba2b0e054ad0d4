//! Causal grouped-query attention of new queries against one sequence's contiguous K/V cache, as
//! transformers' eager attention: `softmax(q·kᵀ·scale + causal mask)` in f32 with max subtraction, then
//! the probabilities times V.
//!
//! Work is split into tasks of (`Q_BLOCK` query rows, one query head); inside a task each cached key and
//! value row is loaded once for all rows of the block. Every output row is reduced in the same order
//! whatever the blocking, so results do not depend on `t` splits or thread count.

use rayon::prelude::*;

use super::{dot_fma, multiversion, SharedOut, PAR_MIN_WORK};

/// Query rows per task.
const Q_BLOCK: usize = 16;

multiversion! {
    /// Rows `i0..i1` of query head `h`; `scores` is scratch of at least `(i1 − i0) · len` floats.
    fn block(
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        t: usize,
        len: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        scale: f32,
        h: usize,
        i0: usize,
        i1: usize,
        scores: &mut [f32],
        out: SharedOut,
    ) {
        let kvh = h / (hq / hkv);
        let past = len - t;
        let rows = i1 - i0;
        let ctx_last = past + i1; // keys visible to the last row of the block
        let first_row = |j: usize| i0.max(j.saturating_sub(past));
        let qrow = |i: usize| &q[(i * hq + h) * d..(i * hq + h + 1) * d];
        let sc = |i: usize| (i - i0) * len;
        // Scores, one key row at a time for every row that sees it.
        for j in 0..ctx_last {
            let kj = &k_cache[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
            for i in first_row(j)..i1 {
                scores[sc(i) + j] = dot_fma(qrow(i), kj) * scale;
            }
        }
        // Softmax per row over its visible keys.
        for i in i0..i1 {
            let row = &mut scores[sc(i)..sc(i) + past + i + 1];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = 0f32;
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            for x in row.iter_mut() {
                *x /= sum;
            }
        }
        // Probabilities times V, one value row at a time.
        // SAFETY: this task alone writes out[i, h, :] for i in i0..i1 (rows of distinct (i, h) are
        // disjoint); the slices are built once and not aliased.
        let mut outs: [&mut [f32]; Q_BLOCK] = Default::default();
        for (r, o) in outs.iter_mut().take(rows).enumerate() {
            *o = unsafe { out.slice((i0 + r) * hq * d + h * d, d) };
            o.fill(0.0);
        }
        for j in 0..ctx_last {
            let vj = &v_cache[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
            for i in first_row(j)..i1 {
                let p = scores[sc(i) + j];
                for (o, v) in outs[i - i0].iter_mut().zip(vj) {
                    *o = p.mul_add(*v, *o);
                }
            }
        }
    }
}

/// Causal GQA attention of `t` new queries against a cache of `len` positions.
///
/// `q`: `[t, hq, d]` (already normed and roped); `k_cache`, `v_cache`: `[len, hkv, d]` holding positions
/// `0..len`, the queries being positions `len − t .. len − 1`, so query row `i` attends to cache rows
/// `0 ..= len − t + i`; query head `h` reads KV head `h / (hq / hkv)`. `scale` is usually `d^-0.5`.
/// `out`: `[t, hq, d]`. Parallel over (query block, head) tasks when large.
#[allow(clippy::too_many_arguments)]
pub fn attention_causal(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    t: usize,
    len: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(
        t <= len,
        "attention_causal: more queries than cached positions"
    );
    assert!(
        hkv > 0 && hq.is_multiple_of(hkv),
        "attention_causal: hq must be a multiple of hkv"
    );
    assert_eq!(
        q.len(),
        t * hq * d,
        "attention_causal: q must be [t, hq, d]"
    );
    assert_eq!(
        k_cache.len(),
        len * hkv * d,
        "attention_causal: k_cache must be [len, hkv, d]"
    );
    assert_eq!(
        v_cache.len(),
        len * hkv * d,
        "attention_causal: v_cache must be [len, hkv, d]"
    );
    assert_eq!(
        out.len(),
        t * hq * d,
        "attention_causal: out must be [t, hq, d]"
    );
    if t == 0 || hq == 0 || d == 0 {
        return;
    }
    let blocks = t.div_ceil(Q_BLOCK);
    let shared = SharedOut::new(out);
    let run = |scores: &mut Vec<f32>, task: usize| {
        let (b, h) = (task / hq, task % hq);
        let (i0, i1) = (b * Q_BLOCK, ((b + 1) * Q_BLOCK).min(t));
        scores.resize((i1 - i0) * len, 0.0);
        block(
            q, k_cache, v_cache, t, len, hq, hkv, d, scale, h, i0, i1, scores, shared,
        );
    };
    let tasks = blocks * hq;
    let work = 2 * t * hq * len * d;
    if work < PAR_MIN_WORK || tasks == 1 {
        let mut scores = Vec::new();
        (0..tasks).for_each(|task| run(&mut scores, task));
    } else {
        (0..tasks)
            .into_par_iter()
            .for_each_init(Vec::new, |scores, task| run(scores, task));
    }
}
