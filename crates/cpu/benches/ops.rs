//! Criterion benches of the reference ops. Throughput is reported in elements/s where one element is one
//! floating-point operation (a multiply-add counts as two), so "Gelem/s" reads as GFLOP/s.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sanmai_cpu::ops::{
    attention_causal, gdn_chunked, gdn_recurrent, matmul_t, Causal, GdnInputs, GdnSizes, Heads,
};
use std::time::Duration;

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64).
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul_t");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for (t, k, n) in [
        (1, 64, 248_320),
        (1, 1024, 1024),
        (512, 1024, 1024),
        (1, 2560, 2560),
        (64, 2560, 1024),
    ] {
        let x = data(t * k, 1);
        let w = data(n * k, 2);
        let mut y = vec![0f32; t * n];
        g.throughput(Throughput::Elements((2 * t * k * n) as u64));
        g.bench_function(
            BenchmarkId::from_parameter(format!("t{t}_k{k}_n{n}")),
            |b| b.iter(|| matmul_t(black_box(&x), black_box(&w), t, k, n, &mut y)),
        );
    }
    g.finish();
}

struct Gdn {
    sizes: GdnSizes,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl Gdn {
    fn new(t: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> Self {
        Self {
            sizes: GdnSizes { t, hk, hv, dk, dv },
            q: data(t * hk * dk, 3),
            k: data(t * hk * dk, 4),
            v: data(t * hv * dv, 5),
            g: data(t * hv, 6).iter().map(|x| -0.5 * (x + 1.0)).collect(),
            beta: data(t * hv, 7).iter().map(|x| 0.5 * (x + 1.0)).collect(),
        }
    }

    fn inputs(&self) -> GdnInputs<'_> {
        GdnInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
        }
    }

    /// Multiply-add count of the recurrent rule (4 passes over the state per token and head), doubled.
    fn flops(&self) -> u64 {
        let d = self.sizes;
        (2 * 4 * d.t * d.hv * d.dk * d.dv) as u64
    }
}

fn gdn(c: &mut Criterion) {
    let mut gr = c.benchmark_group("gdn");
    gr.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for (t, hk, hv, dk, dv) in [
        (512, 2, 4, 16, 24),
        (64, 16, 32, 128, 128),
        (512, 16, 32, 128, 128),
    ] {
        let s = Gdn::new(t, hk, hv, dk, dv);
        let mut state = data(hv * dk * dv, 8);
        let mut out = vec![0f32; t * hv * dv];
        gr.throughput(Throughput::Elements(s.flops()));
        gr.bench_function(
            BenchmarkId::new("chunked64", format!("t{t}_hv{hv}_dk{dk}_dv{dv}")),
            |b| b.iter(|| gdn_chunked(&s.inputs(), s.sizes, 64, &mut state, &mut out)),
        );
    }
    for (t, hk, hv, dk, dv) in [(1, 16, 32, 128, 128), (64, 16, 32, 128, 128)] {
        let s = Gdn::new(t, hk, hv, dk, dv);
        let mut state = data(hv * dk * dv, 8);
        let mut out = vec![0f32; t * hv * dv];
        gr.throughput(Throughput::Elements(s.flops()));
        gr.bench_function(
            BenchmarkId::new("recurrent", format!("t{t}_hv{hv}_dk{dk}_dv{dv}")),
            |b| b.iter(|| gdn_recurrent(&s.inputs(), s.sizes, &mut state, &mut out)),
        );
    }
    gr.finish();
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention_causal");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    // (t, len, hq, hkv, d): full-size heads (24 query, 2 KV, 256 wide) at prefill and decode.
    for (t, len, hq, hkv, d) in [
        (512, 512, 24, 2, 256),
        (1, 4096, 24, 2, 256),
        (64, 2048, 24, 2, 256),
    ] {
        let q = data(t * hq * d, 9);
        let kc = data(len * hkv * d, 10);
        let vc = data(len * hkv * d, 11);
        let mut out = vec![0f32; t * hq * d];
        // Visible keys summed over rows, times heads, times 2·d for QKᵀ and again for PV.
        let visible: usize = (0..t).map(|i| len - t + i + 1).sum();
        g.throughput(Throughput::Elements((4 * visible * hq * d) as u64));
        let heads = Heads {
            hq,
            hkv,
            d,
            scale: (d as f32).powf(-0.5),
        };
        let c = Causal { t, len, heads };
        g.bench_function(
            BenchmarkId::from_parameter(format!("t{t}_len{len}_hq{hq}_hkv{hkv}_d{d}")),
            |b| b.iter(|| attention_causal(&q, &kc, &vc, &c, &mut out)),
        );
    }
    g.finish();
}

criterion_group!(benches, matmul, gdn, attention);
criterion_main!(benches);
