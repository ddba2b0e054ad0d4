//! Token sampling on the device (`Gpu::sample_rows`, kernels/sample.cu) against the host
//! implementation it mirrors (`sanmai_model::sample::sample_rows`) on bf16 logits at the real vocabulary
//! widths, batch 1 and 8, every parameter kind (top-k from 1 to past the vocabulary, alone and with
//! top-p and min-p), masks, penalties and biases, runs of tied logits, and batches mixing kinds by row.
//!
//! Ids are equal except documented near-ties: a GPU id that differs must lie between the ids the host
//! draws with the uniform moved down and up by [`U_SHIFT`] (the draw is an inverse CDF in id order, so
//! it is monotone in the uniform), or be what the host draws with `top_p` moved (the two sides sum the weights in different orders, so a
//! uniform within rounding of a boundary between two tokens may fall on either side; top-p's cut
//! likewise moves within rounding of its target, covered by moving `top_p` by [`U_SHIFT`] relative).
//! The device sums with shared-memory float atomics, so which side of such a boundary it lands on can
//! change from run to run. Log-probabilities within
//! 1e-3 of the host's raw log-probability of the GPU's id.

use half::bf16;

/// How far the uniform (absolute) and `top_p` (relative) may move for a differing id. f32 sums of up
/// to ~2.5·10⁵ kept weights taken in different orders differ by far more than one ulp: on an H200, a
/// row of tied logits (0.25 grid, temperature 2, top-p 0.9, ~10⁵ kept tokens of ~10⁻⁵ each) drew an
/// id 3 tokens from the host's (a CDF shift of ~3·10⁻⁵), and a top-p 0.999 row kept a tail token the
/// host cut; 1e-4 covers both with margin and is still a few tokens wide.
const U_SHIFT: f64 = 1e-4;
use sanmai_cuda::{SampleBatch, SampleBuffers};
use sanmai_model::sample::{log_sum_exp, sample_rows, RowSampling, SamplingParams, SeenToken};

use crate::bench::time;
use crate::common::{gpu, Rng};

