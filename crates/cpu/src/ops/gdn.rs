//! Gated delta rule (GDN linear attention) for one sequence: the recurrent form, and the pieces it shares
//! with the chunked form in `gdn_chunked.rs` (shape checks, q/k preparation, the per-head driver).
//!
//! As transformers with `use_qk_l2norm_in_kernel=True`: q and k are l2-normalised (eps 1e-6) per head in
//! f32, then q is multiplied by `dk^-0.5`. Value head `h` reads key head `h / (hv / hk)`
//! (`repeat_interleave` of the key heads). The state of head `h` is `S[dk, dv]`, f32, and per token
//! `S ← S·exp(g); δ = β(v − Sᵀk); S ← S + k⊗δ; o = Sᵀq`.

use rayon::prelude::*;

use super::{multiversion, norm::l2_row, SharedOut, PAR_MIN_WORK};

/// The sizes of one sequence's GDN call: `t` tokens, `hk` key heads of width `dk`, `hv` value heads
/// of width `dv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnSizes {
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// One sequence's GDN inputs after conv + SiLU and the split: `q`, `k` `[t, hk, dk]`, `v`
/// `[t, hv, dv]`, `g` `[t, hv]` log decays (≤ 0) and `beta` `[t, hv]`.
#[derive(Debug, Clone, Copy)]
pub struct GdnInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

impl GdnSizes {
    /// Checks every slice against the sizes (panics with the op's name on a mismatch).
    pub(crate) fn check(&self, name: &str, x: &GdnInputs<'_>, state: &[f32], out: &[f32]) {
        let GdnSizes { t, hk, hv, dk, dv } = *self;
        assert!(
            hk > 0 && hv.is_multiple_of(hk),
            "{name}: hv must be a positive multiple of hk"
        );
        assert_eq!(x.q.len(), t * hk * dk, "{name}: q must be [t, hk, dk]");
        assert_eq!(x.k.len(), t * hk * dk, "{name}: k must be [t, hk, dk]");
        assert_eq!(x.v.len(), t * hv * dv, "{name}: v must be [t, hv, dv]");
        assert_eq!(x.g.len(), t * hv, "{name}: g must be [t, hv]");
        assert_eq!(x.beta.len(), t * hv, "{name}: beta must be [t, hv]");
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
pub(crate) fn load_qk(
    x: &GdnInputs<'_>,
    d: GdnSizes,
    s: usize,
    kh: usize,
    scale: f32,
    qo: &mut [f32],
    ko: &mut [f32],
) {
    let off = (s * d.hk + kh) * d.dk;
    qo.copy_from_slice(&x.q[off..off + d.dk]);
    l2_row(qo, 1e-6);
    for v in qo.iter_mut() {
        *v *= scale;
    }
    ko.copy_from_slice(&x.k[off..off + d.dk]);
    l2_row(ko, 1e-6);
}

/// Runs `head(h, S_h, out)` for every value head, in parallel when the call is large. `work` is the
/// call's multiply-add count. Each head writes only `out[:, h, :]`.
pub(crate) fn for_each_head(
    state: &mut [f32],
    out: &mut [f32],
    d: GdnSizes,
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
pub(crate) unsafe fn out_row(out: &SharedOut, d: GdnSizes, s: usize, h: usize) -> &mut [f32] {
    // SAFETY: rows of distinct (s, h) are disjoint; the caller's contract keeps them exclusive.
    unsafe { out.slice((s * d.hv + h) * d.dv, d.dv) }
}

multiversion! {
    fn recurrent_head(inp: &GdnInputs<'_>, st: &mut [f32], out: SharedOut, d: GdnSizes, h: usize) {
        let (dk, dv) = (d.dk, d.dv);
        let kh = d.key_head(h);
        let scale = q_scale(dk);
        let mut qv = vec![0f32; dk];
        let mut kv = vec![0f32; dk];
        let mut mem = vec![0f32; dv];
        for s in 0..d.t {
            load_qk(inp, d, s, kh, scale, &mut qv, &mut kv);
            let decay = inp.g[s * d.hv + h].exp();
            let b = inp.beta[s * d.hv + h];
            let vs = &inp.v[(s * d.hv + h) * dv..(s * d.hv + h + 1) * dv];
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
/// `x`: the inputs after conv+SiLU and the split (this op l2-normalises q and k and scales q by
/// `dk^-0.5`), of sizes `d`; `state`: `[hv, dk, dv]`, read and updated in place; `out`:
/// `[t, hv, dv]`. Parallel over value heads when large.
pub fn gdn_recurrent(x: &GdnInputs<'_>, d: GdnSizes, state: &mut [f32], out: &mut [f32]) {
    d.check("gdn_recurrent", x, state, out);
    if d.t == 0 {
        return;
    }
    let work = 4 * d.t * d.hv * d.dk * d.dv;
    for_each_head(state, out, d, work, |h, st, o| {
        recurrent_head(x, st, o, d, h)
    });
}
