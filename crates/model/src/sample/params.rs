//! Per-request sampling parameters, their validation, and [`ValidatedParams`], the only form a request
//! carries into the engine.
//!
//! The field meanings follow the OpenAI / vLLM request fields of the same names. [`SamplingParams::validate`]
//! reports the first out-of-range field as a typed error so the server can answer with a 400 naming the
//! parameter; [`SamplingParams::validated`] is the one way to a [`ValidatedParams`], so nothing past
//! admission checks them again.

use std::ops::Deref;
use std::sync::Arc;

use thiserror::Error;

use super::GREEDY_TEMPERATURE;

/// The most top-N alternatives a request may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_LOGPROBS: usize = 20;

/// How to pick the next token of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` (anything below [`GREEDY_TEMPERATURE`]) is greedy argmax.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches `top_p`; `1` is off.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; `0` or `-1` is off.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's; `0` is off.
    pub min_p: f32,
    /// Seed of the request's random stream; `None` draws one from process entropy.
    pub seed: Option<u64>,
    /// Subtracted once from the logit of every token that occurs in the output so far.
    pub presence_penalty: f32,
    /// Subtracted, times its count, from the logit of every token that occurs in the output so far.
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens seen in prompt or output; `1` is off.
    pub repetition_penalty: f32,
    /// Additive biases `(token id, bias)` applied to the logits after the penalties (several for one id
    /// add up).
    pub logit_bias: Vec<(u32, f32)>,
    /// Number of most likely alternatives to report with each sampled token (`None`: none).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with every other setting at its default.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether this request picks the argmax instead of drawing.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// The top-k limit, `None` when top-k is off.
    pub fn top_k_limit(&self) -> Option<usize> {
        (self.top_k > 0).then_some(self.top_k as usize)
    }

    /// The top-k limit that filters anything in a vocabulary of `valid_vocab` tokens (`None` when off
    /// or not below the vocabulary).
    pub fn top_k_within(&self, valid_vocab: usize) -> Option<usize> {
        self.top_k_limit().filter(|&k| k < valid_vocab)
    }

    /// Whether any of the repetition / frequency / presence penalties is active.
    pub fn uses_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Checks every field against its allowed range; `vocab_size` bounds the `logit_bias` token ids.
    ///
    /// NaN fails every check, so a NaN anywhere is reported as out of range.
    pub fn validate(&self, vocab_size: usize) -> Result<(), ParamError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ParamError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ParamError::TopP(self.top_p));
        }
        if self.top_k < -1 {
            return Err(ParamError::TopK(self.top_k));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(ParamError::MinP(self.min_p));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(ParamError::PresencePenalty(self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(ParamError::FrequencyPenalty(self.frequency_penalty));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(ParamError::RepetitionPenalty(self.repetition_penalty));
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return Err(ParamError::Logprobs(n));
            }
        }
        for &(token, value) in &self.logit_bias {
            if token as usize >= vocab_size {
                return Err(ParamError::LogitBiasToken { token, vocab_size });
            }
            if !value.is_finite() {
                return Err(ParamError::LogitBiasValue { token, value });
            }
        }
        Ok(())
    }

    /// These parameters, checked by [`SamplingParams::validate`] against a vocabulary of `vocab_size`
    /// tokens: the form a request carries.
    pub fn validated(self, vocab_size: usize) -> Result<ValidatedParams, ParamError> {
        self.validate(vocab_size)?;
        Ok(ValidatedParams(Arc::new(self)))
    }
}

/// [`SamplingParams`] that passed [`SamplingParams::validate`] (made only by
/// [`SamplingParams::validated`]); read through `Deref`, cloned by sharing.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedParams(Arc<SamplingParams>);

impl ValidatedParams {
    /// The same parameters with another `seed` (no seed is out of range).
    pub fn with_seed(&self, seed: Option<u64>) -> Self {
        let mut p = (*self.0).clone();
        p.seed = seed;
        Self(Arc::new(p))
    }
}

impl Deref for ValidatedParams {
    type Target = SamplingParams;

    fn deref(&self) -> &SamplingParams {
        &self.0
    }
}

/// An out-of-range sampling parameter; [`ParamError::field`] names the request field.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ParamError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top_k must be -1 or 0 (disabled) or a positive count, got {0}")]
    TopK(i32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("presence_penalty must be in [-2, 2], got {0}")]
    PresencePenalty(f32),
    #[error("frequency_penalty must be in [-2, 2], got {0}")]
    FrequencyPenalty(f32),
    #[error("repetition_penalty must be a finite number > 0, got {0}")]
    RepetitionPenalty(f32),
    #[error("at most {MAX_LOGPROBS} log-probability alternatives may be asked for, got {0}")]
    Logprobs(usize),
    #[error("logit_bias token id {token} is outside the vocabulary of {vocab_size} tokens")]
    LogitBiasToken { token: u32, vocab_size: usize },
    #[error("logit_bias value for token {token} must be finite, got {value}")]
    LogitBiasValue { token: u32, value: f32 },
}

impl ParamError {
    /// The request field at fault, as the OpenAI API spells it.
    pub fn field(&self) -> &'static str {
        match self {
            Self::Temperature(_) => "temperature",
            Self::TopP(_) => "top_p",
            Self::TopK(_) => "top_k",
            Self::MinP(_) => "min_p",
            Self::PresencePenalty(_) => "presence_penalty",
            Self::FrequencyPenalty(_) => "frequency_penalty",
            Self::RepetitionPenalty(_) => "repetition_penalty",
            Self::Logprobs(_) => "logprobs",
            Self::LogitBiasToken { .. } | Self::LogitBiasValue { .. } => "logit_bias",
        }
    }
}
