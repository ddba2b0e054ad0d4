//! Token sampling: one row of f32 logits per sequence in, one token id plus log-probabilities out.
//!
//! The math (mask, raw logprobs, penalties and bias, temperature, top-k → top-p → min-p, the draw) lives
//! in [`sanmai_model::sample`], shared with the backends' sampling op so that host and device pick the
//! same tokens, and so does the parameter type ([`SamplingParams`], re-exported here; a request carries
//! it as [`ValidatedParams`], checked once when it is built, so the sampler never checks it again).
//! This module holds what a request owns around it: the random stream ([`Rng`], one uniform per draw),
//! the token counts penalties read ([`TokenCounts`]), the batch entry point ([`Sampler`]), prompt
//! log-probabilities ([`RowLogprobs`]) and the verification of draft tokens ([`speculative`]).

mod batch;
pub mod logprobs;
pub mod penalties;
mod rng;
pub mod speculative;

use std::collections::VecDeque;

use thiserror::Error;

use sanmai_model::sample::{RowError, RowSampling};

pub use batch::{SampleRequest, Sampler};
pub use logprobs::{token_logprob, RowLogprobs};
pub use penalties::TokenCounts;
pub use rng::{Rng, SplitMix64};
pub use sanmai_model::sample::{
    ParamError, SamplingParams, Scratch, ValidatedParams, GREEDY_TEMPERATURE, MAX_LOGPROBS,
};

/// Why a row could not be sampled.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SampleError {
    #[error("valid vocabulary of {valid_vocab} ids does not fit a logits row of {row_len}")]
    Vocab { valid_vocab: usize, row_len: usize },
    #[error("token id {token} is outside the vocabulary of {valid_vocab} tokens")]
    TokenOutOfRange { token: u32, valid_vocab: usize },
    #[error("no token can be sampled: every logit is -inf, NaN or masked out")]
    NoCandidates,
    #[error("the logits contain +inf")]
    InfiniteLogit,
    #[error("a batch of {rows} rows of width {row_width} needs {} logits, got {len}", rows * row_width)]
    BatchShape {
        rows: usize,
        row_width: usize,
        len: usize,
    },
}

