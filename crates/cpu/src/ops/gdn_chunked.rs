//! Chunked gated delta rule: the WY / UT-transform algorithm of transformers'
//! `torch_chunk_gated_delta_rule`, one value head at a time, carrying the state across chunks and
//! handling a final partial chunk directly (equivalent to the reference's zero padding: padded tokens have
//! `k = v = β = g = 0` and change neither the outputs nor the state).
//!
//! Per chunk of `L` tokens with in-chunk cumulative log decay `c_i = Σ_{j≤i} g_j`:
//! - `A[i][j] = (β_i k_i · k_j)·e^{c_i−c_j}` for `j < i`; `P[i][j] = (q_i · k_j)·e^{c_i−c_j}` for `j ≤ i`;
//! - `U = (I + A)⁻¹ (β v)`, `W = (I + A)⁻¹ (β k e^{c})` by forward substitution;
//! - `v' = U − W S`; `o_i = (q_i e^{c_i}) S + Σ_{j≤i} P[i][j] v'_j`;
//! - `S ← S e^{c_{L−1}} + Σ_j (k_j e^{c_{L−1}−c_j}) ⊗ v'_j`.
//!
//! The products the reference computes as matrix multiplications are the GEMM kernels of `gemm.rs`.

use super::gdn::{for_each_head, load_qk, out_row, q_scale, GdnInputs, GdnSizes};
use super::gemm::{gemm_nn, gemm_nt, Mat, MatMut};
use super::SharedOut;

/// Per-head scratch for one chunk of up to `c` tokens.
struct Scratch {
    qn: Vec<f32>,
    kn: Vec<f32>,
    kb: Vec<f32>,
    vb: Vec<f32>,
    gc: Vec<f32>,
    a: Vec<f32>,
    p: Vec<f32>,
    u: Vec<f32>,
    w: Vec<f32>,
    qd: Vec<f32>,
    vnew: Vec<f32>,
    o: Vec<f32>,
    tmp: Vec<f32>,
    kdt: Vec<f32>,
    upd: Vec<f32>,
}

impl Scratch {
    fn new(c: usize, dk: usize, dv: usize) -> Self {
        Self {
            qn: vec![0.0; c * dk],
            kn: vec![0.0; c * dk],
            kb: vec![0.0; c * dk],
            vb: vec![0.0; c * dv],
            gc: vec![0.0; c],
            a: vec![0.0; c * c],
            p: vec![0.0; c * c],
            u: vec![0.0; c * dv],
            w: vec![0.0; c * dk],
            qd: vec![0.0; c * dk],
            vnew: vec![0.0; c * dv],
            o: vec![0.0; c * dv],
            tmp: vec![0.0; c * dv.max(dk)],
            kdt: vec![0.0; dk * c],
            upd: vec![0.0; dk * dv],
        }
    }
}

/// Solves `(I + A) X = B` in place for unit lower-triangular `I + A` (`A` strictly lower, row stride
/// `c`): `X_i = B_i − Σ_{j<i} A[i][j] X_j`, the sum taken first (an NN product), rows of width `n`.
fn forward_substitute(a: &[f32], c: usize, len: usize, x: &mut [f32], n: usize, tmp: &mut [f32]) {
    let tmp = &mut tmp[..n];
    for i in 1..len {
        let (done, rest) = x.split_at_mut(i * n);
        gemm_nn(
            Mat::new(&a[i * c..], c),
            Mat::new(done, n),
            MatMut::new(tmp, n),
            1,
            i,
            n,
        );
        for (x, s) in rest[..n].iter_mut().zip(tmp.iter()) {
            *x -= s;
        }
    }
}

