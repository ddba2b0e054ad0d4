//! Gated delta rule: recurrent form against the rule written out in f64, chunked form against the
//! recurrent one (lengths around the chunk size, a non-zero initial state, grouped heads, dk ≠ dv), and
//! state carried across calls.

mod ops_util;

use ops_util::{rel_err, rel_err32, Rng};
use sanmai_cpu::ops::{gdn_chunked, gdn_recurrent, GdnInputs, GdnSizes};

struct Case {
    t: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

impl Case {
    fn new(t: usize, hk: usize, hv: usize, dk: usize, dv: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        // g as the model makes it: −exp(A_log)·softplus(a + dt_bias), here spread over (−2, 0] with some
        // near-zero decays; beta = sigmoid(b) in (0, 1).
        let g = (0..t * hv)
            .map(|_| {
                let a = rng.range(-4.0, 1.5);
                -rng.range(0.05, 1.5) * (a.exp().ln_1p())
            })
            .collect();
        let beta = (0..t * hv)
            .map(|_| 1.0 / (1.0 + (-rng.range(-3.0, 3.0)).exp()))
            .collect();
        Self {
            t,
            hk,
            hv,
            dk,
            dv,
            q: rng.vec(t * hk * dk, -1.0, 1.0),
            k: rng.vec(t * hk * dk, -1.0, 1.0),
            v: rng.vec(t * hv * dv, -1.0, 1.0),
            g,
            beta,
            state: rng.vec(hv * dk * dv, -0.5, 0.5),
        }
    }

    /// Runs tokens `a..b` from `state` with the recurrent form (`chunk = None`) or the chunked one.
    fn run(&self, a: usize, b: usize, state: &mut [f32], chunk: Option<usize>) -> Vec<f32> {
        let (hk, hv, dk, dv, n) = (self.hk, self.hv, self.dk, self.dv, b - a);
        let x = GdnInputs {
            q: &self.q[a * hk * dk..b * hk * dk],
            k: &self.k[a * hk * dk..b * hk * dk],
            v: &self.v[a * hv * dv..b * hv * dv],
            g: &self.g[a * hv..b * hv],
            beta: &self.beta[a * hv..b * hv],
        };
        let d = GdnSizes {
            t: n,
            hk,
            hv,
            dk,
            dv,
        };
        let mut out = vec![f32::NAN; n * hv * dv];
        match chunk {
            None => gdn_recurrent(&x, d, state, &mut out),
            Some(c) => gdn_chunked(&x, d, c, state, &mut out),
        }
        out
    }

    /// The rule of the model card written plainly in f64: l2norm q, k (eps 1e-6), q·dk^-0.5, then per
    /// value head h (key head h / (hv/hk)): S ← S·exp(g); δ = β(v − Sᵀk); S ← S + k⊗δ; o = Sᵀq.
    fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let (t, hk, hv, dk, dv) = (self.t, self.hk, self.hv, self.dk, self.dv);
        let mut s: Vec<f64> = self.state.iter().map(|&x| x as f64).collect();
        let mut out = vec![0f64; t * hv * dv];
        let norm = |x: &[f32]| {
            let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            x.iter()
                .map(|&v| v as f64 / (ss + 1e-6).sqrt())
                .collect::<Vec<f64>>()
        };
        for tok in 0..t {
            for h in 0..hv {
                let kh = h / (hv / hk);
                let off = (tok * hk + kh) * dk;
                let q: Vec<f64> = norm(&self.q[off..off + dk])
                    .iter()
                    .map(|x| x / (dk as f64).sqrt())
                    .collect();
                let k = norm(&self.k[off..off + dk]);
                let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
                let decay = (self.g[tok * hv + h] as f64).exp();
                let b = self.beta[tok * hv + h] as f64;
                sh.iter_mut().for_each(|x| *x *= decay);
                for j in 0..dv {
                    let mem: f64 = (0..dk).map(|i| sh[i * dv + j] * k[i]).sum();
                    let delta = b * (self.v[(tok * hv + h) * dv + j] as f64 - mem);
                    for i in 0..dk {
                        sh[i * dv + j] += k[i] * delta;
                    }
                    out[(tok * hv + h) * dv + j] = (0..dk).map(|i| sh[i * dv + j] * q[i]).sum();
                }
            }
        }
        (out, s)
    }
}

#[test]
fn recurrent_matches_the_rule_in_f64() {
    for (t, seed) in [(1, 1), (7, 2), (90, 3)] {
        let c = Case::new(t, 2, 4, 16, 24, seed);
        let mut st = c.state.clone();
        let out = c.run(0, t, &mut st, None);
        let (ro, rs) = c.reference();
        let (eo, es) = (rel_err(&out, &ro), rel_err(&st, &rs));
        assert!(
            eo < 1e-5 && es < 1e-5,
            "t={t}: output error {eo:e}, state error {es:e}"
        );
    }
}