impl From<RowError> for SampleError {
    fn from(e: RowError) -> Self {
        match e {
            RowError::Vocab {
                valid_vocab,
                row_len,
            } => Self::Vocab {
                valid_vocab,
                row_len,
            },
            RowError::NoCandidates => Self::NoCandidates,
            RowError::InfiniteLogit => Self::InfiniteLogit,
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The chosen token.
    pub id: u32,
    /// Its log-probability under the model's raw distribution (always filled).
    pub logprob: f32,
    /// The `logprobs` most likely tokens under that distribution, most likely first (lower id on ties);
    /// empty unless the request asked for them.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The sampling state a sequence owns: its random stream and the token counts its penalties need.
#[derive(Debug, Clone)]
pub struct SamplerState {
    rng: Rng,
    counts: TokenCounts,
    track: bool,
    /// Uniforms drawn ahead for the next draws (a step that samples on the device, a verify step's
    /// rows), used in order by whichever path draws them.
    reserved: VecDeque<f64>,
}

impl SamplerState {
    /// State for a request with `params` and `prompt`. Counts are kept only when a penalty is active.
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Self {
        let track = params.uses_penalties();
        Self {
            rng: Rng::for_request(params.seed),
            counts: if track {
                TokenCounts::from_prompt(prompt)
            } else {
                TokenCounts::new()
            },
            track,
            reserved: VecDeque::new(),
        }
    }

    /// Records a token the sequence accepted (call once per token appended to the output).
    pub fn accept(&mut self, token: u32) {
        if self.track {
            self.counts.add_output_token(token);
        }
    }

    /// The counts the penalties read.
    pub fn counts(&self) -> &TokenCounts {
        &self.counts
    }

    /// The random stream.
    pub fn rng_mut(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// The uniform of the next draw, drawn now and kept until that draw happens (the same value
    /// however often this is called before it).
    pub fn reserve_uniform(&mut self) -> f64 {
        self.reserve_uniform_at(0)
    }

    /// The uniform of the draw `i` draws from now (0: the next), drawn now and kept until that draw
    /// happens: a verify step reserves one per row, and the rows it does not draw leave theirs to
    /// the draws that follow, so the stream is the one a step without drafts would read.
    pub fn reserve_uniform_at(&mut self, i: usize) -> f64 {
        while self.reserved.len() <= i {
            let u = self.rng.next_f64();
            self.reserved.push_back(u);
        }
        self.reserved[i]
    }

    /// Forgets the next reserved uniform: the draw it was for happened elsewhere (on the device).
    pub fn discard_reserved(&mut self) {
        self.reserved.pop_front();
    }

    /// The uniform of the draw happening now: the next reserved one, else the next of the stream.
    pub fn take_uniform(&mut self) -> f64 {
        self.reserved
            .pop_front()
            .unwrap_or_else(|| self.rng.next_f64())
    }
}

/// The real-vocabulary prefix of a logits row.
pub(crate) fn valid_row(logits: &[f32], valid_vocab: usize) -> Result<&[f32], SampleError> {
    check_vocab(logits.len(), valid_vocab)?;
    Ok(&logits[..valid_vocab])
}

fn check_vocab(row_len: usize, valid_vocab: usize) -> Result<(), SampleError> {
    if valid_vocab == 0 || valid_vocab > row_len || valid_vocab > u32::MAX as usize {
        return Err(SampleError::Vocab {
            valid_vocab,
            row_len,
        });
    }
    Ok(())
}

/// The sampling math's description of one row: `params` over `counts`, the mask `allowed`, and the
/// draw's `uniform`.
pub fn row_sampling<'a>(
    params: &'a SamplingParams,
    counts: &'a TokenCounts,
    allowed: Option<&'a [u32]>,
    uniform: f64,
) -> RowSampling<'a> {
    RowSampling {
        params,
        seen: counts.seen(),
        allowed,
        uniform,
    }
}

/// Samples one token from one row of logits (`logits.len()` is the lm_head width, of which the first
/// `valid_vocab` are real tokens). `allowed` is an optional allowed-token bitmask (see
/// [`penalties::apply_allowed_mask`]). `params` are a request's, validated when it was built (see
/// [`ValidatedParams`]); they are not checked here. The row is clobbered; `state`'s counts are not
/// updated (call [`SamplerState::accept`] once the token is accepted). A drawing request takes one
/// uniform from its stream (or the one [`SamplerState::reserve_uniform`] set aside); greedy takes none.
pub fn sample_row(
    logits: &mut [f32],
    valid_vocab: usize,
    params: &SamplingParams,
    state: &mut SamplerState,
    allowed: Option<&[u32]>,
    scratch: &mut Scratch,
) -> Result<Sampled, SampleError> {
    check_vocab(logits.len(), valid_vocab)?;
    let uniform = if params.is_greedy() {
        0.0
    } else {
        state.take_uniform()
    };
    let spec = row_sampling(params, &state.counts, allowed, uniform);
    let (s, top_logprobs) = sanmai_model::sample::sample_row(
        &mut logits[..valid_vocab],
        &spec,
        params.logprobs.unwrap_or(0),
        scratch,
    )?;
    Ok(Sampled {
        id: s.id,
        logprob: s.logprob,
        top_logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_makes_the_reported_distribution_the_constrained_one() {
        let mut logits = vec![0.0f32; 64];
        let mask = [0b11u32, 0];
        let params = SamplingParams {
            logprobs: Some(3),
            ..SamplingParams::default()
        };
        let mut state = SamplerState::new(&params, &[]);
        let s = sample_row(
            &mut logits,
            64,
            &params,
            &mut state,
            Some(&mask),
            &mut Scratch::new(),
        )
        .unwrap();
        assert!(s.id < 2);
        assert!((s.logprob - 0.5f32.ln()).abs() < 1e-5, "{}", s.logprob);
        // Only the two allowed tokens are alternatives.
        assert_eq!(s.top_logprobs.len(), 2);
        assert!((s.top_logprobs[0].1 - 0.5f32.ln()).abs() < 1e-5);
    }
}
