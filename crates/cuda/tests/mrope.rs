//! Explicit interleaved-MRoPE positions (images in a prompt) on the CUDA backend:
//!
//! - the attention op with `AttnCall::mrope` against the CPU backend's on the same bf16 inputs
//!   (prefill chunks of text and image rows, a mixed step, a batched decode), at the tiny
//!   fixtures' shape and at Qwen3.5's (head 256, 64 rotary dims, sections `[11, 11, 10]`), within
//!   the bounds of a backend op of several bf16-rounding kernels against the CPU's f32 pipeline
//!   (max-norm relative ≤ [`OP_MAX_REL`], rms relative ≤ [`OP_RMS_REL`]);
//! - positions equal to the sequence positions on every axis give the plain call's output bit for
//!   bit (the same f32 angle, the same `sincosf`);
//! - `Model::step_multimodal` on `tests/fixtures/qwen3_5_mm_tiny` (a prompt with two images: the
//!   vision tower's merged tokens as input embeddings, `get_rope_index`'s positions), whole and in
//!   chunks that cut the images, then a teacher-forced greedy continuation after the images,
//!   against the CPU backend with the bounds of the CUDA end-to-end tests' text path.
//!
//! Without a GPU every test prints `skipped: <test>: <reason>` and passes. Each check prints one
//! `MROPE` line.

#[path = "support/options.rs"]
mod options;

use std::path::{Path, PathBuf};

use half::bf16;
use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::backend::CacheSpec;
use sanmai_model::vision::{Grid, Vision};
use sanmai_model::{
    AttnCall, AttnShape, AttnWeights, Backend, GdnShape, Model, Mrope, OutRows, Rope, SeqChunk,
    StepChunk, StepEmbeds, StepInput, StepMultimodal, StepStart,
};
use sanmai_weights::Checkpoint;
use serde_json::Value;

/// The attention op against the CPU: a backend op made of several kernels, each rounding its
/// output to bf16 (q and k after norm and RoPE, the cache, the output), against the CPU's f32
/// pipeline: the bounds of `parity`'s `check_composite`.
const OP_MAX_REL: f32 = 5e-2;
const OP_RMS_REL: f32 = 2e-2;

/// The whole step against the CPU (the CUDA end-to-end tests' text path, `e2e`'s
/// `mixed_step_matches_cpu`): the mean log-prob error may exceed transformers' own bf16 run's on
/// the same architecture by [`MARGIN`], the largest is bounded by [`MAX_TOL`], and the argmax must
/// be the CPU's wherever the CPU's top-2 gap is at least [`GAP`].
const MARGIN: f64 = 0.05;
const MAX_TOL: f64 = 2.5;
const GAP: f64 = 1.0;

use options::backend;

// ---------------------------------------------------------------------------------------------
// The attention op
// ---------------------------------------------------------------------------------------------

/// An attention shape with its rotary table and MRoPE sections.
struct Case {
    name: &'static str,
    shape: AttnShape,
    rope: Rope,
    sections: [usize; 3],
}

fn case(
    name: &'static str,
    (nh, nkv, d): (usize, usize, usize),
    rot: usize,
    theta: f32,
    sections: [usize; 3],
) -> Case {
    Case {
        name,
        shape: AttnShape {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            eps: 1e-6,
        },
        rope: Rope {
            rot_dim: rot,
            inv_freq: (0..rot / 2)
                .map(|j| 1.0 / theta.powf((2 * j) as f32 / rot as f32))
                .collect(),
            mscale: 1.0,
        },
        sections,
    }
}

fn cases() -> [Case; 2] {
    [
        // The tiny fixtures: partial rotary 0.25 of head 32, sections [2, 1, 1].
        case("tiny", (4, 2, 32), 8, 10_000.0, [2, 1, 1]),
        // Qwen3.5: 64 of 256 dims turned, 32 frequencies split 11 / 11 / 10.
        case("qwen3_5", (16, 2, 256), 64, 10_000_000.0, [11, 11, 10]),
    ]
}

const BLOCK: usize = 16;

/// A prompt's parts: text tokens, or an image of `h × w` merged tokens.
enum Seg {
    Text(u32),
    Image(u32, u32),
}

/// The `(t, h, w)` of every token (transformers' `get_rope_index`): text advances all three axes
/// by one; an image's tokens sit at its start plus their row (h) and column (w), and the text after
/// it starts at its start plus `max(h, w)`.
fn positions(segs: &[Seg]) -> Vec<[u32; 3]> {
    let (mut out, mut next) = (Vec::new(), 0u32);
    for s in segs {
        match *s {
            Seg::Text(n) => {
                for _ in 0..n {
                    out.push([next; 3]);
                    next += 1;
                }
            }
            Seg::Image(h, w) => {
                for r in 0..h {
                    for c in 0..w {
                        out.push([next, next + r, next + c]);
                    }
                }
                next += h.max(w);
            }
        }
    }
    out
}

