//! Token sampling on the CPU: one row of f32 logits per sequence in, one token id plus log-probabilities out.
//!
//! One step runs these stages in order, each a function of its own so a device implementation can mirror
//! them one for one:
//!
//! 1. **padding** — only ids below `valid_vocab` are tokens; the lm_head padding past it is never read
//!    (equivalent to masking it to `-inf` before anything else).
//! 2. **mask** — the allowed-token bitmask of a grammar, if any ([`penalties::apply_allowed_mask`]):
//!    structured output reports and samples the constrained distribution.
//! 3. **raw logprobs** — log-normaliser and top-N of the logits so far ([`logprobs`]): what the
//!    response reports, independent of everything below.
//! 4. **penalties** — repetition, frequency, presence ([`penalties::apply_penalties`]).
//! 5. **bias** — `logit_bias` ([`penalties::apply_logit_bias`]).
//! 6. **temperature** — weights `e^((z - max) / T)`; greedy (`T = 0`) takes the argmax instead.
//! 7. **top-k → top-p → min-p** — truncation of the weights (see the `filter` module for exact rules).
//! 8. **draw** — one uniform from the request's own [`Rng`], none for greedy.
//!
//! Cost: two vectorised passes over the row (block maxima, block sums of exponentials) serve the raw
//! logprobs, greedy, top-k and min-p; plain sampling and top-p at `T != 1` add a third. Everything
//! else touches only the blocks that can hold the answer. The row is used as working space: on return
//! its contents are unspecified. Buffers live in [`Scratch`] and are reused, so a warm step allocates
//! nothing row-sized.

mod batch;
mod filter;
pub mod logprobs;
mod math;
mod params;
pub mod penalties;
mod rng;

use thiserror::Error;

pub use batch::{SampleRequest, Sampler};
pub use logprobs::{token_logprob, RowLogprobs};
pub use params::{ParamError, SamplingParams, GREEDY_TEMPERATURE, MAX_LOGPROBS};
pub use penalties::TokenCounts;
pub use rng::{Rng, SplitMix64};

use filter::{Candidate, Scaled, Truncation};
use penalties::{apply_allowed_mask, apply_logit_bias, apply_penalties, original_value};

/// Why a row could not be sampled.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SampleError {
    #[error(transparent)]
    Params(#[from] ParamError),
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
}

/// Reusable buffers of one sampling thread. Their size follows the number of blocks and of surviving
/// candidates, so once warm a step allocates nothing row-sized.
#[derive(Debug, Clone, Default)]
pub struct Scratch {
    maxima: Vec<f32>,
    sums: Vec<f32>,
    tmp: Vec<f32>,
    cands: Vec<Candidate>,
    edits: Vec<(u32, f32)>,
    levels: math::LevelMass,
}

impl Scratch {
    /// Empty scratch.
    pub fn new() -> Self {
        Self::default()
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

/// Samples one token from one row of logits (`logits.len()` is the lm_head width, of which the first
/// `valid_vocab` are real tokens). `allowed` is an optional allowed-token bitmask (see
/// [`penalties::apply_allowed_mask`]). The row is clobbered; `state`'s counts are not updated (call
/// [`SamplerState::accept`] once the token is accepted).
pub fn sample_row(
    logits: &mut [f32],
    valid_vocab: usize,
    params: &SamplingParams,
    state: &mut SamplerState,
    allowed: Option<&[u32]>,
    scratch: &mut Scratch,
) -> Result<Sampled, SampleError> {
    params.validate(valid_vocab)?;
    check_vocab(logits.len(), valid_vocab)?;
    // 1. Padding: everything below works on the real vocabulary only.
    let row = &mut logits[..valid_vocab];
    // 2. The grammar's mask: tokens it forbids do not exist for anything below.
    if let Some(mask) = allowed {
        apply_allowed_mask(row, mask);
    }

    // 3. The raw distribution, before any edit.
    let raw_max = math::block_maxima(row, &mut scratch.maxima);
    if raw_max == f32::INFINITY {
        return Err(SampleError::InfiniteLogit);
    }
    if raw_max == f32::NEG_INFINITY {
        return Err(SampleError::NoCandidates);
    }
    let greedy = params.is_greedy();
    let t = Truncation {
        top_k: params.top_k_limit().filter(|&k| k < valid_vocab),
        top_p: params.top_p,
        min_p: params.min_p,
    };
    let scale = 1.0 / params.temperature;
    let want_levels = !greedy && t.uses_levels();
    // At temperature 1 the raw weights are the sampling weights (unless edits change them below).
    let raw_levels = (want_levels && scale == 1.0).then_some(&mut scratch.levels);
    let raw_total = math::block_exp_sums(row, raw_max, 1.0, &mut scratch.sums, raw_levels);
    let log_z = raw_max + raw_total.ln() as f32;
    let mut top_logprobs = match params.logprobs {
        Some(n) if n > 0 => logprobs::top_logprobs(row, Some(&scratch.maxima), n, log_z),
        _ => Vec::new(),
    };
    // Tokens a grammar forbids are no alternatives.
    if allowed.is_some() {
        top_logprobs.retain(|t| t.1 > f32::NEG_INFINITY);
    }

    // 4–5. Penalties and bias; the block maxima follow the edits.
    scratch.edits.clear();
    apply_penalties(row, &state.counts, params, &mut scratch.edits);
    apply_logit_bias(row, &params.logit_bias, &mut scratch.edits);
    let edited = !scratch.edits.is_empty();
    if edited {
        math::refresh_maxima(row, &mut scratch.maxima, scratch.edits.iter().map(|e| e.0));
    }
    let m = if edited {
        math::max(&scratch.maxima)
    } else {
        raw_max
    };
    if m == f32::NEG_INFINITY {
        return Err(SampleError::NoCandidates);
    }

    // 6–8. Temperature, truncation, draw (or the argmax).
    let id = if greedy || m == f32::INFINITY {
        math::position_of_max(row, &scratch.maxima, m).map(|i| i as u32)
    } else {
        let s = Scaled {
            row,
            maxima: &scratch.maxima,
            m,
            scale,
        };
        // The raw pass's block sums are the sampling weights when nothing changed them.
        let mut total = raw_total;
        if t.needs_total() && (edited || scale != 1.0) {
            let levels = want_levels.then_some(&mut scratch.levels);
            total = math::block_exp_sums(row, m, scale, &mut scratch.sums, levels);
        }
        let levels = want_levels.then_some(&scratch.levels);
        if filter::select(&s, &t, total, levels, &mut scratch.tmp, &mut scratch.cands) {
            filter::draw_from(&scratch.cands, &mut state.rng)
        } else {
            filter::draw_from_row(&s, &scratch.sums, total, &mut state.rng)
        }
    }
    .ok_or(SampleError::NoCandidates)?;

    let raw = original_value(row[id as usize], id, &scratch.edits);
    Ok(Sampled {
        id,
        logprob: raw - log_z,
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
