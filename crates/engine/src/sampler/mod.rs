//! Token sampling on the CPU: one row of f32 logits per sequence in, one token id plus log-probabilities out.
//!
//! One step runs these stages in order, each a function of its own so a device implementation can mirror
//! them one for one:
//!
//! 1. **padding** — only ids below `valid_vocab` are tokens; the lm_head padding past it is never read
//!    (equivalent to masking it to `-inf` first).
//! 2. **raw logprobs** — log-normaliser and top-N of the untouched logits ([`logprobs`]).
//! 3. **penalties** — repetition, frequency, presence ([`penalties::apply_penalties`]).
//! 4. **bias** — `logit_bias` ([`penalties::apply_logit_bias`]).
//! 5. **mask** — the allowed-token bitmask of a grammar, if any ([`penalties::apply_allowed_mask`]).
//! 6. **temperature** — softmax weights `e^((z - max) / T)`; greedy (`T = 0`) takes the argmax instead.
//! 7. **top-k → top-p → min-p** — truncation of the weights.
//! 8. **draw** — one uniform from the request's own [`Rng`].
//!
//! The row is used as working space: on return its contents are unspecified. Scratch buffers live in
//! [`Scratch`] and are reused across steps, so a step allocates nothing row-sized.

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

use filter::{Candidate, Histogram, Truncation};
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

/// Reusable buffers of one sampling thread; they grow to the row width once and stay.
#[derive(Debug, Clone, Default)]
pub struct Scratch {
    weights: Vec<f32>,
    chunk_sums: Vec<f64>,
    cands: Vec<Candidate>,
    edits: Vec<(u32, f32)>,
    hist: Histogram,
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

    // 2. The raw distribution, before any edit.
    let raw_max = math::max(row);
    if raw_max == f32::INFINITY {
        return Err(SampleError::InfiniteLogit);
    }
    if raw_max == f32::NEG_INFINITY {
        return Err(SampleError::NoCandidates);
    }
    let log_z = raw_max + math::sum_exp(row, raw_max).ln() as f32;
    let top_logprobs = match params.logprobs {
        Some(n) if n > 0 => RowLogprobs::with_log_z(row, log_z).top(n),
        _ => Vec::new(),
    };

    // 3–5. Penalties, bias, mask.
    scratch.edits.clear();
    let mut edited = apply_penalties(row, &state.counts, params, &mut scratch.edits);
    edited |= apply_logit_bias(row, &params.logit_bias, &mut scratch.edits);
    if let Some(mask) = allowed {
        apply_allowed_mask(row, mask);
        edited = true;
    }
    let m = if edited { math::max(row) } else { raw_max };
    if m == f32::NEG_INFINITY {
        return Err(SampleError::NoCandidates);
    }

    // 6–8. Temperature, truncation, draw (or the argmax).
    let id = if params.is_greedy() || m == f32::INFINITY {
        math::position_of(row, m).map(|i| i as u32)
    } else {
        draw(row, m, params, &mut state.rng, scratch)
    }
    .ok_or(SampleError::NoCandidates)?;

    let raw = original_value(row[id as usize], id, &scratch.edits);
    Ok(Sampled {
        id,
        logprob: raw - log_z,
        top_logprobs,
    })
}

/// Temperature, top-k, top-p, min-p and the draw over an edited row whose maximum is `m`.
fn draw(
    row: &[f32],
    m: f32,
    params: &SamplingParams,
    rng: &mut Rng,
    scratch: &mut Scratch,
) -> Option<u32> {
    if scratch.weights.len() < row.len() {
        scratch.weights.resize(row.len(), 0.0);
    }
    let weights = &mut scratch.weights[..row.len()];
    let total = math::exp_weights(
        row,
        m,
        1.0 / params.temperature,
        weights,
        &mut scratch.chunk_sums,
    );
    let t = Truncation {
        top_k: params.top_k_limit(),
        top_p: params.top_p,
        min_p: params.min_p,
    };
    if filter::truncate(weights, total, &t, &mut scratch.hist, &mut scratch.cands) {
        filter::draw_from(&scratch.cands, rng)
    } else {
        filter::draw_from_row(weights, &scratch.chunk_sums, total, rng)
    }
}