/// A seeded generator of normals.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// `n` normals times `scale`, rounded to bf16 (what both backends see).
    fn bf16_normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.next(), self.next());
                let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
                bf16::from_f32(scale * z as f32).to_f32()
            })
            .collect()
    }
}

/// One step's inputs: `(sequence, pos0, len)` chunks in row order and the host rows of q|gate, k, v.
struct Step {
    chunks: Vec<(usize, usize, usize)>,
    q_gate: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Step {
    fn rows(&self) -> usize {
        self.chunks.iter().map(|c| c.2).sum()
    }
}

/// Two sequences (A: text, a 3×4 image, text; B: text, a 2×5 image, one token, a 4×2 image, text)
/// over three steps: both prefill, then A decodes while B prefills a chunk that starts inside its
/// second image, then both decode (the decode kernel's path).
fn schedule(c: &Case, rng: &mut Rng) -> (Vec<Vec<[u32; 3]>>, Vec<Step>) {
    use Seg::{Image, Text};
    let seqs = vec![
        positions(&[Text(3), Image(3, 4), Text(10)]),
        positions(&[Text(2), Image(2, 5), Text(1), Image(4, 2), Text(5)]),
    ];
    let (nh, nkv, d) = (c.shape.num_heads, c.shape.num_kv_heads, c.shape.head_dim);
    let plans: [&[(usize, usize, usize)]; 3] = [
        &[(0, 0, 20), (1, 0, 13)],
        &[(0, 20, 1), (1, 13, 9)],
        &[(0, 21, 1), (1, 22, 1)],
    ];
    let steps = plans
        .iter()
        .map(|plan| {
            let rows: usize = plan.iter().map(|c| c.2).sum();
            Step {
                chunks: plan.to_vec(),
                q_gate: rng.bf16_normals(rows * 2 * nh * d, 1.0),
                k: rng.bf16_normals(rows * nkv * d, 1.0),
                v: rng.bf16_normals(rows * nkv * d, 1.0),
            }
        })
        .collect();
    (seqs, steps)
}

/// Layer 0's K/V pools on `b`: `num_blocks` blocks of [`BLOCK`] positions.
fn init_cache<B: Backend>(b: &B, c: &Case, num_blocks: usize) {
    b.init_cache(&CacheSpec {
        num_blocks,
        block_size: BLOCK,
        attn_layers: vec![0],
        num_kv_heads: c.shape.num_kv_heads,
        head_dim: c.shape.head_dim,
        index_head_dim: 0,
        gdn_layers: vec![],
        gdn: GdnShape {
            num_k_heads: 1,
            num_v_heads: 1,
            k_head_dim: 8,
            v_head_dim: 8,
            conv_kernel: 4,
        },
        ple_layers: vec![],
        ple: None,
        kv_host: None,
    })
    .unwrap();
}

/// The q/k norm weights (bf16 values, zero-centred) and unused projections.
fn weights<B: Backend>(b: &B, c: &Case) -> AttnWeights<B::Weight> {
    let d = c.shape.head_dim;
    let w = |n: usize| b.weight(vec![0.0; n], &[n]).unwrap();
    let norm = |scale: f32| {
        let v = (0..d)
            .map(|i| bf16::from_f32(scale * (i as f32 / d as f32 - 0.5)).to_f32())
            .collect();
        b.weight(v, &[d]).unwrap()
    };
    AttnWeights {
        q_proj: w(1),
        k_proj: w(1),
        v_proj: w(1),
        o_proj: w(1),
        q_norm: norm(0.3),
        k_norm: norm(-0.2),
    }
}

/// Runs `steps` through `b`'s attention, sequence `i` in blocks `blocks[i]`; with `mrope`, every
/// row at the positions `at(sequence, position)` gives. Returns each step's output rows.
fn run<B: Backend>(
    b: &B,
    c: &Case,
    w: &AttnWeights<B::Weight>,
    steps: &[Step],
    blocks: &[Vec<u32>],
    at: Option<&dyn Fn(usize, usize) -> [u32; 3]>,
) -> Vec<Vec<f32>> {
    let (nh, nkv, d) = (c.shape.num_heads, c.shape.num_kv_heads, c.shape.head_dim);
    steps
        .iter()
        .map(|s| {
            let rows = s.rows();
            let mut start = 0;
            let seqs: Vec<SeqChunk<'_>> = s
                .chunks
                .iter()
                .map(|&(i, pos0, len)| {
                    let chunk = SeqChunk {
                        start,
                        len,
                        pos0,
                        state: i,
                        blocks: &blocks[i],
                    };
                    start += len;
                    chunk
                })
                .collect();
            let p: Option<Vec<[u32; 3]>> = at.map(|at| {
                s.chunks
                    .iter()
                    .flat_map(|&(i, pos0, len)| (pos0..pos0 + len).map(move |p| at(i, p)))
                    .collect()
            });
            let up = |cols: usize, v: &[f32]| b.upload(rows, cols, v.to_vec()).unwrap();
            let (q_gate, k, v) = (
                up(2 * nh * d, &s.q_gate),
                up(nkv * d, &s.k),
                up(nkv * d, &s.v),
            );
            let out = b
                .attention(&AttnCall {
                    layer: 0,
                    shape: &c.shape,
                    rope: &c.rope,
                    q_gate: &q_gate,
                    k: &k,
                    v: &v,
                    w,
                    seqs: &seqs,
                    mrope: p.as_deref().map(|positions| Mrope {
                        positions,
                        sections: c.sections,
                    }),
                })
                .unwrap_or_else(|e| panic!("{}: attention: {e}", c.name));
            b.to_host(out).unwrap().2
        })
        .collect()
}

/// `max|got − want| / max|want|` and `‖got − want‖ / ‖want‖`.
fn rel(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (mut max_abs, mut se, mut sw) = (0f32, 0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let e = (g - w).abs();
        assert!(e.is_finite(), "non-finite: {g} vs {w}");
        max_abs = max_abs.max(e);
        se += (e as f64).powi(2);
        sw += (*w as f64).powi(2);
    }
    (
        max_abs / scale.max(f32::MIN_POSITIVE),
        (se / sw.max(1e-30)).sqrt() as f32,
    )
}

const STEP_NAMES: [&str; 3] = ["prefill", "mixed", "decode"];

#[test]
fn attention_at_mrope_positions_matches_cpu() {
    for c in cases() {
        let mut rng = Rng(0x5eed + c.shape.head_dim as u64);
        let (pos, steps) = schedule(&c, &mut rng);
        let at = |i: usize, p: usize| pos[i][p];
        // The CPU side first (it also runs on machines without a GPU): sequences A, B in blocks
        // 0–1 and 2–3, and again with plain RoPE in blocks 4–7. The positions matter: plain RoPE
        // lands far outside the bound below.
        let cpu = CpuBackend::new();
        init_cache(&cpu, &c, 8);
        let blocks = [vec![0u32, 1], vec![2, 3]];
        let wc = weights(&cpu, &c);
        let want = run(&cpu, &c, &wc, &steps, &blocks, Some(&at));
        let plain = run(&cpu, &c, &wc, &steps, &[vec![4, 5], vec![6, 7]], None);
        let moved: Vec<f32> = plain.iter().zip(&want).map(|(p, w)| rel(p, w).0).collect();
        for (m, name) in moved.iter().zip(STEP_NAMES) {
            assert!(
                *m > 2.0 * OP_MAX_REL,
                "{} {name}: plain RoPE is within {m:e} of MRoPE",
                c.name
            );
        }
        let Some(gpu) = backend("attention_at_mrope_positions_matches_cpu") else {
            return;
        };
        init_cache(&gpu, &c, 8);
        let wg = weights(&gpu, &c);
        let got = run(&gpu, &c, &wg, &steps, &blocks, Some(&at));
        for (si, name) in STEP_NAMES.iter().enumerate() {
            let (max_rel, rms_rel) = rel(&got[si], &want[si]);
            let moved = moved[si];
            let max_abs = got[si]
                .iter()
                .zip(&want[si])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!(
                "MROPE check=attention_vs_cpu case={} step={name} rows={} max_abs={max_abs:.3e} max_rel={max_rel:.3e} rms_rel={rms_rel:.3e} tol_max_rel={OP_MAX_REL} tol_rms_rel={OP_RMS_REL} plain_rope_moves_max_rel={moved:.3e}",
                c.name,
                steps[si].rows()
            );
            assert!(
                max_rel <= OP_MAX_REL && rms_rel <= OP_RMS_REL,
                "{} {name}: attention at MRoPE positions off the CPU by max_rel {max_rel:e}, rms_rel {rms_rel:e}",
                c.name
            );
        }
    }
}

#[test]
fn mrope_at_sequence_positions_is_the_plain_call() {
    for c in cases() {
        let Some(gpu) = backend("mrope_at_sequence_positions_is_the_plain_call") else {
            return;
        };
        let mut rng = Rng(0xabc + c.shape.head_dim as u64);
        let (_, steps) = schedule(&c, &mut rng);
        init_cache(&gpu, &c, 8);
        let w = weights(&gpu, &c);
        let seq_pos = |_: usize, p: usize| [p as u32; 3];
        let plain = run(&gpu, &c, &w, &steps, &[vec![0, 1], vec![2, 3]], None);
        let mrope = run(
            &gpu,
            &c,
            &w,
            &steps,
            &[vec![4, 5], vec![6, 7]],
            Some(&seq_pos),
        );
        for (si, name) in STEP_NAMES.iter().enumerate() {
            let (a, b) = (&plain[si], &mrope[si]);
            let differ = a
                .iter()
                .zip(b)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            println!(
                "MROPE check=sequence_positions_bitwise case={} step={name} values={} differing={differ}",
                c.name,
                a.len()
            );
            assert_eq!(
                differ, 0,
                "{} {name}: MRoPE at the sequence positions is not the plain call",
                c.name
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A prompt with two images, end to end
// ---------------------------------------------------------------------------------------------

const BLOCKS_PER_SEQ: usize = 32;

/// The fixture directory: `$SANMAI_FIXTURES`, else `tests/fixtures` under the working directory (a
/// prebuilt binary run from the repository root), else the one next to this crate.
fn fixture(name: &str) -> PathBuf {
    let dirs = [
        std::env::var_os("SANMAI_FIXTURES").map(PathBuf::from),
        Some(PathBuf::from("tests/fixtures")),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")),
    ];
    let dir = dirs
        .into_iter()
        .flatten()
        .find(|d| d.join(name).is_dir())
        .unwrap_or_else(|| panic!("fixture {name} not found: set SANMAI_FIXTURES"));
    dir.join(name)
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&x| x as f64 - lse).collect()
}

fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

fn mean_max(errs: &[f64]) -> (f64, f64) {
    let mean = errs.iter().sum::<f64>() / errs.len().max(1) as f64;
    (mean, errs.iter().copied().fold(0.0, f64::max))
}

/// The prompt of the fixture, its images' patch rows and grids.
struct Prompt {
    ids: Vec<u32>,
    pixels: Vec<f32>,
    grids: Vec<Grid>,
    greedy: Vec<u32>,
    logprobs: Vec<Option<f64>>,
}

fn prompt(dir: &Path) -> Prompt {
    let r = json(&dir.join("reference.json"));
    let mut pixels = Vec::new();
    for im in r["images"].as_array().unwrap() {
        pixels.extend(read_f32(
            &dir.join(im["pixel_values_file"].as_str().unwrap()),
        ));
    }
    Prompt {
        ids: ids(&r["input_ids"]),
        pixels,
        grids: serde_json::from_value(r["image_grid_thw"].clone()).unwrap(),
        greedy: ids(&r["greedy_ids"]),
        logprobs: r["prompt_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(Value::as_f64)
            .collect(),
    }
}

/// Log-prob rows of the prompt on `b`, in chunks of `chunk_len`, then of each step of the
/// teacher-forced continuation `p.greedy` (text after the images at sequence position + delta).
fn prompt_rows<B: Backend>(b: B, dir: &Path, p: &Prompt, chunk_len: usize) -> Vec<Vec<f64>> {
    let mut cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    cfg.mtp_layers = 0;
    let ckpt = Checkpoint::open(dir).unwrap();
    let vision = Vision::load(&cfg, &ckpt).unwrap().expect("a vision tower");
    let m = Model::load(cfg, &ckpt, b).unwrap();
    m.init_cache(BLOCKS_PER_SEQ * 2, BLOCK).unwrap();
    let pos = vision.positions(&p.ids, &p.grids).unwrap();
    let embeds = m.image_embeds(&vision, &p.pixels, &p.grids).unwrap();
    let state = m.backend.alloc_state().unwrap();
    let blocks: Vec<u32> = (0..BLOCKS_PER_SEQ as u32).collect();
    let vocab = m.cfg.vocab_size;
    let step = |tokens: &[u32], pos0: usize, out: OutRows, embeds: Option<StepEmbeds<'_, _>>| {
        let mrope = pos.at(pos0, tokens.len());
        let o = m
            .step_multimodal(
                StepInput {
                    chunks: &[StepChunk {
                        tokens,
                        history: &[],
                        pos0,
                        state,
                        blocks: &blocks,
                        out,
                    }],
                    start: StepStart::Tokens,
                    hidden: false,
                },
                StepMultimodal {
                    positions: &[Some(&mrope)],
                    embeds,
                },
            )
            .unwrap();
        let (_, _, data) = m.backend.to_host(o.logits.unwrap()).unwrap();
        data.chunks_exact(vocab)
            .map(log_softmax)
            .collect::<Vec<_>>()
    };
    let mut rows = Vec::new();
    let mut pos0 = 0;
    while pos0 < p.ids.len() {
        let len = chunk_len.min(p.ids.len() - pos0);
        let (img_rows, first) = pos.image_rows_in(pos0, len, 0);
        let embeds = match img_rows.is_empty() {
            true => None,
            false => Some(StepEmbeds {
                rows: &img_rows,
                values: m
                    .backend
                    .rows(
                        &embeds,
                        &(first..first + img_rows.len()).collect::<Vec<_>>(),
                    )
                    .unwrap(),
            }),
        };
        rows.extend(step(&p.ids[pos0..pos0 + len], pos0, OutRows::All, embeds));
        pos0 += len;
    }
    for (i, &t) in p.greedy.iter().enumerate() {
        rows.extend(step(&[t], p.ids.len() + i, OutRows::Last, None));
    }
    m.backend.free_state(state);
    rows
}

/// transformers' bf16 run's largest mean log-prob error on the prompts of the text fixture of the
/// same architecture (`bf16_distance.json` beside the fixtures).
fn bf16_mean_error() -> f64 {
    let path = fixture("qwen3_5_moe_text_tiny").with_file_name("bf16_distance.json");
    json(&path)["qwen3_5_moe_text_tiny"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["mean_err"].as_f64().unwrap())
        .fold(0.0, f64::max)
}

#[test]
fn two_images_step_multimodal_matches_cpu() {
    let dir = fixture("qwen3_5_mm_tiny");
    let p = prompt(&dir);
    let n = p.ids.len();
    let tol_mean = bf16_mean_error() + MARGIN;
    for chunk_len in [n, 7] {
        // The CPU side first: it also runs on machines without a GPU.
        let want = prompt_rows(CpuBackend::new(), &dir, &p, chunk_len);
        let Some(b) = backend("two_images_step_multimodal_matches_cpu") else {
            return;
        };
        let got = prompt_rows(b, &dir, &p, chunk_len);
        assert_eq!(got.len(), want.len());
        // Every vocabulary entry of every row; the prompt tokens' log-probs; the argmax.
        let (mut all, mut tok, mut vs_ref, mut near, mut differ) =
            (Vec::new(), Vec::new(), Vec::new(), 0, Vec::new());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            all.extend(g.iter().zip(w).map(|(a, b)| (a - b).abs()));
            if i + 1 < n {
                let t = p.ids[i + 1] as usize;
                tok.push((g[t] - w[t]).abs());
                if let Some(r) = p.logprobs[i + 1] {
                    vs_ref.push((g[t] - r).abs());
                }
            }
            let (ga, wa) = (argmax(g), argmax(w));
            if ga != wa {
                let gap = w[wa] - w[ga];
                if gap < GAP {
                    near += 1;
                } else {
                    differ.push(format!("row {i}: {ga} vs cpu {wa} (gap {gap:.2})"));
                }
            }
        }
        let (mean, worst) = mean_max(&all);
        let (tok_mean, tok_max) = mean_max(&tok);
        let (ref_mean, ref_max) = mean_max(&vs_ref);
        println!(
            "MROPE check=step_multimodal_vs_cpu model=qwen3_5_mm_tiny chunk={chunk_len} rows={} mean_err={mean:.3} max_err={worst:.3} prompt_token_mean_err={tok_mean:.3} prompt_token_max_err={tok_max:.3} vs_transformers_mean_err={ref_mean:.3} vs_transformers_max_err={ref_max:.3} argmax_near_ties={near} argmax_differing={differ:?} tol_mean={tol_mean:.3} tol_max={MAX_TOL}",
            got.len()
        );
        assert!(
            differ.is_empty(),
            "chunks of {chunk_len}: argmax off the CPU where its gap is at least {GAP}: {differ:?}"
        );
        assert!(
            mean <= tol_mean && worst <= MAX_TOL && tok_mean <= tol_mean && tok_max <= MAX_TOL,
            "chunks of {chunk_len}: log-prob error mean {mean} / {tok_mean} (bound {tol_mean}), max {worst} / {tok_max}"
        );
    }
}
