//! Log-probabilities under the model's raw distribution: `log_softmax` of the logits of the real
//! vocabulary, before penalties, bias, masks and temperature (what vLLM reports by default).
//!
//! Used for prompt tokens (prompt logprobs / echo); the sampled token's come with the draw.

use sanmai_model::sample::{log_sum_exp, top_n};

use super::SampleError;

/// A row of logits with its log-normaliser, for reading log-probabilities of any token.
#[derive(Debug, Clone, Copy)]
pub struct RowLogprobs<'a> {
    row: &'a [f32],
    log_z: f32,
}

impl<'a> RowLogprobs<'a> {
    /// Normalises over the first `valid_vocab` logits (the ids past it are lm_head padding).
    pub fn new(logits: &'a [f32], valid_vocab: usize) -> Result<Self, SampleError> {
        let row = super::valid_row(logits, valid_vocab)?;
        let log_z = log_sum_exp(row).ok_or(SampleError::NoCandidates)?;
        Ok(Self { row, log_z })
    }

    /// `ln Σ e^logit` over the real vocabulary.
    pub fn log_normalizer(&self) -> f32 {
        self.log_z
    }

    /// The log-probability of `token`.
    pub fn logprob(&self, token: u32) -> Result<f32, SampleError> {
        let x = self
            .row
            .get(token as usize)
            .ok_or(SampleError::TokenOutOfRange {
                token,
                valid_vocab: self.row.len(),
            })?;
        Ok(x - self.log_z)
    }

    /// The `n` most likely tokens with their log-probabilities, most likely first (lower id on ties).
    pub fn top(&self, n: usize) -> Vec<(u32, f32)> {
        let mut out = Vec::with_capacity(n + 1);
        top_n(self.row, None, n, &mut out);
        for e in &mut out {
            e.1 -= self.log_z;
        }
        out
    }
}

/// The raw log-probability of `token` given one row of logits (prompt logprobs / echo).
pub fn token_logprob(logits: &[f32], valid_vocab: usize, token: u32) -> Result<f32, SampleError> {
    RowLogprobs::new(logits, valid_vocab)?.logprob(token)
}
