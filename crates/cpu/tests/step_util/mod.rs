//! Shared by the tests that run the model on the CPU backend: a sequence's caches, the step chunks
//! of its tokens, one step's outputs on the host, and the MTP head's draft over a prompt.
#![allow(dead_code)] // each test binary uses its own subset

use sanmai_cpu::{CpuBackend, CpuTensor};
use sanmai_model::{Backend, Model, OutRows, StepChunk, StepInput, StepOutput, StepStart};

/// Blocks [`new_seq`] gives each sequence (sequence `i` of a model gets blocks `i·64 ..`).
pub const BLOCKS_PER_SEQ: usize = 64;

/// A sequence's caches: a state slot and its block table.
pub struct Seq {
    pub state: usize,
    pub blocks: Vec<u32>,
}

impl Seq {
    /// A fresh state slot with the block table `blocks`.
    pub fn new(m: &Model<CpuBackend>, blocks: Vec<u32>) -> Self {
        Seq {
            state: m.backend.alloc_state().unwrap(),
            blocks,
        }
    }

    /// The chunk of the tokens at positions `pos0 .. pos0 + len` of `tokens` (the sequence from
    /// position 0: what comes before `pos0` is the chunk's history), returning the rows `out`.
    pub fn chunk<'a>(
        &'a self,
        tokens: &'a [u32],
        pos0: usize,
        len: usize,
        out: OutRows,
    ) -> StepChunk<'a> {
        StepChunk {
            tokens: &tokens[pos0..pos0 + len],
            history: &tokens[..pos0],
            pos0,
            state: self.state,
            blocks: &self.blocks,
            out,
        }
    }
}

/// Sequence `i`'s caches: a fresh state slot and the contiguous blocks `i·64 .. (i+1)·64`.
pub fn new_seq(m: &Model<CpuBackend>, i: usize) -> Seq {
    let first = (i * BLOCKS_PER_SEQ) as u32;
    Seq::new(m, (first..first + BLOCKS_PER_SEQ as u32).collect())
}

/// One step of `chunks` from their tokens (the first stage), with the hidden states when `hidden`.
pub fn step(
    m: &Model<CpuBackend>,
    chunks: &[StepChunk<'_>],
    hidden: bool,
) -> StepOutput<CpuTensor> {
    m.step(StepInput {
        chunks,
        start: StepStart::Tokens,
        hidden,
    })
    .unwrap()
}

/// The logits of one step from tokens, `[rows, vocab]` row-major on the host (empty when no chunk
/// asks for rows).
pub fn logits(m: &Model<CpuBackend>, chunks: &[StepChunk<'_>]) -> Vec<f32> {
    step(m, chunks, false)
        .logits
        .map_or_else(Vec::new, |l| host(m, l).2)
}

/// A tensor on the host: `(rows, cols, values)`.
pub fn host(m: &Model<CpuBackend>, t: CpuTensor) -> (usize, usize, Vec<f32>) {
    m.backend.to_host(t).unwrap()
}

/// The MTP head's draft logits at every position `0..n − 1` of `prompt` (`n` tokens): the main
/// model's final-normed hidden states of those positions, then the head with the next tokens.
pub fn draft_logits(m: &Model<CpuBackend>, seq: &Seq, prompt: &[u32]) -> (usize, usize, Vec<f32>) {
    let n = prompt.len();
    let main = step(m, &[seq.chunk(prompt, 0, n, OutRows::All)], true);
    let rows: Vec<usize> = (0..n - 1).collect();
    let h = m.backend.rows(&main.hidden.unwrap(), &rows).unwrap();
    let next = &prompt[1..];
    let draft = m
        .step(StepInput {
            chunks: &[seq.chunk(next, 0, n - 1, OutRows::All)],
            start: StepStart::Draft(h),
            hidden: false,
        })
        .expect("fixture has an MTP head");
    host(m, draft.logits.unwrap())
}
