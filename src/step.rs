//! One forward pass outside the engine (the benchmark, the memory plan's profiling step), with the
//! PLE rows a PLE model needs gathered from the chunks' token histories.

use anyhow::{Context, Result};
use sanmai_model::{Backend, Model, SeqChunk, StepOutput};

/// Runs `ids` through the model; `tokens[i]` holds chunk `i`'s sequence from position 0 (at least
/// `pos0 + len` tokens).
pub fn forward<B: Backend>(
    m: &Model<B>,
    ids: &[u32],
    seqs: &[SeqChunk<'_>],
    out_rows: &[usize],
    tokens: &[&[u32]],
) -> Result<StepOutput<B::Tensor>> {
    let ple = m.ple_rows(tokens, seqs).context("gathering PLE rows")?;
    Ok(m.forward_with(ids, seqs, out_rows, ple.as_ref()))
}

/// [`forward`] followed by the logits of `out_rows`, as one region (a decode step on a GPU replays
/// one graph from the embedding to the logits).
pub fn forward_logits<B: Backend>(
    m: &Model<B>,
    ids: &[u32],
    seqs: &[SeqChunk<'_>],
    out_rows: &[usize],
    tokens: &[&[u32]],
) -> Result<B::Tensor> {
    let ple = m.ple_rows(tokens, seqs).context("gathering PLE rows")?;
    Ok(m.forward_logits_with(ids, seqs, out_rows, ple.as_ref()).1)
}
