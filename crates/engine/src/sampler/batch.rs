//! The batch entry point: one row of logits per sequence, sampled in parallel with per-sequence params.

use std::sync::Mutex;

use rayon::prelude::*;

use super::{sample_row, SampleError, Sampled, SamplerState, SamplingParams, Scratch};

/// One sequence's share of a batch step.
#[derive(Debug)]
pub struct SampleRequest<'a> {
    pub params: &'a SamplingParams,
    pub state: &'a mut SamplerState,
    /// Allowed-token bitmask from a grammar, if the sequence has one.
    pub allowed: Option<&'a [u32]>,
}

/// Samples rows for a model whose first `valid_vocab` lm_head outputs are real tokens.
///
/// Holds a pool of [`Scratch`] buffers, one per thread that has sampled, so steady-state steps allocate
/// nothing row-sized.
#[derive(Debug)]
pub struct Sampler {
    valid_vocab: usize,
    pool: Mutex<Vec<Scratch>>,
}

impl Sampler {
    /// A sampler for a vocabulary of `valid_vocab` real tokens.
    pub fn new(valid_vocab: usize) -> Self {
        Self {
            valid_vocab,
            pool: Mutex::new(Vec::new()),
        }
    }

    /// The number of real tokens.
    pub fn valid_vocab(&self) -> usize {
        self.valid_vocab
    }

    fn take_scratch(&self) -> Scratch {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.pop().unwrap_or_default()
    }

    fn return_scratch(&self, scratch: Scratch) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(scratch);
    }

    /// Samples one row (see [`sample_row`]).
    pub fn sample(
        &self,
        logits: &mut [f32],
        req: &mut SampleRequest<'_>,
    ) -> Result<Sampled, SampleError> {
        let mut scratch = self.take_scratch();
        let out = sample_row(
            logits,
            self.valid_vocab,
            req.params,
            req.state,
            req.allowed,
            &mut scratch,
        );
        self.return_scratch(scratch);
        out
    }

    /// Samples `reqs.len()` rows of `row_width` logits each, laid out back to back in `logits`, across
    /// threads. Each sequence's result is independent of the others and of the thread it ran on.
    pub fn sample_batch(
        &self,
        logits: &mut [f32],
        row_width: usize,
        reqs: &mut [SampleRequest<'_>],
    ) -> Result<Vec<Result<Sampled, SampleError>>, SampleError> {
        let shape = SampleError::BatchShape {
            rows: reqs.len(),
            row_width,
            len: logits.len(),
        };
        if row_width.checked_mul(reqs.len()) != Some(logits.len())
            || (row_width == 0 && !reqs.is_empty())
        {
            return Err(shape);
        }
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        if reqs.len() == 1 {
            return Ok(vec![self.sample(logits, &mut reqs[0])]);
        }
        Ok(logits
            .par_chunks_mut(row_width)
            .zip(reqs.par_iter_mut())
            .map(|(row, req)| self.sample(row, req))
            .collect())
    }
}