/// One value head over the whole sequence, chunk by chunk.
fn chunked_head(
    x: &GdnInputs<'_>,
    st: &mut [f32],
    out: SharedOut,
    d: GdnSizes,
    h: usize,
    chunk: usize,
) {
    let GdnInputs { v, g, beta, .. } = *x;
    let (dk, dv, c) = (d.dk, d.dv, chunk);
    let kh = d.key_head(h);
    let scale = q_scale(dk);
    let mut sc = Scratch::new(c, dk, dv);
    let mut s0 = 0;
    while s0 < d.t {
        let len = c.min(d.t - s0);
        // Phase 1: normalised q/k, β-weighted k/v, cumulative decay.
        let mut cum = 0f32;
        for i in 0..len {
            let s = s0 + i;
            let (qi, ki) = (
                &mut sc.qn[i * dk..(i + 1) * dk],
                &mut sc.kn[i * dk..(i + 1) * dk],
            );
            load_qk(x, d, s, kh, scale, qi, ki);
            let b = beta[s * d.hv + h];
            for (o, x) in sc.kb[i * dk..(i + 1) * dk].iter_mut().zip(ki.iter()) {
                *o = x * b;
            }
            let vs = &v[(s * d.hv + h) * dv..(s * d.hv + h + 1) * dv];
            for (o, x) in sc.vb[i * dv..(i + 1) * dv].iter_mut().zip(vs) {
                *o = x * b;
            }
            cum = if i == 0 {
                g[s * d.hv + h]
            } else {
                cum + g[s * d.hv + h]
            };
            sc.gc[i] = cum;
        }
        // Phase 2: the UT system A (strictly lower) and the intra-chunk attention P (lower), both
        // weighted by the pairwise decay; the upper parts are set to exactly 0.
        gemm_nt(
            Mat::new(&sc.kb, dk),
            Mat::new(&sc.kn, dk),
            MatMut::new(&mut sc.a, c),
            len,
            dk,
            len,
        );
        gemm_nt(
            Mat::new(&sc.qn, dk),
            Mat::new(&sc.kn, dk),
            MatMut::new(&mut sc.p, c),
            len,
            dk,
            len,
        );
        for i in 0..len {
            for j in 0..len {
                let (a, p) = (&mut sc.a[i * c + j], &mut sc.p[i * c + j]);
                if j <= i {
                    let decay = (sc.gc[i] - sc.gc[j]).exp();
                    *a = if j < i { *a * decay } else { 0.0 };
                    *p *= decay;
                } else {
                    *a = 0.0;
                    *p = 0.0;
                }
            }
        }
        // Phase 3: U = (I + A)⁻¹ βv and W = (I + A)⁻¹ βk·e^c.
        sc.u[..len * dv].copy_from_slice(&sc.vb[..len * dv]);
        forward_substitute(&sc.a, c, len, &mut sc.u[..len * dv], dv, &mut sc.tmp);
        for i in 0..len {
            let e = sc.gc[i].exp();
            let (w, kb) = (
                &mut sc.w[i * dk..(i + 1) * dk],
                &sc.kb[i * dk..(i + 1) * dk],
            );
            for (o, x) in w.iter_mut().zip(kb) {
                *o = x * e;
            }
        }
        forward_substitute(&sc.a, c, len, &mut sc.w[..len * dk], dk, &mut sc.tmp);
        // Phase 4: v' = U − W·S.
        gemm_nn(
            Mat::new(&sc.w, dk),
            Mat::new(st, dv),
            MatMut::new(&mut sc.tmp, dv),
            len,
            dk,
            dv,
        );
        for ((o, u), m) in sc.vnew[..len * dv].iter_mut().zip(&sc.u).zip(&sc.tmp) {
            *o = u - m;
        }
        // Phase 5: o = (q e^c)·S + P·v'.
        for i in 0..len {
            let e = sc.gc[i].exp();
            let (qd, qn) = (
                &mut sc.qd[i * dk..(i + 1) * dk],
                &sc.qn[i * dk..(i + 1) * dk],
            );
            for (o, x) in qd.iter_mut().zip(qn) {
                *o = x * e;
            }
        }
        gemm_nn(
            Mat::new(&sc.qd, dk),
            Mat::new(st, dv),
            MatMut::new(&mut sc.o, dv),
            len,
            dk,
            dv,
        );
        gemm_nn(
            Mat::new(&sc.p, c),
            Mat::new(&sc.vnew, dv),
            MatMut::new(&mut sc.tmp, dv),
            len,
            len,
            dv,
        );
        for (i, (o, x)) in
            sc.o.chunks_exact_mut(dv)
                .zip(sc.tmp.chunks_exact(dv))
                .take(len)
                .enumerate()
        {
            // SAFETY: this task owns head h; one row at a time.
            let dst = unsafe { out_row(&out, d, s0 + i, h) };
            for ((dst, o), x) in dst.iter_mut().zip(o.iter_mut()).zip(x) {
                *o += x;
                *dst = *o;
            }
        }
        // Phase 6: S ← S·e^{c_last} + (k e^{c_last − c})ᵀ·v'.
        let last = sc.gc[len - 1];
        for j in 0..len {
            let e = (last - sc.gc[j]).exp();
            for a in 0..dk {
                sc.kdt[a * c + j] = sc.kn[j * dk + a] * e;
            }
        }
        gemm_nn(
            Mat::new(&sc.kdt, c),
            Mat::new(&sc.vnew, dv),
            MatMut::new(&mut sc.upd, dv),
            dk,
            len,
            dv,
        );
        let cd = last.exp();
        for (x, u) in st.iter_mut().zip(&sc.upd) {
            *x = *x * cd + u;
        }
        s0 += len;
    }
}

/// Gated delta rule in chunks of `chunk` tokens (64 in transformers and FLA), starting from `state`.
///
/// Same arguments and result as [`super::gdn_recurrent`] (equal to it up to f32 rounding, ~1e-6
/// relative); `chunk` must be at least 1. Parallel over value heads when large.
pub fn gdn_chunked(
    x: &GdnInputs<'_>,
    d: GdnSizes,
    chunk: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(chunk >= 1, "gdn_chunked: chunk must be at least 1");
    d.check("gdn_chunked", x, state, out);
    let GdnSizes { t, hv, dk, dv, .. } = d;
    if t == 0 {
        return;
    }
    let c = chunk.min(t);
    let work = t * hv * (c * (2 * dk + dk + dv) + 3 * dk * dv);
    for_each_head(state, out, d, work, |h, st, o| {
        chunked_head(x, st, o, d, h, c)
    });
}