/// Rows of bf16-rounded logits: normal with spread 2.5 plus a few strong tokens, or (`coarse`) values
/// on a 0.25 grid so long runs of equal logits occur, or (`flat`) one value everywhere but the strong
/// tokens, so the top-p cut falls inside a run of ~10⁵ equal logits.
fn logits(rng: &mut Rng, rows: usize, cols: usize, coarse: bool, flat: bool) -> Vec<f32> {
    let mut v = if flat {
        vec![1.0; rows * cols]
    } else {
        rng.normals(rows * cols, 0.0, 2.5)
    };
    for r in 0..rows {
        for _ in 0..4 {
            let i = rng.below(cols as u32) as usize;
            v[r * cols + i] += 8.0 + 4.0 * rng.unit();
        }
    }
    if coarse {
        v.iter_mut().for_each(|x| *x = (*x * 4.0).round() / 4.0);
    }
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// The sampling parameters of one case (uniforms, masks and counts are filled per row).
#[derive(Clone, Copy)]
struct Kind {
    name: &'static str,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    penalties: bool,
    mask: bool,
    coarse: bool,
    flat: bool,
}

const fn kind(name: &'static str, temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> Kind {
    Kind {
        name,
        temperature,
        top_k,
        top_p,
        min_p,
        penalties: false,
        mask: false,
        coarse: false,
        flat: false,
    }
}

/// `k` with a mask.
const fn mask(k: Kind) -> Kind {
    Kind { mask: true, ..k }
}

/// `k` with penalties and biases.
const fn penalties(k: Kind) -> Kind {
    Kind {
        penalties: true,
        ..k
    }
}

/// `k` on coarse logits (runs of ties).
const fn coarse(k: Kind) -> Kind {
    Kind { coarse: true, ..k }
}

/// `k` on flat logits.
const fn flat(k: Kind) -> Kind {
    Kind { flat: true, ..k }
}

fn kinds() -> Vec<Kind> {
    vec![
        kind("greedy", 0.0, 0, 1.0, 0.0),
        kind("temperature1", 1.0, 0, 1.0, 0.0),
        kind("temperature0.7_topk20", 0.7, 20, 1.0, 0.0),
        kind("topk2000", 1.0, 2000, 1.0, 0.0),
        kind("topp0.9_t0.8", 0.8, 0, 0.9, 0.0),
        kind("topp0.999_t1.5", 1.5, 0, 0.999, 0.0),
        kind("minp0.05", 1.0, 0, 1.0, 0.05),
        kind("topk50_topp0.8_minp0.02_t0.6", 0.6, 50, 0.8, 0.02),
        mask(kind("mask_topp0.95", 1.0, 0, 0.95, 0.0)),
        penalties(kind("penalties_bias_topk40_t0.9", 0.9, 40, 1.0, 0.0)),
        coarse(kind("ties_topk1500_topp0.5", 1.0, 1500, 0.5, 0.0)),
        coarse(kind("ties_topp0.9_t2", 2.0, 0, 0.9, 0.0)),
        penalties(mask(kind("greedy_mask_penalties", 0.0, 0, 1.0, 0.0))),
        // Top-p without top-k (the radix cut), as chat clients send it.
        kind("topp0.5_t0.6", 0.6, 0, 0.5, 0.0),
        kind("topp0.8_t1.5", 1.5, 0, 0.8, 0.0),
        kind("topp0.95_t0.6", 0.6, 0, 0.95, 0.0),
        kind("topp0.95_t1.5_minp0.05", 1.5, 0, 0.95, 0.05),
        kind("topp0.999_t0.6_minp0.001", 0.6, 0, 0.999, 0.001),
        kind("topp0.999_t1.5", 1.5, 0, 0.999, 0.0),
        mask(kind("mask_topp0.8_t0.6_minp0.02", 0.6, 0, 0.8, 0.02)),
        penalties(kind("penalties_bias_topp0.9_t1.5", 1.5, 0, 0.9, 0.0)),
        coarse(kind("ties_topp0.5_t0.6", 0.6, 0, 0.5, 0.0)),
        flat(kind("flat_topp0.9_t1.5", 1.5, 0, 0.9, 0.0)),
        flat(kind("flat_topp0.95_t1_minp0.05", 1.0, 0, 0.95, 0.05)),
        // Top-k by the radix count passes, alone and with top-p (then cut within the top-k set).
        kind("topk1_t1", 1.0, 1, 1.0, 0.0),
        kind("topk40_t1.2", 1.2, 40, 1.0, 0.0),
        kind("qwen_topk20_topp0.8_t0.7", 0.7, 20, 0.8, 0.0),
        kind("topk2000_topp0.9_t1.5", 1.5, 2000, 0.9, 0.0),
        kind("topk20_topp0.8_minp0.05_t1.5", 1.5, 20, 0.8, 0.05),
        kind("topk_ge_vocab_topp0.9", 1.0, 300_000, 0.9, 0.0),
        penalties(kind(
            "penalties_bias_topk20_topp0.8_t0.7",
            0.7,
            20,
            0.8,
            0.0,
        )),
        // The narrow mask's rows keep 200 tokens: fewer than k = 500, so top-k keeps them all.
        mask(kind("mask_topk20_t0.7", 0.7, 20, 1.0, 0.0)),
        mask(kind("mask_topk500_topp0.9_t1", 1.0, 500, 0.9, 0.0)),
        // k inside a run of tied logits: the cut takes the run's lowest ids.
        flat(kind("flat_topk20_t1", 1.0, 20, 1.0, 0.0)),
        flat(kind("flat_topk5000_topp0.5_t1.5", 1.5, 5000, 0.5, 0.0)),
        flat(kind(
            "flat_topk3000_topp0.99_minp0.01",
            1.0,
            3000,
            0.99,
            0.01,
        )),
        coarse(kind("ties_topk20_topp0.8_t0.7", 0.7, 20, 0.8, 0.0)),
    ]
}

/// The kinds a mixed batch cycles through, one per row: greedy, top-p, top-k with and without top-p,
/// masks, penalties and tied runs in one launch.
fn mixed_kinds() -> Vec<Kind> {
    let pick = [
        "qwen_topk20_topp0.8_t0.7",
        "greedy",
        "topp0.9_t0.8",
        "topk1_t1",
        "mask_topk500_topp0.9_t1",
        "penalties_bias_topk40_t0.9",
        "flat_topk20_t1",
        "topk2000_topp0.9_t1.5",
    ];
    let all = kinds();
    pick.iter()
        .map(|n| *all.iter().find(|k| k.name == *n).expect("a listed kind"))
        .collect()
}

/// Per-row data a [`RowSampling`] borrows.
struct RowData {
    params: SamplingParams,
    seen: Vec<SeenToken>,
    mask: Option<Vec<u32>>,
    uniform: f64,
}

fn row_data(rng: &mut Rng, k: &Kind, vocab: usize, row: usize) -> RowData {
    let seen = if k.penalties {
        (0..3000)
            .map(|i| {
                let id = (i * 7919 + row * 31) as u32 % vocab as u32;
                let output = if i % 3 == 0 { 1 + (i % 5) as u32 } else { 0 };
                (id, SeenToken { id, output })
            })
            .collect::<std::collections::BTreeMap<u32, SeenToken>>()
            .into_values()
            .collect()
    } else {
        Vec::new()
    };
    let bias = if k.penalties {
        let a = rng.below(vocab as u32);
        vec![
            (a, 3.0),
            (rng.below(vocab as u32), -2.0),
            (a, 1.5),
            (7, 0.25),
        ]
    } else {
        Vec::new()
    };
    let mask = k.mask.then(|| {
        let words = vocab.div_ceil(32);
        if row.is_multiple_of(2) {
            // A broad mask: about half the vocabulary.
            (0..words).map(|_| rng.next_u64() as u32).collect()
        } else {
            // A narrow one, as a grammar gives: 200 tokens.
            let mut m = vec![0u32; words];
            for _ in 0..200 {
                let i = rng.below(vocab as u32) as usize;
                m[i / 32] |= 1 << (i % 32);
            }
            m
        }
    });
    let params = SamplingParams {
        temperature: k.temperature,
        top_k: k.top_k as i32,
        top_p: k.top_p,
        min_p: k.min_p,
        repetition_penalty: if k.penalties { 1.3 } else { 1.0 },
        frequency_penalty: if k.penalties { 0.5 } else { 0.0 },
        presence_penalty: if k.penalties { 0.4 } else { 0.0 },
        logit_bias: bias,
        ..SamplingParams::default()
    };
    RowData {
        params,
        seen,
        mask,
        uniform: rng.unit() as f64,
    }
}

fn spec(d: &RowData) -> RowSampling<'_> {
    RowSampling {
        params: &d.params,
        seen: &d.seen,
        allowed: d.mask.as_deref(),
        uniform: d.uniform,
    }
}

