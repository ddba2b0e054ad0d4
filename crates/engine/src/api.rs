//! What the engine accepts and what it answers: the contract between the HTTP layer and the engine loop.
//!
//! A request is already tokenized when it gets here, its sampling parameters validated (it can only hold
//! them as [`ValidatedParams`]); [`EngineHandle::submit`](crate::EngineHandle::submit) admits it against
//! the context length, the one place lengths are checked. The engine streams [`EngineEvent`]s
//! back on the request's channel: zero or more `Tokens`, then exactly one `Finished`. Dropping the
//! [`RequestStream`] aborts the request (a client that disconnects frees its resources within one step).

pub use sanmai_model::{KvHostStats, RowCacheCounts};
use sanmai_structured::GrammarMatcher;

use crate::sampler::ValidatedParams;

/// A grammar the output must follow (structured output), submitted with
/// [`EngineHandle::submit_constrained`](crate::EngineHandle::submit_constrained).
///
/// Before each sample the engine asks the matcher for the allowed tokens (computed off the engine loop,
/// while the model runs the step; a sequence whose mask is late waits a step, the batch does not); every
/// accepted token advances it. When the grammar is done the sequence ends with `Stop`.
#[derive(Debug)]
pub struct OutputConstraint {
    pub matcher: GrammarMatcher,
    /// The constraint starts once the output ends with these tokens (`</think>` when the prompt opens a
    /// reasoning block: reasoning is unconstrained); empty = from the first token.
    pub activate_after: Vec<u32>,
}

/// Why a request stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Aborted (client gone, server shutting down).
    Abort,
    /// The engine failed this request; the message says why.
    Error(String),
}

/// When to stop generating.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StopParams {
    /// New tokens at most, which must fit in the context with the prompt; `None` = the model's
    /// default (capped by the room the prompt leaves), else up to the context length.
    pub max_tokens: Option<usize>,
    /// EOS and stop conditions are ignored until this many tokens are generated (at most the
    /// `max_tokens` in force, when there is one).
    pub min_tokens: usize,
    /// Stop strings: never emitted, text is held back while one could still match.
    pub stop: Vec<String>,
    /// Extra token ids that stop generation (the stop token itself is not emitted as text).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past EOS.
    pub ignore_eos: bool,
}

/// A tokenized request with validated sampling parameters.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Unique id (for logs, abort and metrics).
    pub id: String,
    pub prompt: Vec<u32>,
    /// Made by [`SamplingParams::validated`](crate::sampler::SamplingParams::validated); the engine
    /// does not check them again.
    pub sampling: ValidatedParams,
    pub stop: StopParams,
    /// Report the log-probability of every prompt token (first is `None`), with `sampling.logprobs`
    /// alternatives each.
    pub prompt_logprobs: bool,
    /// Extra keys mixed into the prefix-cache hashes (e.g. image hashes); empty for text.
    pub cache_salt: Vec<u64>,
    /// Prompt positions where the GDN state is checkpointed besides the regular ones — for a chat, where
    /// the conversation history ends and the generation prompt begins: the next turn re-renders the
    /// reply that follows differently (e.g. without an empty think block), so it shares the prompt only up
    /// to there.
    pub checkpoint_at: Vec<usize>,
    /// The prompt's images (its image rows' embeddings and MRoPE positions), made by
    /// [`ImageEncoder::encode`](crate::images::ImageEncoder::encode); `None` for text.
    pub images: Option<std::sync::Arc<crate::images::PromptImages>>,
}

impl EngineRequest {
    /// A number naming the request for the executor (its id's FNV-1a hash; see
    /// [`crate::executor::PlannedChunk::request`]).
    pub fn key(&self) -> u64 {
        self.id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

/// The log-probability of one token and its most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// Most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What the engine sends back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Prompt log-probabilities (only when asked), sent once before any `Tokens`.
    PromptLogprobs(Vec<Option<TokenLogprob>>),
    /// Newly generated tokens and the text they complete. `text` never contains a stop string and never
    /// ends inside a UTF-8 character; it may be empty while text is held back. `logprobs` has one entry per
    /// id when the request asked for log-probabilities, else it is empty.
    Tokens {
        ids: Vec<u32>,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// The last event of a request.
    Finished {
        reason: FinishReason,
        /// The stop string or stop token id that ended it, if any.
        stop_reason: Option<StopReason>,
        usage: Usage,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Token(u32),
    Text(String),
}

/// Why a request was refused before it started.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error(
        "the prompt has {prompt} tokens but the model's context length is {max_model_len} tokens \
         (the prompt must leave room for at least one generated token)"
    )]
    PromptTooLong { prompt: usize, max_model_len: usize },
    /// `max_tokens` does not fit in the context with the prompt.
    #[error(
        "this model's context length is {max_model_len} tokens, but {} tokens were requested \
         ({prompt} in the prompt, {max_tokens} to generate)",
        prompt + max_tokens
    )]
    TooManyTokens {
        prompt: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
    /// `min_tokens` exceeds the `max_tokens` in force (the requested or the default one).
    #[error("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")]
    MinTokens {
        min_tokens: usize,
        max_tokens: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the server is overloaded: {0} requests are waiting")]
    Overloaded(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Invalid(String),
}

/// A snapshot of the engine's counters and gauges for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsSnapshot {
    pub requests_running: usize,
    pub requests_waiting: usize,
    /// Share of KV blocks in use, 0..=1.
    pub kv_cache_usage: f64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_hits_total: u64,
    pub preemptions_total: u64,
    pub requests_finished_total: u64,
    /// Engine steps run; time spent submitting to and waiting for the executor; the engine's own time
    /// (scheduling, cache bookkeeping, sampling, detokenizing, events).
    pub steps_total: u64,
    pub execute_seconds_total: f64,
    pub overhead_seconds_total: f64,
    /// Histogram samples in seconds, since the previous snapshot is not tracked: cumulative buckets.
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    /// The PLE table's read counters (a model with a PLE table).
    pub ple: Option<sanmai_ple::PleMetricsSnapshot>,
    /// Each pipeline stage's busy and idle time (empty without stages).
    pub stages: Vec<StageTimes>,
    /// The QSA K/V host pool's counters (a model with `--qsa-kv-offload`): row-cache hits and
    /// misses per QSA layer and bytes read from host memory.
    pub kv_host: Option<KvHostStats>,
    /// Why steps can no longer run (a pipeline stage stopped), if they cannot.
    pub fault: Option<String>,
    /// Speculative decoding with the MTP head: drafts verified (one per sequence and verify step),
    /// draft tokens in them, drafts accepted, and drafts accepted at each draft position (index 0:
    /// the first draft).
    pub spec_decode_num_drafts_total: u64,
    pub spec_decode_num_draft_tokens_total: u64,
    pub spec_decode_num_accepted_tokens_total: u64,
    pub spec_decode_num_accepted_tokens_per_pos_total: Vec<u64>,
}

/// One pipeline stage's time: computing its share of steps, and waiting for work or for the
/// previous stage's streams.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    pub busy_seconds: f64,
    pub idle_seconds: f64,
}

/// A cumulative histogram with fixed bucket bounds (seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub bounds: Vec<f64>,
    /// `counts[i]` = samples ≤ `bounds[i]` (cumulative); the last entry counts everything (+Inf).
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &[f64]) -> Self {
        Histogram {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        *self.counts.last_mut().unwrap() += 1;
        self.sum += v;
        self.count += 1;
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new(&[
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ])
    }
}
