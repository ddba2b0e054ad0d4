use sanmai_engine::sampler::*;
use std::time::Instant;
fn cpu_s() -> f64 {
    let s = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}
fn main() {
    let mut rng = Rng::seeded(2024);
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(248320);
    let mut row: Vec<f32> = (0..n)
        .map(|_| {
            let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 2.5) as f32
        })
        .collect();
    for (i, b) in [
        (1000usize, 14.0f32),
        (52000, 13.0),
        (170001, 12.5),
        (9, 11.0),
    ] {
        if i < n {
            row[i] += b;
        }
    }
    for (t, k, p, mp) in [
        (0.7f32, 50i32, 0.9f32, 0.0f32),
        (0.7, 50, 1.0, 0.0),
        (0.7, 0, 0.9, 0.0),
        (1.0, 0, 0.9, 0.0),
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (0.8, 0, 1.0, 0.05),
    ] {
        let params = SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            min_p: mp,
            seed: Some(1),
            ..Default::default()
        };
        let mut st = SamplerState::new(&params, &[]);
        let mut sc = Scratch::new();
        let mut w = row.clone();
        let it = 2000;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t0 = Instant::now();
            let c0 = cpu_s();
            for _ in 0..it {
                sample_row(&mut w, n - 243, &params, &mut st, None, &mut sc).unwrap();
            }
            let _ = t0;
            best = best.min((cpu_s() - c0) * 1e6 / it as f64);
        }
        println!("T={t} k={k} p={p} min_p={mp}: {best:.1} us");
    }
}
