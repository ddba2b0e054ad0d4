//! Images in the text model's step on the CPU backend ([`Model::step_multimodal`]): explicit
//! interleaved-MRoPE positions and input embeddings in place of token embeddings.
//!
//! - positions equal to the sequence positions, and embeddings equal to the token embeddings,
//!   change nothing, bit for bit (the plain step is the reference), with and without
//!   hyper-connections; a given embedding is the one the layers read;
//! - (`mrope.rs`: the attention op turns rows at explicit positions as transformers does);
//! - the vision tower loads through the model crate from a checkpoint and computes the vision
//!   fixture's merged tokens; a prompt's positions are `get_rope_index`'s;
//! - `tests/fixtures/qwen3_5_mm_tiny` (from `tests/reference/make_mm_fixtures.py`, when present):
//!   transformers' vision embeddings, positions, prompt log-probabilities and greedy continuation
//!   of a prompt with two images.

use std::path::Path;

use sanmai_config::ModelConfig;
use sanmai_cpu::{CpuBackend, CpuTensor};
use sanmai_model::vision::{Grid, PreprocessorConfig, Vision};
use sanmai_model::{
    Backend, Model, OutRows, StepChunk, StepEmbeds, StepInput, StepMultimodal, StepStart,
};
use sanmai_weights::{Checkpoint, Dummy, HostTensor, Init, TensorSource, WeightError};
use serde_json::Value;

mod fixture_util;
mod step_util;
use fixture_util::*;
use step_util::{host, logits, new_seq, Seq, BLOCKS_PER_SEQ};

const BLOCK: usize = 16;

fn load(name: &str) -> Model<CpuBackend> {
    let dir = fixture(name);
    let mut cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    cfg.mtp_layers = 0;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Model::load(cfg, &ckpt, CpuBackend::new()).unwrap();
    model.init_cache(BLOCKS_PER_SEQ * 8, BLOCK).unwrap();
    model
}

/// The logits `[rows, vocab]` of one multimodal step from tokens.
fn mm_logits(
    m: &Model<CpuBackend>,
    chunks: &[StepChunk<'_>],
    mm: StepMultimodal<'_, CpuTensor>,
) -> Vec<f32> {
    let out = m
        .step_multimodal(
            StepInput {
                chunks,
                start: StepStart::Tokens,
                hidden: false,
            },
            mm,
        )
        .unwrap();
    out.logits.map_or_else(Vec::new, |l| host(m, l).2)
}

/// The plain positions `pos0 + i` of `len` tokens on every axis.
fn plain(pos0: usize, len: usize) -> Vec<[u32; 3]> {
    (pos0..pos0 + len).map(|p| [p as u32; 3]).collect()
}

/// A prompt of `n` tokens below `vocab` (deterministic).
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((i * 2_654_435_761 + 12_345) % vocab as u64) as u32)
        .collect()
}

/// Prefill in two chunks then four decode steps, plain and with explicit positions equal to the
/// sequence positions (on a second sequence): the logits agree bit for bit.
fn equal_positions_change_nothing(name: &str) {
    let m = load(name);
    let tokens = prompt(74, m.cfg.vocab_size);
    let (a, b) = (new_seq(&m, 0), new_seq(&m, 1));
    for (pos0, len) in [(0, 41), (41, 29), (70, 1), (71, 1), (72, 1), (73, 1)] {
        let want = logits(&m, &[a.chunk(&tokens, pos0, len, OutRows::All)]);
        let p = plain(pos0, len);
        let got = mm_logits(
            &m,
            &[b.chunk(&tokens, pos0, len, OutRows::All)],
            StepMultimodal {
                positions: &[Some(&p)],
                embeds: None,
            },
        );
        assert_eq!(got, want, "{name}: chunk at {pos0} of {len}");
    }
}

#[test]
fn mrope_at_sequence_positions_is_the_plain_step() {
    equal_positions_change_nothing("qwen3_5_moe_tiny");
    equal_positions_change_nothing("qwen4_exp_hc_tiny");
}

#[test]
fn mrope_positions_for_some_chunks_of_a_batch() {
    let m = load("qwen3_5_moe_tiny");
    let tokens = prompt(30, m.cfg.vocab_size);
    let seqs: Vec<Seq> = (0..4).map(|i| new_seq(&m, i)).collect();
    let want = logits(
        &m,
        &[
            seqs[0].chunk(&tokens, 0, 30, OutRows::All),
            seqs[1].chunk(&tokens, 0, 17, OutRows::All),
        ],
    );
    let p = plain(0, 17);
    let got = mm_logits(
        &m,
        &[
            seqs[2].chunk(&tokens, 0, 30, OutRows::All),
            seqs[3].chunk(&tokens, 0, 17, OutRows::All),
        ],
        StepMultimodal {
            positions: &[None, Some(&p)],
            embeds: None,
        },
    );
    assert_eq!(got, want);
}