/// The host's id for one row with a changed uniform / top-p.
fn host_id(row: &[f32], vocab: usize, s: &RowSampling<'_>) -> Option<u32> {
    let mut v = row.to_vec();
    sample_rows(&mut v, row.len(), vocab, std::slice::from_ref(s))[0]
        .ok()
        .map(|x| x.id)
}

/// The raw log-probability of `id` under the masked row.
fn raw_logprob(row: &[f32], vocab: usize, mask: Option<&[u32]>, id: u32) -> f32 {
    let mut v = row[..vocab].to_vec();
    if let Some(m) = mask {
        sanmai_model::sample::apply_allowed_mask(&mut v, m);
    }
    v[id as usize] - log_sum_exp(&v).unwrap()
}

/// Samples `specs` on the device and the host from the same `values` `[specs.len(), cols]` and checks
/// ids (equal or a near-tie) and log-probabilities; prints one `PARITY` line labelled `label`.
fn check_batch(
    g: &sanmai_cuda::Gpu,
    values: &[f32],
    cols: usize,
    vocab: usize,
    specs: &[RowSampling<'_>],
    label: &str,
) {
    let batch = specs.len();
    let dev = g
        .upload(
            &values
                .iter()
                .map(|&x| bf16::from_f32(x))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let got = g.sample_rows(&dev, cols, vocab, specs).unwrap();
    let mut host = values.to_vec();
    let want = sample_rows(&mut host, cols, vocab, specs);
    let (mut near_ties, mut max_lp) = (0, 0f32);
    for r in 0..batch {
        let row = &values[r * cols..(r + 1) * cols];
        let (gs, ws) = (got[r].unwrap(), want[r].unwrap());
        if gs.id != ws.id {
            let s = &specs[r];
            let at_u =
                |u: f64| host_id(row, vocab, &RowSampling { uniform: u, ..*s }).unwrap_or(ws.id);
            let (lo, hi) = (
                at_u((s.uniform - U_SHIFT).max(0.0)),
                at_u((s.uniform + U_SHIFT).min(1.0 - 1e-12)),
            );
            let top_p = s.params.top_p;
            let moved_p = [
                top_p * (1.0 - U_SHIFT as f32),
                (top_p * (1.0 + U_SHIFT as f32)).min(1.0),
            ]
            .map(|top_p| SamplingParams {
                top_p,
                ..s.params.clone()
            });
            assert!(
                (lo..=hi).contains(&gs.id)
                    || moved_p.iter().any(|params| {
                        host_id(row, vocab, &RowSampling { params, ..*s }) == Some(gs.id)
                    }),
                "{label} vocab {vocab} batch {batch} row {r}: gpu id {} vs cpu {} (u = {}; \
                 host ids {lo}..={hi} within the uniform's window)",
                gs.id,
                ws.id,
                s.uniform
            );
            near_ties += 1;
        }
        let lp = raw_logprob(row, vocab, specs[r].allowed, gs.id);
        let d = (gs.logprob - lp).abs();
        assert!(
            d <= 1e-3,
            "{label} vocab {vocab} batch {batch} row {r}: logprob {} vs {lp}",
            gs.logprob
        );
        max_lp = max_lp.max(d);
    }
    println!(
        "PARITY op=sample shape=v{vocab}_b{batch}_{label} near_tie_swaps={near_ties} max_logprob_err={max_lp:.2e} tol=ids_equal_or_near_tie,logprob<=1e-3"
    );
    assert!(near_ties * 4 <= batch.max(4), "too many near-tie swaps");
}

#[test]
fn sampling_matches_cpu() {
    let Some(g) = gpu("sampling_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(77);
    for vocab in [151_936usize, 248_320] {
        // lm_head padding past the vocabulary, as the models have it.
        let cols = vocab + 64;
        for batch in [1usize, 8] {
            for k in kinds() {
                let values = logits(&mut rng, batch, cols, k.coarse, k.flat);
                let data: Vec<RowData> = (0..batch)
                    .map(|r| row_data(&mut rng, &k, vocab, r))
                    .collect();
                let specs: Vec<RowSampling<'_>> = data.iter().map(spec).collect();
                check_batch(g, &values, cols, vocab, &specs, k.name);
            }
        }
    }
}

/// Rows of different kinds in one batch (each row its own logits style): the stages each row skips or
/// takes must not disturb the others.
#[test]
fn sampling_mixed_batch_matches_cpu() {
    let Some(g) = gpu("sampling_mixed_batch_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(91);
    let mixed = mixed_kinds();
    for vocab in [151_936usize, 248_320] {
        let cols = vocab + 64;
        for batch in [1usize, 5, 8] {
            for shift in 0..2 {
                let ks: Vec<Kind> = (0..batch)
                    .map(|r| mixed[(r + 3 * shift) % mixed.len()])
                    .collect();
                let values: Vec<f32> = ks
                    .iter()
                    .flat_map(|k| logits(&mut rng, 1, cols, k.coarse, k.flat))
                    .collect();
                let data: Vec<RowData> = ks
                    .iter()
                    .enumerate()
                    .map(|(r, k)| row_data(&mut rng, k, vocab, r))
                    .collect();
                let specs: Vec<RowSampling<'_>> = data.iter().map(spec).collect();
                check_batch(g, &values, cols, vocab, &specs, &format!("mixed{shift}"));
            }
        }
    }
}

#[test]
fn sampling_reports_degenerate_rows() {
    let Some(g) = gpu("sampling_reports_degenerate_rows") else {
        return;
    };
    let (cols, vocab) = (4096usize, 4000usize);
    let mut values = vec![0.5f32; 3 * cols];
    values[cols..cols + vocab].fill(f32::NEG_INFINITY);
    values[2 * cols + 17] = f32::INFINITY;
    let params = SamplingParams::default();
    let d = RowSampling::new(&params);
    let specs = [d, d, d];
    let dev = g
        .upload(
            &values
                .iter()
                .map(|&x| bf16::from_f32(x))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let got = g.sample_rows(&dev, cols, vocab, &specs).unwrap();
    let want = sample_rows(&mut values.clone(), cols, vocab, &specs);
    assert!(got[0].is_ok());
    assert_eq!(got[1], want[1]);
    assert_eq!(got[2], want[2]);
    // Every token masked out.
    let mask = vec![0u32; vocab.div_ceil(32)];
    let masked = RowSampling {
        allowed: Some(&mask),
        ..d
    };
    let got = g.sample_rows(&dev, cols, vocab, &[masked]).unwrap();
    assert_eq!(got[0], Err(sanmai_model::sample::RowError::NoCandidates));
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_sample() {
    let Some(g) = gpu("bench_sample") else {
        return;
    };
    let mut rng = Rng::new(5);
    for vocab in [151_936usize, 248_320] {
        let cols = vocab;
        for batch in [1usize, 8] {
            let values = logits(&mut rng, batch, cols, false, false);
            let dev = g
                .upload(
                    &values
                        .iter()
                        .map(|&x| bf16::from_f32(x))
                        .collect::<Vec<_>>(),
                )
                .unwrap();
            for k in kinds().into_iter().filter(|k| !k.coarse && !k.flat) {
                let data: Vec<RowData> = (0..batch)
                    .map(|r| row_data(&mut rng, &k, vocab, r))
                    .collect();
                let specs: Vec<RowSampling<'_>> = data.iter().map(spec).collect();
                // One call: pack and upload the parameters, the kernels, the 8-byte-a-row download.
                let t = time(g, 3, 20, || {
                    g.sample_rows(&dev, cols, vocab, &specs).unwrap();
                });
                // The kernels alone, on buffers uploaded once (what a decode step's graph replays).
                let b = SampleBatch::pack(&specs, vocab);
                let one = |v: &[u32]| {
                    g.upload(if v.is_empty() { &[0u32][..] } else { v })
                        .unwrap()
                };
                let (params, masks, edits) = (one(&b.params), one(&b.masks), one(&b.edits));
                let mut work = g.zeros::<u32>(b.work_words().max(1)).unwrap();
                let mut out = g.zeros::<u32>(2 * batch).unwrap();
                let tk = time(g, 3, 50, || {
                    let bufs = SampleBuffers {
                        params: &params,
                        masks: &masks,
                        edits: &edits,
                        work: &mut work,
                        out: &mut out,
                    };
                    g.sample_bf16(&dev, cols, &b, bufs).unwrap();
                });
                let mut host = values.clone();
                let t0 = std::time::Instant::now();
                let reps = 5;
                for _ in 0..reps {
                    host.copy_from_slice(&values);
                    sample_rows(&mut host, cols, vocab, &specs);
                }
                let host_t = t0.elapsed().as_secs_f64() / reps as f64;
                let bytes = batch * vocab * 2;
                println!(
                    "BENCH sample vocab={vocab} batch={batch} kind={} time_us={:.1} us_per_row={:.1} \
                     kernels_us={:.1} GB/s(one logits read)={:.0} host_us_per_row={:.1}",
                    k.name,
                    t * 1e6,
                    t * 1e6 / batch as f64,
                    tk * 1e6,
                    bytes as f64 / t / 1e9,
                    host_t * 1e6 / batch as f64
                );
            }
        }
    }
}
