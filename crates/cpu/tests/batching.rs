//! Batching invariants of the forward pass on the built-in model's shapes: sequences stepped together give
//! what they give alone, a prompt cut into chunks gives what one pass gives, and a state restored from a
//! copy (a prefix-cache checkpoint) continues exactly like the original.

use sanmai_cpu::CpuBackend;
use sanmai_model::{builtin, Backend, Model, OutRows, StepChunk};
use sanmai_weights::Dummy;

mod step_util;
use step_util::{logits, Seq};

const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: u32 = 32;

fn model() -> Model<CpuBackend> {
    let m = Model::load(
        builtin::config(),
        &Dummy::new(builtin::SEED),
        CpuBackend::new(),
    )
    .unwrap();
    m.init_cache(BLOCKS_PER_SEQ as usize * 16, BLOCK).unwrap();
    m
}

/// Sequence `i`: a fresh state slot and blocks `i·32 .. (i+1)·32` (shuffled, to exercise the block table).
fn seq(m: &Model<CpuBackend>, i: u32) -> Seq {
    let mut blocks: Vec<u32> = (i * BLOCKS_PER_SEQ..(i + 1) * BLOCKS_PER_SEQ).collect();
    blocks.reverse();
    blocks.swap(0, 5);
    Seq::new(m, blocks)
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % 248_000)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let m = model();
    let p = prompt(1, 200);
    let one = seq(&m, 0);
    let whole = logits(&m, &[one.chunk(&p, 0, 200, OutRows::All)]);
    let two = seq(&m, 1);
    let mut pieces = Vec::new();
    let mut pos = 0;
    for len in [1, 63, 64, 72] {
        pieces.extend(logits(&m, &[two.chunk(&p, pos, len, OutRows::All)]));
        pos += len;
    }
    let d = max_diff(&whole, &pieces);
    assert!(d < 1e-4, "chunked prefill differs by {d}");
}

#[test]
fn restored_state_and_copied_blocks_continue_like_the_original() {
    let m = model();
    let p = prompt(9, 120);
    // The original: 100 tokens (6 full blocks + 4 in the 7th), then 20 more.
    let a = seq(&m, 0);
    logits(&m, &[a.chunk(&p, 0, 100, OutRows::None)]);
    let checkpoint = m.backend.alloc_state().unwrap();
    m.backend.copy_state(a.state, checkpoint).unwrap();
    let want = logits(&m, &[a.chunk(&p, 100, 20, OutRows::All)]);
    // The copy: shares the 6 full blocks, copies the partial one, restores the state, then continues.
    let mut b = seq(&m, 1);
    b.blocks[..6].copy_from_slice(&a.blocks[..6]);
    m.backend.copy_block(a.blocks[6], b.blocks[6]).unwrap();
    m.backend.copy_state(checkpoint, b.state).unwrap();
    let got = logits(&m, &[b.chunk(&p, 100, 20, OutRows::All)]);
    assert_eq!(
        want, got,
        "a restored sequence must compute exactly what the original computed"
    );
}

#[test]
fn batched_steps_equal_single_sequence_steps() {
    let m = model();
    let prompts = [prompt(2, 5), prompt(3, 70), prompt(4, 1)];
    // Each sequence: its prompt, then 3 decode steps of the fixed tokens 7, 8, 9.
    let tokens: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| p.iter().copied().chain(7..10).collect())
        .collect();
    // Alone: each prompt, then its 3 decode steps.
    let mut alone = Vec::new();
    for (i, (p, toks)) in prompts.iter().zip(&tokens).enumerate() {
        let s = seq(&m, i as u32);
        let n = p.len();
        let mut rows = logits(&m, &[s.chunk(toks, 0, n, OutRows::Last)]);
        for step in 0..3 {
            rows.extend(logits(&m, &[s.chunk(toks, n + step, 1, OutRows::Last)]));
        }
        alone.push(rows);
    }
    // Together: one mixed prefill step, then batched decode steps.
    let seqs: Vec<Seq> = (0..3).map(|i| seq(&m, 3 + i)).collect();
    let chunks: Vec<StepChunk> = prompts
        .iter()
        .zip(&tokens)
        .zip(&seqs)
        .map(|((p, toks), s)| s.chunk(toks, 0, p.len(), OutRows::Last))
        .collect();
    let vocab = m.cfg.vocab_size;
    let mut together: Vec<Vec<f32>> = logits(&m, &chunks)
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    for step in 0..3 {
        let chunks: Vec<StepChunk> = prompts
            .iter()
            .zip(&tokens)
            .zip(&seqs)
            .map(|((p, toks), s)| s.chunk(toks, p.len() + step, 1, OutRows::Last))
            .collect();
        let out = logits(&m, &chunks);
        for (i, row) in out.chunks(vocab).enumerate() {
            together[i].extend_from_slice(row);
        }
    }
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        let d = max_diff(a, b);
        assert!(d < 1e-4, "sequence {i}: batched logits differ by {d}");
    }
}