#[test]
fn chunked_equals_recurrent() {
    for (t, seed) in [(1, 10), (5, 11), (64, 12), (65, 13), (130, 14), (300, 15)] {
        let c = Case::new(t, 2, 4, 16, 24, seed);
        let mut st_r = c.state.clone();
        let out_r = c.run(0, t, &mut st_r, None);
        let mut st_c = c.state.clone();
        let out_c = c.run(0, t, &mut st_c, Some(64));
        let (eo, es) = (rel_err32(&out_c, &out_r), rel_err32(&st_c, &st_r));
        assert!(
            eo < 1e-5 && es < 1e-5,
            "t={t}: output error {eo:e}, state error {es:e}"
        );
    }
}

#[test]
fn chunked_equals_recurrent_other_chunk_sizes_and_heads() {
    // Chunk sizes that do not divide t, equal key and value heads, dk > dv, and a full-size head config.
    for (t, hk, hv, dk, dv, chunk) in [
        (50, 1, 1, 8, 4, 16),
        (77, 3, 6, 20, 12, 7),
        (33, 2, 2, 32, 16, 1),
        (70, 1, 2, 128, 128, 64),
    ] {
        let c = Case::new(t, hk, hv, dk, dv, 20 + t as u64);
        let mut st_r = c.state.clone();
        let out_r = c.run(0, t, &mut st_r, None);
        let mut st_c = c.state.clone();
        let out_c = c.run(0, t, &mut st_c, Some(chunk));
        let (eo, es) = (rel_err32(&out_c, &out_r), rel_err32(&st_c, &st_r));
        assert!(
            eo < 1e-5 && es < 1e-5,
            "t={t} hv={hv} dk={dk} dv={dv} chunk={chunk}: output {eo:e}, state {es:e}"
        );
    }
}

#[test]
fn state_carries_across_calls() {
    let t = 200;
    let c = Case::new(t, 2, 4, 16, 24, 31);
    let mut st_one = c.state.clone();
    let out_one = c.run(0, t, &mut st_one, Some(64));
    for split in [1, 64, 100, 137] {
        // Chunked prefill of [0, split) then chunked [split, t).
        let mut st = c.state.clone();
        let mut out = c.run(0, split, &mut st, Some(64));
        out.extend(c.run(split, t, &mut st, Some(64)));
        let (eo, es) = (rel_err32(&out, &out_one), rel_err32(&st, &st_one));
        assert!(
            eo < 1e-5 && es < 1e-5,
            "split {split}: output {eo:e}, state {es:e}"
        );
        // Chunked prefill then recurrent decode token by token.
        let mut st = c.state.clone();
        let mut out = c.run(0, split, &mut st, Some(64));
        for s in split..t {
            out.extend(c.run(s, s + 1, &mut st, None));
        }
        let (eo, es) = (rel_err32(&out, &out_one), rel_err32(&st, &st_one));
        assert!(
            eo < 1e-5 && es < 1e-5,
            "split {split} then decode: output {eo:e}, state {es:e}"
        );
    }
    // Recurrent token by token is exactly the recurrent form over the whole sequence.
    let mut st_a = c.state.clone();
    let out_a = c.run(0, t, &mut st_a, None);
    let mut st_b = c.state.clone();
    let mut out_b = Vec::new();
    for s in 0..t {
        out_b.extend(c.run(s, s + 1, &mut st_b, None));
    }
    assert_eq!(out_a, out_b);
    assert_eq!(st_a, st_b);
}

#[test]
fn strong_decay_forgets_the_initial_state() {
    // With g very negative the initial state has no influence: exp(g) underflows in both forms alike.
    let mut c = Case::new(70, 1, 2, 8, 8, 40);
    c.g.iter_mut().for_each(|g| *g = -120.0);
    let mut st_r = c.state.clone();
    let out_r = c.run(0, 70, &mut st_r, None);
    let mut st_c = c.state.clone();
    let out_c = c.run(0, 70, &mut st_c, Some(64));
    assert!(out_c.iter().all(|x| x.is_finite()));
    assert!(rel_err32(&out_c, &out_r) < 1e-5);
    c.state.iter_mut().for_each(|x| *x = 0.0);
    let mut st_z = c.state.clone();
    let out_z = c.run(0, 70, &mut st_z, None);
    assert_eq!(out_r, out_z);
}
