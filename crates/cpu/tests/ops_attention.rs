//! Causal GQA attention against softmax(Q·Kᵀ·scale)·V written out in f64.

mod ops_util;

use ops_util::{rel_err, Rng};
use sanmai_cpu::ops::{attention_causal, Causal, Heads};

struct Case {
    t: usize,
    len: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Case {
    fn new(t: usize, len: usize, hq: usize, hkv: usize, d: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        Self {
            t,
            len,
            hq,
            hkv,
            d,
            q: rng.vec(t * hq * d, -2.0, 2.0),
            k: rng.vec(len * hkv * d, -2.0, 2.0),
            v: rng.vec(len * hkv * d, -1.0, 1.0),
        }
    }

    fn scale(&self) -> f32 {
        (self.d as f32).powf(-0.5)
    }

    fn heads(&self) -> Heads {
        Heads {
            hq: self.hq,
            hkv: self.hkv,
            d: self.d,
            scale: self.scale(),
        }
    }

    fn run(&self) -> Vec<f32> {
        let mut out = vec![f32::NAN; self.t * self.hq * self.d];
        let c = Causal {
            t: self.t,
            len: self.len,
            heads: self.heads(),
        };
        attention_causal(&self.q, &self.k, &self.v, &c, &mut out);
        out
    }

    /// Query row i (position len − t + i), head h (KV head h / (hq/hkv)) against keys 0..=len − t + i.
    fn reference(&self) -> Vec<f64> {
        let (t, len, hq, hkv, d) = (self.t, self.len, self.hq, self.hkv, self.d);
        let mut out = vec![0f64; t * hq * d];
        for i in 0..t {
            for h in 0..hq {
                let kvh = h / (hq / hkv);
                let q = &self.q[(i * hq + h) * d..(i * hq + h + 1) * d];
                let visible = len - t + i + 1;
                let scores: Vec<f64> = (0..visible)
                    .map(|j| {
                        let k = &self.k[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * self.scale() as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    let p = (s - max).exp() / sum;
                    for e in 0..d {
                        out[(i * hq + h) * d + e] += p * self.v[(j * hkv + kvh) * d + e] as f64;
                    }
                }
            }
        }
        out
    }
}

fn check(t: usize, len: usize, hq: usize, hkv: usize, d: usize, seed: u64) {
    let c = Case::new(t, len, hq, hkv, d, seed);
    let e = rel_err(&c.run(), &c.reference());
    assert!(
        e < 2e-6,
        "t={t} len={len} hq={hq} hkv={hkv} d={d}: error {e:e}"
    );
}

#[test]
fn prefill_matches_naive() {
    check(1, 1, 2, 1, 8, 1);
    check(37, 37, 8, 2, 20, 2);
    check(64, 64, 4, 4, 64, 3);
}

#[test]
fn decode_matches_naive() {
    check(1, 50, 8, 2, 20, 4);
    check(1, 300, 16, 2, 64, 5);
}

#[test]
fn chunk_in_the_middle_matches_naive() {
    check(20, 45, 6, 3, 16, 6);
    check(70, 200, 4, 1, 64, 7);
}

#[test]
fn rows_do_not_depend_on_how_queries_are_split() {
    // Prefill in one call equals prefill in two calls (the second against the longer cache), bit for bit,
    // with few query heads per KV head (tasks are row blocks of one head) and many (tasks are the heads
    // of one KV group for one row).
    for (hq, hkv) in [(4, 2), (8, 2)] {
        let (len, d) = (53, 24);
        let c = Case::new(len, len, hq, hkv, d, 8);
        let all = c.run();
        let a = 21;
        let w = hkv * d;
        let mut first = vec![0f32; a * hq * d];
        let heads = c.heads();
        let prefix = Causal {
            t: a,
            len: a,
            heads,
        };
        attention_causal(
            &c.q[..a * hq * d],
            &c.k[..a * w],
            &c.v[..a * w],
            &prefix,
            &mut first,
        );
        let mut second = vec![0f32; (len - a) * hq * d];
        let rest = Causal {
            t: len - a,
            len,
            heads,
        };
        attention_causal(&c.q[a * hq * d..], &c.k, &c.v, &rest, &mut second);
        first.extend(second);
        assert_eq!(all, first, "hq={hq} hkv={hkv}");
    }
}

#[test]
fn single_visible_key_returns_its_value() {
    // The first query of a prefill sees only key 0: the output is exactly v_0 of its KV head.
    let c = Case::new(3, 3, 4, 2, 8, 9);
    let out = c.run();
    for h in 0..4 {
        let kvh = h / 2;
        assert_eq!(&out[h * 8..(h + 1) * 8], &c.v[kvh * 8..(kvh + 1) * 8]);
    }
}
