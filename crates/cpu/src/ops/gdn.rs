//! Gated delta rule (GDN linear attention) for one sequence: the recurrent form, and the pieces it shares
//! with the chunked form in `gdn_chunked.rs` (shape checks, q/k preparation, the per-head driver).
//!
//! As transformers with `use_qk_l2norm_in_kernel=True`: q and k are l2-normalised (eps 1e-6) per head in
//! f32, then q is multiplied by `dk^-0.5`. Value head `h` reads key head `h / (hv / hk)`
//! (`repeat_interleave` of the key heads). The state of head `h` is `S[dk, dv]`, f32, and per token
//! `S ← S·exp(g); δ = β(v − Sᵀk); S ← S + k⊗δ; o = Sᵀq`.

use rayon::prelude::*;

use super::{multiversion, norm::l2_row, SharedOut, PAR_MIN_WORK};

/// The sizes of one GDN call.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl Dims {
    /// Checks every slice against the sizes (panics with the op's name on a mismatch).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check(
        &self,
        name: &str,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &[f32],
        out: &[f32],
    ) {
        let Dims { t, hk, hv, dk, dv } = *self;
        assert!(
            hk > 0 && hv.is_multiple_of(hk),
            "{name}: hv must be a positive multiple of hk"
        );
        assert_eq!(q.len(), t * hk * dk, "{name}: q must be [t, hk, dk]");
        assert_eq!(k.len(), t * hk * dk, "{name}: k must be [t, hk, dk]");
        assert_eq!(v.len(), t * hv * dv, "{name}: v must be [t, hv, dv]");
        assert_eq!(g.len(), t * hv, "{name}: g must be [t, hv]");
        assert_eq!(beta.len(), t * hv, "{name}: beta must be [t, hv]");
        assert_eq!(
            state.len(),
            hv * dk * dv,
            "{name}: state must be [hv, dk, dv]"
        );
        assert_eq!(out.len(), t * hv * dv, "{name}: out must be [t, hv, dv]");
    }

    /// The key head value head `h` reads.
    pub(crate) fn key_head(&self, h: usize) -> usize {
        h / (self.hv / self.hk)
    }
}

/// `dk^-0.5` rounded once to f32, the factor transformers multiplies the normalised query by.
pub(crate) fn q_scale(dk: usize) -> f32 {
    (dk as f64).powf(-0.5) as f32
}

/// Writes the l2-normalised, scaled query and the l2-normalised key of token `s`, key head `kh`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_qk(
    q: &[f32],
    k: &[f32],
    d: Dims,
    s: usize,
    kh: usize,
    scale: f32,
    qo: &mut [f32],
    ko: &mut [f32],
) {
    let off = (s * d.hk + kh) * d.dk;
    qo.copy_from_slice(&q[off..off + d.dk]);
    l2_row(qo, 1e-6);
    for x in qo.iter_mut() {
        *x *= scale;
    }
    ko.copy_from_slice(&k[off..off + d.dk]);
    l2_row(ko, 1e-6);
}

/// Runs `head(h, S_h, out)` for every value head, in parallel when the call is large. `work` is the
/// call's multiply-add count. Each head writes only `out[:, h, :]`.
pub(crate) fn for_each_head(
    state: &mut [f32],
    out: &mut [f32],
    d: Dims,
    work: usize,
    head: impl Fn(usize, &mut [f32], SharedOut) + Sync + Send,
) {
    let size = d.dk * d.dv;
    if size == 0 {
        out.fill(0.0);
        return;
    }
    let shared = SharedOut::new(out);
    if work < PAR_MIN_WORK || d.hv == 1 {
        state
            .chunks_exact_mut(size)
            .enumerate()
            .for_each(|(h, s)| head(h, s, shared));
    } else {
        state
            .par_chunks_mut(size)
            .enumerate()
            .for_each(|(h, s)| head(h, s, shared));
    }
}

/// The output row `out[s, h, :]` of value head `h`.
///
/// # Safety
/// Only the task of head `h` may call this for `h`, and it may hold one such row at a time.
#[inline(always)]
#[allow(clippy::mut_from_ref)]
pub(crate) unsafe fn out_row(out: &SharedOut, d: Dims, s: usize, h: usize) -> &mut [f32] {
    // SAFETY: rows of distinct (s, h) are disjoint; the caller's contract keeps them exclusive.
    unsafe { out.slice((s * d.hv + h) * d.dv, d.dv) }
}

multiversion! {
    fn recurrent_head(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        st: &mut [f32],
        out: SharedOut,
        d: Dims,
        h: usize,
    ) {
        let (dk, dv) = (d.dk, d.dv);
        let kh = d.key_head(h);
        let scale = q_scale(dk);
        let mut qv = vec![0f32; dk];
        let mut kv = vec![0f32; dk];
        let mut mem = vec![0f32; dv];
        for s in 0..d.t {
            load_qk(q, k, d, s, kh, scale, &mut qv, &mut kv);
            let decay = g[s * d.hv + h].exp();
            let b = beta[s * d.hv + h];
            let vs = &v[(s * d.hv + h) * dv..(s * d.hv + h + 1) * dv];
            // S ← S·exp(g); mem = Sᵀk
            mem.fill(0.0);
            for (row, ka) in st.chunks_exact_mut(dv).zip(&kv) {
                for (m, x) in mem.iter_mut().zip(row.iter_mut()) {
                    *x *= decay;
                    *m += *x * ka;
                }
            }
            // δ = (v − Sᵀk)·β, kept in `mem`
            for (m, vb) in mem.iter_mut().zip(vs) {
                *m = (vb - *m) * b;
            }
            // S ← S + k⊗δ; o = Sᵀq
            // SAFETY: this task owns head h; one row at a time.
            let o = unsafe { out_row(&out, d, s, h) };
            o.fill(0.0);
            for ((row, ka), qa) in st.chunks_exact_mut(dv).zip(&kv).zip(&qv) {
                for ((x, dl), o) in row.iter_mut().zip(&mem).zip(o.iter_mut()) {
                    *x += ka * dl;
                    *o += *x * qa;
                }
            }
        }
    }
}

/// Gated delta rule, token by token, for one sequence.
///
/// `q`, `k`: `[t, hk, dk]` and `v`: `[t, hv, dv]` after conv+SiLU and the split (this op l2-normalises q
/// and k and scales q by `dk^-0.5`); `g`: `[t, hv]` log decays (≤ 0); `beta`: `[t, hv]`; `state`:
/// `[hv, dk, dv]`, read and updated in place; `out`: `[t, hv, dv]`. Parallel over value heads when large.
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
    t: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
) {
    let d = Dims { t, hk, hv, dk, dv };
    d.check("gdn_recurrent", q, k, v, g, beta, state, out);
    if t == 0 {
        return;
    }
    let work = 4 * t * hv * dk * dv;
    for_each_head(state, out, d, work, |h, st, o| {
        recurrent_head(q, k, v, g, beta, st, o, d, h)
    });
}
