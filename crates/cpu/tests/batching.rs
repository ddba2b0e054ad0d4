//! Batching invariants of the forward pass on the built-in model's shapes: sequences stepped together give
//! what they give alone, a prompt cut into chunks gives what one pass gives, and a state restored from a
//! copy (a prefix-cache checkpoint) continues exactly like the original.

use sanmai_cpu::CpuBackend;
use sanmai_model::{builtin, Backend, Model, SeqChunk};
use sanmai_weights::Dummy;

const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: u32 = 32;

fn model() -> Model<CpuBackend> {
    let m = Model::load(
        builtin::config(),
        &Dummy::new(builtin::SEED),
        CpuBackend::new(),
    )
    .unwrap();
    m.init_cache(BLOCKS_PER_SEQ as usize * 16, BLOCK);
    m
}

struct Seq {
    state: usize,
    blocks: Vec<u32>,
}

/// Sequence `i`: a fresh state slot and blocks `i·32 .. (i+1)·32` (shuffled, to exercise the block table).
fn seq(m: &Model<CpuBackend>, i: u32) -> Seq {
    let mut blocks: Vec<u32> = (i * BLOCKS_PER_SEQ..(i + 1) * BLOCKS_PER_SEQ).collect();
    blocks.reverse();
    blocks.swap(0, 5);
    Seq {
        state: m.backend.alloc_state(),
        blocks,
    }
}

fn chunk(s: &Seq, start: usize, len: usize, pos0: usize) -> SeqChunk<'_> {
    SeqChunk {
        start,
        len,
        pos0,
        state: s.state,
        blocks: &s.blocks,
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % 248_000)
        .collect()
}

fn logits(m: &Model<CpuBackend>, ids: &[u32], seqs: &[SeqChunk<'_>], rows: &[usize]) -> Vec<f32> {
    let out = m.forward(ids, seqs, rows);
    m.backend.to_host(m.logits(&out.hidden)).2
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn all(n: usize) -> Vec<usize> {
    (0..n).collect()
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let m = model();
    let p = prompt(1, 200);
    let one = seq(&m, 0);
    let whole = logits(&m, &p, &[chunk(&one, 0, 200, 0)], &all(200));
    let two = seq(&m, 1);
    let mut pieces = Vec::new();
    let mut pos = 0;
    for len in [1, 63, 64, 72] {
        pieces.extend(logits(
            &m,
            &p[pos..pos + len],
            &[chunk(&two, 0, len, pos)],
            &all(len),
        ));
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
    logits(&m, &p[..100], &[chunk(&a, 0, 100, 0)], &[]);
    let checkpoint = m.backend.alloc_state();
    m.backend.copy_state(a.state, checkpoint);
    let want = logits(&m, &p[100..], &[chunk(&a, 0, 20, 100)], &all(20));
    // The copy: shares the 6 full blocks, copies the partial one, restores the state, then continues.
    let mut b = seq(&m, 1);
    b.blocks[..6].copy_from_slice(&a.blocks[..6]);
    m.backend.copy_block(a.blocks[6], b.blocks[6]);
    m.backend.copy_state(checkpoint, b.state);
    let got = logits(&m, &p[100..], &[chunk(&b, 0, 20, 100)], &all(20));
    assert_eq!(
        want, got,
        "a restored sequence must compute exactly what the original computed"
    );
}

#[test]
fn batched_steps_equal_single_sequence_steps() {
    let m = model();
    let prompts = [prompt(2, 5), prompt(3, 70), prompt(4, 1)];
    // Alone: each prompt, then 3 decode steps of fixed tokens.
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let s = seq(&m, i as u32);
        let n = p.len();
        let mut rows = logits(&m, p, &[chunk(&s, 0, n, 0)], &[n - 1]);
        for step in 0..3 {
            rows.extend(logits(
                &m,
                &[7 + step as u32],
                &[chunk(&s, 0, 1, n + step)],
                &[0],
            ));
        }
        alone.push(rows);
    }
    // Together: one mixed prefill step, then batched decode steps.
    let seqs: Vec<Seq> = (0..3).map(|i| seq(&m, 3 + i)).collect();
    let mut ids = Vec::new();
    let mut chunks = Vec::new();
    let mut last_rows = Vec::new();
    for (p, s) in prompts.iter().zip(&seqs) {
        chunks.push(chunk(s, ids.len(), p.len(), 0));
        ids.extend(p);
        last_rows.push(ids.len() - 1);
    }
    let vocab = m.cfg.vocab_size;
    let mut together: Vec<Vec<f32>> = logits(&m, &ids, &chunks, &last_rows)
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    for step in 0..3 {
        let chunks: Vec<SeqChunk> = prompts
            .iter()
            .zip(&seqs)
            .enumerate()
            .map(|(i, (p, s))| chunk(s, i, 1, p.len() + step))
            .collect();
        let out = logits(&m, &[7 + step as u32; 3], &chunks, &[0, 1, 2]);
        for (i, row) in out.chunks(vocab).enumerate() {
            together[i].extend_from_slice(row);
        }
    }
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        let d = max_diff(a, b);
        assert!(d < 1e-4, "sequence {i}: batched logits differ by {d}");
    }
}