/// The token embeddings of `ids` as a tensor.
fn token_embeds(m: &Model<CpuBackend>, ids: &[u32]) -> CpuTensor {
    m.backend.embed(m.embedding(), ids).unwrap()
}

fn given_embeddings_are_read(name: &str) {
    let m = load(name);
    let tokens = prompt(40, m.cfg.vocab_size);
    let seqs: Vec<Seq> = (0..3).map(|i| new_seq(&m, i)).collect();
    let want = logits(&m, &[seqs[0].chunk(&tokens, 0, 40, OutRows::All)]);
    // The token embeddings themselves: nothing changes.
    let rows: Vec<usize> = (3..9).chain([20, 39]).collect();
    let ids: Vec<u32> = rows.iter().map(|&r| tokens[r]).collect();
    let got = mm_logits(
        &m,
        &[seqs[1].chunk(&tokens, 0, 40, OutRows::All)],
        StepMultimodal {
            positions: &[],
            embeds: Some(StepEmbeds {
                rows: &rows,
                values: token_embeds(&m, &ids),
            }),
        },
    );
    assert_eq!(got, want, "{name}: the token embeddings given");
    // Other tokens' embeddings on those rows: the step of the prompt with those tokens.
    let others: Vec<u32> = ids
        .iter()
        .map(|&t| (t + 101) % m.cfg.vocab_size as u32)
        .collect();
    let mut swapped = tokens.clone();
    for (&r, &t) in rows.iter().zip(&others) {
        swapped[r] = t;
    }
    let seq = new_seq(&m, 3);
    let want = logits(&m, &[seq.chunk(&swapped, 0, 40, OutRows::All)]);
    let got = mm_logits(
        &m,
        &[seqs[2].chunk(&tokens, 0, 40, OutRows::All)],
        StepMultimodal {
            positions: &[],
            embeds: Some(StepEmbeds {
                rows: &rows,
                values: token_embeds(&m, &others),
            }),
        },
    );
    assert_eq!(got, want, "{name}: other embeddings given");
}

#[test]
fn given_embeddings_replace_token_embeddings() {
    given_embeddings_are_read("qwen3_5_moe_tiny");
    // Hyper-connections copy every stream from the embedding: after the replacement.
    given_embeddings_are_read("qwen4_exp_hc_tiny");
}

