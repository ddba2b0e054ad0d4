//! Batching invariants of the forward pass on the built-in model's shapes: sequences stepped together give
//! what they give alone, and a prompt cut into chunks gives what one pass gives.

use sanmai_cpu::CpuBackend;
use sanmai_model::{builtin, Backend, Model, SeqChunk};
use sanmai_weights::Dummy;

fn model() -> Model<CpuBackend> {
    Model::load(
        builtin::config(),
        &Dummy::new(builtin::SEED),
        CpuBackend::new(),
    )
    .unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % 248_000)
        .collect()
}

fn logits(m: &Model<CpuBackend>, ids: &[u32], seqs: &[SeqChunk], rows: &[usize]) -> Vec<f32> {
    let out = m.forward(ids, seqs, rows);
    m.backend.to_host(&m.logits(&out.hidden)).2
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
    let one = m.backend.alloc_seq();
    let whole = logits(
        &m,
        &p,
        &[SeqChunk {
            slot: one,
            start: 0,
            len: 200,
            pos0: 0,
        }],
        &(0..200).collect::<Vec<_>>(),
    );
    let two = m.backend.alloc_seq();
    let mut pieces = Vec::new();
    let mut pos = 0;
    for len in [1, 63, 64, 72] {
        let seq = SeqChunk {
            slot: two,
            start: 0,
            len,
            pos0: pos,
        };
        pieces.extend(logits(
            &m,
            &p[pos..pos + len],
            &[seq],
            &(0..len).collect::<Vec<_>>(),
        ));
        pos += len;
    }
    let d = max_diff(&whole, &pieces);
    assert!(d < 1e-4, "chunked prefill differs by {d}");
}

#[test]
fn batched_steps_equal_single_sequence_steps() {
    let m = model();
    let prompts = [prompt(2, 5), prompt(3, 70), prompt(4, 1)];
    // Alone: each prompt, then 3 decode steps of fixed tokens.
    let mut alone = Vec::new();
    for p in &prompts {
        let slot = m.backend.alloc_seq();
        let n = p.len();
        let mut rows = logits(
            &m,
            p,
            &[SeqChunk {
                slot,
                start: 0,
                len: n,
                pos0: 0,
            }],
            &[n - 1],
        );
        for step in 0..3 {
            let seq = SeqChunk {
                slot,
                start: 0,
                len: 1,
                pos0: n + step,
            };
            rows.extend(logits(&m, &[7 + step as u32], &[seq], &[0]));
        }
        alone.push(rows);
    }
    // Together: one mixed prefill step, then batched decode steps.
    let slots: Vec<usize> = prompts.iter().map(|_| m.backend.alloc_seq()).collect();
    let mut ids = Vec::new();
    let mut seqs = Vec::new();
    let mut last_rows = Vec::new();
    for (p, &slot) in prompts.iter().zip(&slots) {
        seqs.push(SeqChunk {
            slot,
            start: ids.len(),
            len: p.len(),
            pos0: 0,
        });
        ids.extend(p);
        last_rows.push(ids.len() - 1);
    }
    let vocab = m.cfg.vocab_size;
    let mut together: Vec<Vec<f32>> = logits(&m, &ids, &seqs, &last_rows)
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    for step in 0..3 {
        let seqs: Vec<SeqChunk> = prompts
            .iter()
            .zip(&slots)
            .enumerate()
            .map(|(i, (p, &slot))| SeqChunk {
                slot,
                start: i,
                len: 1,
                pos0: p.len() + step,
            })
            .collect();
        let out = logits(&m, &[7 + step as u32; 3], &seqs, &[0, 1, 2]);
        for (i, row) in out.chunks(vocab).enumerate() {
            together[i].extend_from_slice(row);
        }
    }
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        let d = max_diff(a, b);
        assert!(d < 1e-4, "sequence {i}: batched logits differ by {d}");
    }
}
