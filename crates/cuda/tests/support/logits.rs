//! A model's logits and log-probabilities over a prompt's steps, shared by the end-to-end tests.

use sanmai_model::{Backend, Model, OutRows, StepChunk, StepInput, StepStart};

/// `row`'s log-softmax, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// The logits `(rows, vocab, values)` of one step of one sequence (state slot `state`, K/V blocks
/// `blocks`): `prompt[pos..pos + len]` after `prompt[..pos]`, every row out.
pub fn step_logits<B: Backend>(
    m: &Model<B>,
    prompt: &[u32],
    (pos, len): (usize, usize),
    state: usize,
    blocks: &[u32],
) -> (usize, usize, Vec<f32>) {
    let chunk = [StepChunk {
        tokens: &prompt[pos..pos + len],
        history: &prompt[..pos],
        pos0: pos,
        state,
        blocks,
        out: OutRows::All,
    }];
    let out = m
        .step(StepInput {
            chunks: &chunk,
            start: StepStart::Tokens,
            hidden: false,
        })
        .unwrap();
    m.backend.to_host(out.logits.unwrap()).unwrap()
}