#[test]
fn multimodal_inputs_that_do_not_fit_are_refused() {
    let m = load("qwen3_5_moe_tiny");
    let tokens = prompt(8, m.cfg.vocab_size);
    let seq = new_seq(&m, 0);
    let chunks = [seq.chunk(&tokens, 0, 8, OutRows::Last)];
    let run = |mm: StepMultimodal<'_, CpuTensor>| {
        m.step_multimodal(
            StepInput {
                chunks: &chunks,
                start: StepStart::Tokens,
                hidden: false,
            },
            mm,
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    };
    let short = plain(0, 7);
    let e = run(StepMultimodal {
        positions: &[Some(&short)],
        embeds: None,
    });
    assert!(e.contains("7 MRoPE positions for 8 tokens"), "{e}");
    let e = run(StepMultimodal {
        positions: &[None, Some(&short)],
        embeds: None,
    });
    assert!(e.contains("for 2 chunks"), "{e}");
    let e = run(StepMultimodal {
        positions: &[],
        embeds: Some(StepEmbeds {
            rows: &[8],
            values: token_embeds(&m, &[1]),
        }),
    });
    assert!(e.contains("row 8 of a step of 8 rows"), "{e}");
    let e = run(StepMultimodal {
        positions: &[],
        embeds: Some(StepEmbeds {
            rows: &[2, 2],
            values: token_embeds(&m, &[1, 1]),
        }),
    });
    assert!(e.contains("two input embeddings for row 2"), "{e}");
    let e = run(StepMultimodal {
        positions: &[],
        embeds: Some(StepEmbeds {
            rows: &[1, 2],
            values: token_embeds(&m, &[1]),
        }),
    });
    assert!(e.contains("set_rows"), "{e}");

    // A model without MRoPE sections, and QSA attention, refuse explicit positions.
    let next = load("qwen3_next_tiny");
    let seq = new_seq(&next, 0);
    let p = plain(0, 8);
    let e = next
        .step_multimodal(
            StepInput {
                chunks: &[seq.chunk(&tokens, 0, 8, OutRows::Last)],
                start: StepStart::Tokens,
                hidden: false,
            },
            StepMultimodal {
                positions: &[Some(&p)],
                embeds: None,
            },
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no mrope_section"), "{e}");
    let qsa = load("qwen4_exp_qsa_tiny");
    assert!(qsa.cfg.rope.mrope_section.is_some());
    let seq = new_seq(&qsa, 0);
    let e = qsa
        .step_multimodal(
            StepInput {
                chunks: &[seq.chunk(&tokens, 0, 8, OutRows::Last)],
                start: StepStart::Tokens,
                hidden: false,
            },
            StepMultimodal {
                positions: &[Some(&p)],
                embeds: None,
            },
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("qsa_attention") && e.contains("MRoPE"), "{e}");
}

/// Positions that differ from the sequence positions from row 5 on: the rows before are the plain
/// step's bit for bit (causal attention), the rows from 5 on are not.
#[test]
fn mrope_positions_reach_the_attention_layers() {
    let m = load("qwen3_5_moe_tiny");
    let tokens = prompt(12, m.cfg.vocab_size);
    let (a, b) = (new_seq(&m, 0), new_seq(&m, 1));
    let want = logits(&m, &[a.chunk(&tokens, 0, 12, OutRows::All)]);
    let mut p = plain(0, 12);
    for (i, x) in p.iter_mut().enumerate().skip(5) {
        *x = [5, 5 + (i as u32 - 5) / 3, 5 + (i as u32 - 5) % 3];
    }
    let got = mm_logits(
        &m,
        &[b.chunk(&tokens, 0, 12, OutRows::All)],
        StepMultimodal {
            positions: &[Some(&p)],
            embeds: None,
        },
    );
    let v = m.cfg.vocab_size;
    assert_eq!(&got[..5 * v], &want[..5 * v]);
    for r in 6..12 {
        let d = got[r * v..(r + 1) * v]
            .iter()
            .zip(&want[r * v..(r + 1) * v])
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            d > 1e-3,
            "row {r}: MRoPE positions moved the logits by {d} only"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The vision tower through the model crate
// ---------------------------------------------------------------------------------------------

/// The Qwen3.5-MoE tiny config with `vision` as its `vision_config`.
fn config_with_vision(vision: Value) -> ModelConfig {
    let dir = fixture("qwen3_5_moe_tiny");
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    v["vision_config"] = vision;
    ModelConfig::from_value(&v, "config.json").unwrap()
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn vision_tower_loads_from_a_checkpoint_and_merges_the_fixture_images() {
    let dir = fixture("qwen3_5_vision_tiny");
    let cfg = config_with_vision(json(&dir.join("config.json")));
    let vision = Vision::load(&cfg, &Checkpoint::open(&dir).unwrap())
        .unwrap()
        .expect("a vision_config");
    assert_eq!(vision.config.depth, 2);
    assert_eq!(vision.image_token_id, 248056);
    let r = reference(&dir);
    let mut grids: Vec<Grid> = Vec::new();
    let mut pixels = Vec::new();
    for im in r["images"].as_array().unwrap() {
        grids.push(serde_json::from_value(im["grid_thw"].clone()).unwrap());
        pixels.extend(read_f32(&dir.join(im["file"].as_str().unwrap())));
    }
    let merged = vision.forward(&pixels, &grids).unwrap();
    let want: Vec<f64> = serde_json::from_value(r["merger"].clone()).unwrap();
    assert_eq!(merged.len(), want.len());
    let worst = merged
        .iter()
        .zip(&want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-5, "merged tokens off by {worst}");
    assert_eq!(
        grids.iter().map(|&g| vision.tokens(g)).sum::<usize>() * cfg.hidden_size,
        want.len()
    );

    // On the backend: the same values, [tokens, hidden].
    let m = load("qwen3_5_moe_tiny");
    let t = m.image_embeds(&vision, &pixels, &grids).unwrap();
    assert_eq!((t.rows, t.cols), (want.len() / 64, 64));
    assert_eq!(t.data, merged);

    // The prompt's positions: get_rope_index's.
    let ids = ids(&r["rope_index"]["input_ids"]);
    let p = vision.positions(&ids, &grids).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(r["rope_index"]["positions"].clone()).unwrap();
    for (a, axis) in want.iter().enumerate() {
        let got: Vec<u32> = p.positions.iter().map(|x| x[a]).collect();
        assert_eq!(&got, axis, "axis {a}");
    }
    assert_eq!(p.delta, r["rope_index"]["delta"].as_i64().unwrap());
    assert_eq!(
        p.image_rows.len(),
        grids.iter().map(|&g| vision.tokens(g)).sum::<usize>()
    );
    assert!(p.image_rows.iter().all(|&i| ids[i] == 248056));
    // After the prompt, text continues at p + delta on every axis.
    let n = ids.len();
    assert_eq!(
        p.at(n - 1, 3),
        vec![
            p.positions[n - 1],
            [(n as i64 + p.delta) as u32; 3],
            [(n as i64 + 1 + p.delta) as u32; 3]
        ]
    );
}

/// A tensor source without one tensor.
struct Without(Dummy, &'static str);

impl TensorSource for Without {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        init: Init,
    ) -> sanmai_weights::Result<HostTensor<'_>> {
        match name == self.1 {
            true => Err(WeightError::Missing { name: name.into() }),
            false => self.0.tensor(name, shape, init),
        }
    }

    fn contains(&self, name: &str) -> bool {
        name != self.1
    }
}

#[test]
fn vision_weights_from_a_random_source_and_a_checkpoint_without_them() {
    let dir = fixture("qwen3_5_vision_tiny");
    let cfg = config_with_vision(json(&dir.join("config.json")));
    // A random source has every tensor at the shape asked for.
    let v = Vision::load(&cfg, &Dummy::new(7)).unwrap().unwrap();
    assert_eq!(v.weights.blocks.len(), 2);
    // The text fixture has no `model.visual.*`: no tower (the model serves text).
    let text_only = Checkpoint::open(&fixture("qwen3_5_moe_tiny")).unwrap();
    assert!(Vision::load(&cfg, &text_only).unwrap().is_none());
    // A tower with a tensor missing: it is named.
    let e = Vision::load(
        &cfg,
        &Without(Dummy::new(7), "model.visual.blocks.1.norm1.weight"),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("blocks.1.norm1.weight") && e.contains("missing"),
        "{e}"
    );
    // No vision_config, no tower.
    let text = ModelConfig::from_file(&fixture("qwen3_next_tiny").join("config.json")).unwrap();
    assert!(Vision::load(&text, &Dummy::new(7)).unwrap().is_none());
}

// ---------------------------------------------------------------------------------------------
// transformers on a prompt with two images (tests/fixtures/qwen3_5_mm_tiny)
// ---------------------------------------------------------------------------------------------

const MM_TOL: f64 = 1e-3;

fn worst(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0.0, f64::max)
}

#[test]
fn two_images_are_transformers() {
    let dir = fixture("qwen3_5_mm_tiny");
    if !dir.join("reference.json").exists() {
        eprintln!(
            "SKIPPED: {} is absent; make it on a host with transformers 5.17 and torch: \
             python3 tests/reference/make_mm_fixtures.py tests/fixtures",
            dir.display()
        );
        return;
    }
    let r = reference(&dir);
    let mut cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    cfg.mtp_layers = 0;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let vision = Vision::load(&cfg, &ckpt).unwrap().expect("a vision tower");
    let m = Model::load(cfg, &ckpt, CpuBackend::new()).unwrap();
    m.init_cache(BLOCKS_PER_SEQ * 8, BLOCK).unwrap();
    let pre = PreprocessorConfig::from_file(&dir.join("preprocessor_config.json")).unwrap();
    assert_eq!(
        vision.image_token_id,
        r["image_token_id"].as_u64().unwrap() as u32
    );

    // Each image: our preprocessing of its PNG is transformers' pixel values, and the tower's
    // merged tokens are transformers'.
    let mut grids: Vec<Grid> = Vec::new();
    let mut pixels = Vec::new();
    for (i, im) in r["images"].as_array().unwrap().iter().enumerate() {
        let grid: Grid = serde_json::from_value(im["grid_thw"].clone()).unwrap();
        let bytes = std::fs::read(dir.join(im["file"].as_str().unwrap())).unwrap();
        let ours = sanmai_model::vision::preprocess(&bytes, &pre).unwrap();
        assert_eq!(ours.grid_thw, grid, "image {i}: grid");
        let theirs = read_f32(&dir.join(im["pixel_values_file"].as_str().unwrap()));
        let off = ours
            .pixel_values
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(off < 1e-6, "image {i}: pixel values off by {off}");
        let merged = vision.forward(&theirs, &[grid]).unwrap();
        let want: Vec<f64> = serde_json::from_value(im["embeds"].clone()).unwrap();
        let w = worst(&merged, &want);
        eprintln!("image {i} {grid:?}: vision embeddings max error {w:.1e}");
        assert!(w < MM_TOL, "image {i}: vision embeddings off by {w}");
        grids.push(grid);
        pixels.extend(theirs);
    }
    let want_grids: Vec<Grid> = serde_json::from_value(r["image_grid_thw"].clone()).unwrap();
    assert_eq!(grids, want_grids);

    // The prompt's positions and delta.
    let prompt = ids(&r["input_ids"]);
    let pos = vision.positions(&prompt, &grids).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(r["position_ids"].clone()).unwrap();
    for (a, axis) in want.iter().enumerate() {
        let got: Vec<u32> = pos.positions.iter().map(|x| x[a]).collect();
        assert_eq!(&got, axis, "position ids, axis {a}");
    }
    assert_eq!(pos.delta, r["rope_deltas"].as_i64().unwrap());

    // Prompt log-probabilities, in one chunk and in chunks that cut the images.
    let embeds = m.image_embeds(&vision, &pixels, &grids).unwrap();
    let want_lp = floats(&r["prompt_logprobs"]);
    let greedy = ids(&r["greedy_ids"]);
    let gaps = floats(&r["greedy_top2_gap"]);
    for (si, chunk_len) in [prompt.len(), 7].into_iter().enumerate() {
        let seq = new_seq(&m, si);
        let mut rows: Vec<Vec<f64>> = Vec::new();
        let mut pos0 = 0;
        while pos0 < prompt.len() {
            let len = chunk_len.min(prompt.len() - pos0);
            let p = pos.at(pos0, len);
            let (img_rows, first) = pos.image_rows_in(pos0, len, 0);
            let values = m
                .backend
                .rows(
                    &embeds,
                    &(first..first + img_rows.len()).collect::<Vec<_>>(),
                )
                .unwrap();
            let data = mm_logits(
                &m,
                &[seq.chunk(&prompt, pos0, len, OutRows::All)],
                StepMultimodal {
                    positions: &[Some(&p)],
                    embeds: (!img_rows.is_empty()).then_some(StepEmbeds {
                        rows: &img_rows,
                        values,
                    }),
                },
            );
            rows.extend(data.chunks_exact(m.cfg.vocab_size).map(log_softmax));
            pos0 += len;
        }
        let mut w: f64 = 0.0;
        for t in 1..prompt.len() {
            w = w.max((rows[t - 1][prompt[t] as usize] - want_lp[t].unwrap()).abs());
        }
        eprintln!("chunks of {chunk_len}: prompt logprobs max error {w:.1e}");
        assert!(
            w < MM_TOL,
            "chunks of {chunk_len}: prompt logprobs off by {w}"
        );

        // The greedy continuation: text after the images at sequence position + delta.
        let mut tokens = prompt.clone();
        let mut next = argmax(rows.last().unwrap());
        for (i, &want) in greedy.iter().enumerate() {
            if gaps[i].unwrap() < MM_TOL {
                eprintln!("greedy token {i}: a near-tie in transformers, not compared further");
                break;
            }
            assert_eq!(next, want, "chunks of {chunk_len}: greedy token {i}");
            tokens.push(next);
            let at = tokens.len() - 1;
            let p = pos.at(at, 1);
            let data = mm_logits(
                &m,
                &[seq.chunk(&tokens, at, 1, OutRows::Last)],
                StepMultimodal {
                    positions: &[Some(&p)],
                    embeds: None,
                },
            );
            next = argmax(&log_softmax(&data));
        }
        m.backend.free_state(seq.state);
    }

    // Without the images' positions (plain RoPE) the prompt is scored differently: the positions
    // matter for this fixture.
    let seq = new_seq(&m, 5);
    let (img_rows, _) = pos.image_rows_in(0, prompt.len(), 0);
    let data = mm_logits(
        &m,
        &[seq.chunk(&prompt, 0, prompt.len(), OutRows::All)],
        StepMultimodal {
            positions: &[],
            embeds: Some(StepEmbeds {
                rows: &img_rows,
                values: embeds,
            }),
        },
    );
    let rows: Vec<Vec<f64>> = data
        .chunks_exact(m.cfg.vocab_size)
        .map(log_softmax)
        .collect();
    let w = (1..prompt.len())
        .map(|t| (rows[t - 1][prompt[t] as usize] - want_lp[t].unwrap()).abs())
        .fold(0.0, f64::max);
    eprintln!("plain RoPE instead of MRoPE: prompt logprobs move by up to {w:.1e}");
    assert!(w > MM_TOL, "plain RoPE is within {w} of MRoPE");
}
