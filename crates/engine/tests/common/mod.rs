//! Naive reference implementations the sampler is checked against: everything in f64, full sorts,
//! penalties recounted from the token lists.

#![allow(dead_code)]

use sanmai_engine::sampler::{sample_row, SamplerState, SamplingParams, Scratch};

/// Applies penalties (recounting `prompt` and `output`) and bias to `logits`, in f64.
pub fn naive_edited(
    logits: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
) -> Vec<f64> {
    let mut z: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
    for (id, v) in z.iter_mut().enumerate() {
        let id = id as u32;
        let count = output.iter().filter(|&&t| t == id).count() as f64;
        if prompt.contains(&id) || count > 0.0 {
            let r = params.repetition_penalty as f64;
            *v = if *v > 0.0 { *v / r } else { *v * r };
        }
        if count > 0.0 {
            *v -= params.frequency_penalty as f64 * count + params.presence_penalty as f64;
        }
    }
    for &(id, b) in &params.logit_bias {
        z[id as usize] += b as f64;
    }
    z
}

/// The distribution the sampler should draw from, by definition: temperature softmax, rank (probability
/// descending, id ascending), top-k prefix, top-p prefix of the renormalised rest, min-p, renormalise.
pub fn naive_distribution(
    logits: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
) -> Vec<f64> {
    let z = naive_edited(logits, params, prompt, output);
    let t = params.temperature as f64;
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = z.iter().map(|&v| ((v - m) / t).exp()).collect();
    let mut ranked: Vec<usize> = (0..w.len()).filter(|&i| w[i] > 0.0).collect();
    ranked.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    if let Some(k) = params.top_k_limit() {
        ranked.truncate(k);
    }
    if params.top_p < 1.0 {
        let target = params.top_p as f64 * ranked.iter().map(|&i| w[i]).sum::<f64>();
        let mut seen = 0.0;
        let mut keep = Vec::new();
        for &i in &ranked {
            keep.push(i);
            seen += w[i];
            if seen >= target {
                break;
            }
        }
        ranked = keep;
    }
    let wmax = ranked.iter().map(|&i| w[i]).fold(0.0, f64::max);
    ranked.retain(|&i| w[i] >= params.min_p as f64 * wmax);
    let total: f64 = ranked.iter().map(|&i| w[i]).sum();
    let mut p = vec![0.0; logits.len()];
    for &i in &ranked {
        p[i] = w[i] / total;
    }
    p
}

/// `log_softmax` in f64.
pub fn naive_log_softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits
        .iter()
        .map(|&x| x as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let lse = m + logits
        .iter()
        .map(|&x| (x as f64 - m).exp())
        .sum::<f64>()
        .ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// Draws `n` tokens from `row` (of which `valid` are real) with a fresh seeded state, accepting none.
pub fn sample_counts(
    row: &[f32],
    valid: usize,
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    n: usize,
) -> Vec<u64> {
    let mut state = SamplerState::new(params, prompt);
    for &t in output {
        state.accept(t);
    }
    let mut scratch = Scratch::new();
    let mut work = row.to_vec();
    let mut counts = vec![0u64; row.len()];
    for _ in 0..n {
        work.copy_from_slice(row);
        let s =
            sample_row(&mut work, valid, params, &mut state, None, &mut scratch).expect("sample");
        counts[s.id as usize] += 1;
    }
    counts
}

/// Pearson's chi-square of observed counts against probabilities, over the categories with p > 0;
/// categories expecting fewer than 5 draws are pooled into one. Returns (statistic, degrees of freedom).
pub fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
    let n = counts.iter().sum::<u64>() as f64;
    let mut stat = 0.0;
    let mut cats = 0usize;
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &pi) in counts.iter().zip(p) {
        if pi <= 0.0 {
            continue;
        }
        let e = pi * n;
        if e < 5.0 {
            pooled_obs += c as f64;
            pooled_exp += e;
            continue;
        }
        stat += (c as f64 - e).powi(2) / e;
        cats += 1;
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp;
        cats += 1;
    }
    (stat, cats.saturating_sub(1))
}

/// The chi-square value exceeded with probability ~3e-7 (z = 5, Wilson–Hilferty approximation).
pub fn chi_square_critical(df: usize) -> f64 {
    let k = df.max(1) as f64;
    let h = 2.0 / (9.0 * k);
    k * (1.0 - h + 5.0 * h.sqrt()).powi(3)
}
