//! Causal grouped-query attention of new queries against one sequence's contiguous K/V cache, as
//! transformers' eager attention: `softmax(q·kᵀ·scale + causal mask)` in f32 with max subtraction, then
//! the probabilities times V.
//!
//! A task is either one query row with all the query heads of one KV group (when a group has at least
//! `GROUP_MIN` heads) or a block of `Q_BLOCK` query rows of one head; either way its rows share every key
//! and value row they load. Scores are an NT product and the weighted sum of values an NN product of
//! `gemm.rs`, whose per-element reduction order does not depend on the tiling, so every output row is the
//! same whatever the task split, `t` split or thread count (masked keys get probability exactly 0 and
//! add nothing).

use rayon::prelude::*;

use super::gemm::{gemm_nn, gemm_nt, Mat, MatMut};
use super::{SharedOut, PAR_MIN_WORK};

/// Query rows per task when a task takes a block of rows of one head.
const Q_BLOCK: usize = 16;

/// Query heads per KV head from which a task takes all the heads of one KV group for one query row
/// (every key row then serves that many query rows at once).
const GROUP_MIN: usize = 4;

/// The heads of a grouped-query attention: `hq` query heads over `hkv` KV heads of width `d` (query
/// head `h` reads KV head `h / (hq / hkv)`), scores scaled by `scale` (usually `d^-0.5`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heads {
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub scale: f32,
}

/// The sizes of an [`attention_causal`] call: `t` new queries, which are the last `t` of the `len`
/// cached positions, over `heads`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Causal {
    pub t: usize,
    pub len: usize,
    pub heads: Heads,
}

/// One task's operands: `m` query rows (`q`, stride `ldq`) against the first `ctx` rows of one KV
/// head (`k`, `v`, stride `ldkv`).
struct Task<'a> {
    q: &'a [f32],
    ldq: usize,
    m: usize,
    k: &'a [f32],
    v: &'a [f32],
    ldkv: usize,
    ctx: usize,
}

/// Attention of a task's query rows, row `r` seeing its first `visible(r)` keys, over heads of width
/// `d` with scores scaled by `scale`. Returns the `[m, d]` outputs, which live in `scratch`.
fn attend<'s>(
    task: &Task<'_>,
    d: usize,
    scale: f32,
    visible: impl Fn(usize) -> usize,
    scratch: &'s mut Vec<f32>,
) -> &'s [f32] {
    let Task {
        q,
        ldq,
        m,
        k,
        v,
        ldkv,
        ctx,
    } = *task;
    scratch.resize(m * ctx + m * d, 0.0);
    let (scores, o) = scratch.split_at_mut(m * ctx);
    gemm_nt(
        Mat::new(q, ldq),
        Mat::new(k, ldkv),
        MatMut::new(scores, ctx),
        m,
        d,
        ctx,
    );
    for (r, row) in scores.chunks_exact_mut(ctx).enumerate() {
        let (seen, masked) = row.split_at_mut(visible(r));
        let mut max = f32::NEG_INFINITY;
        for x in seen.iter_mut() {
            *x *= scale;
            max = max.max(*x);
        }
        let mut sum = 0f32;
        for x in seen.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        for x in seen.iter_mut() {
            *x /= sum;
        }
        masked.fill(0.0);
    }
    gemm_nn(
        Mat::new(scores, ctx),
        Mat::new(v, ldkv),
        MatMut::new(o, d),
        m,
        ctx,
        d,
    );
    o
}

/// Causal GQA attention of `c.t` new queries against a cache of `c.len` positions.
///
/// `q`: `[t, hq, d]` (already normed and roped); `k_cache`, `v_cache`: `[len, hkv, d]` holding positions
/// `0..len`, the queries being positions `len − t .. len − 1`, so query row `i` attends to cache rows
/// `0 ..= len − t + i`; query head `h` reads KV head `h / (hq / hkv)`; scores are scaled by
/// `c.heads.scale`. `out`: `[t, hq, d]`. Parallel over (query block, head) tasks when large.
pub fn attention_causal(q: &[f32], k_cache: &[f32], v_cache: &[f32], c: &Causal, out: &mut [f32]) {
    let Causal {
        t,
        len,
        heads: Heads { hq, hkv, d, scale },
    } = *c;
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
    let n_rep = hq / hkv;
    let past = len - t;
    let ldkv = hkv * d;
    let shared = SharedOut::new(out);
    // SAFETY (both task kinds): a task writes only the rows out[i, h, :] of its own (row, head) pairs;
    // distinct tasks own distinct pairs, and `out` stays borrowed until every task has finished.
    let by_group = n_rep >= GROUP_MIN;
    let run = |scratch: &mut Vec<f32>, task: usize| {
        if by_group {
            // One query row, all heads of one KV group: consecutive heads are rows of stride d.
            let (i, g) = (task / hkv, task % hkv);
            let h0 = g * n_rep;
            let ctx = past + i + 1;
            let (kc, vc) = (&k_cache[g * d..], &v_cache[g * d..]);
            let qs = &q[(i * hq + h0) * d..];
            let task = Task {
                q: qs,
                ldq: d,
                m: n_rep,
                k: kc,
                v: vc,
                ldkv,
                ctx,
            };
            let o = attend(&task, d, scale, |_| ctx, scratch);
            // SAFETY: rows out[i, h0..h0 + n_rep, :] belong to this task alone.
            let dst = unsafe { shared.slice((i * hq + h0) * d, n_rep * d) };
            dst.copy_from_slice(o);
        } else {
            // A block of query rows of one head.
            let (b, h) = (task / hq, task % hq);
            let (i0, i1) = (b * Q_BLOCK, ((b + 1) * Q_BLOCK).min(t));
            let g = h / n_rep;
            let (kc, vc) = (&k_cache[g * d..], &v_cache[g * d..]);
            let qs = &q[(i0 * hq + h) * d..];
            let vis = |r: usize| past + i0 + r + 1;
            let task = Task {
                q: qs,
                ldq: hq * d,
                m: i1 - i0,
                k: kc,
                v: vc,
                ldkv,
                ctx: past + i1,
            };
            let o = attend(&task, d, scale, vis, scratch);
            for (r, row) in o.chunks_exact(d).enumerate() {
                // SAFETY: row out[i0 + r, h, :] belongs to this task alone.
                let dst = unsafe { shared.slice(((i0 + r) * hq + h) * d, d) };
                dst.copy_from_slice(row);
            }
        }
    };
    let tasks = if by_group {
        t * hkv
    } else {
        t.div_ceil(Q_BLOCK) * hq
    };
    let work = 2 * t * hq * len * d;
    if work < PAR_MIN_WORK || tasks == 1 {
        let mut scratch = Vec::new();
        (0..tasks).for_each(|task| run(&mut scratch, task));
    } else {
        (0..tasks)
            .into_par_iter()
            .for_each_init(Vec::new, |scratch, task| run(scratch, task));
    }
}
