//! What a step is made of, between the engine and its executor: the planned chunks of the
//! scheduled sequences ([`StepPlan`], with how their rows are drawn and what the MTP head is to do
//! after them) and what a step gives back ([`StepLogits`]).

use sanmai_model::sample::{RowSampling, Sampled, SeenToken, ValidatedParams};

pub use crate::images::ChunkImages;

/// Which logits a chunk needs back: none, its last token's (to sample the next one) or every
/// token's (prompt log-probabilities).
pub use sanmai_model::OutRows as LogitRows;

/// One sequence's tokens in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedChunk {
    /// The request's key (the one given to [`Executor::prefetch`]).
    pub request: u64,
    /// The last [`CacheGeometry::history_tokens`] tokens before `pos0` (fewer near the start): what the
    /// model reads of the past besides its caches (the PLE n-gram hash).
    pub history: Vec<u32>,
    /// GDN state slot (holds the state after `pos0` tokens).
    pub state: usize,
    /// Block table covering at least `pos0 + tokens.len()` positions.
    pub blocks: Vec<u32>,
    /// Position of `tokens[0]`; the caches hold exactly `pos0` tokens before the step.
    pub pos0: usize,
    pub tokens: Vec<u32>,
    pub logits: LogitRows,
    /// How each logit row's token is drawn when the engine lets the executor sample them (see
    /// [`Executor::samples_on_device`]; a sequence that drafts always does): one per logit row, or
    /// none (the rows' logits go to the host).
    pub sampling: Vec<ChunkSampling>,
    /// The MTP draft head's part, for a sequence that drafts (`--speculative-config`).
    pub spec: Option<SpecChunk>,
    /// The explicit MRoPE positions and image-row embeddings of a chunk of a prompt with images
    /// (`None`: a plain chunk).
    pub images: Option<ChunkImages>,
}

/// What a chunk of a sequence that drafts with the MTP head asks besides its tokens. After the
/// step, the executor runs the head over the chunk's rows whose next token is known (catching its
/// K/V cache up with the main model's) and, when the executor sampled every logit row of the chunk,
/// proposes `propose` drafts from the last of them ([`StepLogits::drafts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecChunk {
    /// The chunk's last `drafts` tokens are drafts being verified; its logit rows are the row before
    /// them and each draft's ([`LogitRows::Tail`]`(drafts + 1)`).
    pub drafts: usize,
    /// The token after the chunk, when it is known already (a prompt chunk before the last).
    pub next: Option<u32>,
    /// Drafts to propose for the next step (0: none).
    pub propose: usize,
    /// The sequence has a grammar: return the head's logits row of each draft too
    /// ([`StepLogits::draft_logits`]), for the engine to pick the drafts under its masks.
    pub masked: bool,
}

/// One row's sampling, owned: the request's parameters (shared, not copied) and what the row adds to
/// them; [`ChunkSampling::row`] lends it as the [`RowSampling`] the sampling op takes. The engine
/// attaches one to exactly the rows the executor is to sample, and the executor samples exactly those.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkSampling {
    /// Ids below this are real tokens (the same for every row of a step).
    pub valid_vocab: usize,
    pub params: ValidatedParams,
    /// Distinct tokens of prompt and output with their output counts (empty without penalties).
    pub seen: Vec<SeenToken>,
    /// Allowed tokens (grammar mask, and end tokens cleared before `min_tokens`), `valid_vocab` bits.
    pub allowed: Option<Vec<u32>>,
    /// The draw's uniform from the request's stream.
    pub uniform: f64,
}

impl ChunkSampling {
    /// The borrowed form the sampling op takes.
    pub fn row(&self) -> RowSampling<'_> {
        RowSampling {
            params: &self.params,
            seen: &self.seen,
            allowed: self.allowed.as_deref(),
            uniform: self.uniform,
        }
    }
}

/// One step: the chunks of the scheduled sequences.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub chunks: Vec<PlannedChunk>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens.len()).sum()
    }
}

/// What a step returns for its requested logit rows (numbered in chunk order): per row, either the token
/// the executor sampled itself (`sampled[i]` is `Some`) or its logits on the host (`width` wide, rows
/// listed in `host`, ascending, stored in that order in `rows`). A step whose rows all carry their
/// [`ChunkSampling`] returns no logits at all; one whose rows carry none returns them all.
#[derive(Debug, Clone, Default)]
pub struct StepLogits {
    pub width: usize,
    pub rows: Vec<f32>,
    /// The logit rows whose logits are in `rows`.
    pub host: Vec<usize>,
    /// One entry per logit row when the executor sampled any (empty otherwise): the token it drew
    /// (or why it failed), `None` for a row returned as logits.
    pub sampled: Vec<Option<Result<Sampled, String>>>,
    /// The drafts the MTP head proposed, by chunk (empty for a chunk it proposed none for; the
    /// vector may end before the last chunk).
    pub drafts: Vec<Vec<u32>>,
    /// For a chunk with [`SpecChunk::masked`], the head's logits (real vocabulary) behind each of
    /// its drafts, by chunk.
    pub draft_logits: Vec<Vec<Vec<f32>>>,
}

impl StepLogits {
    /// The host logits of logit row `i`; `None` when the executor sampled that row itself.
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        let j = self.host.binary_search(&i).ok()?;
        Some(&self.rows[j * self.width..(j + 1) * self.width])
    }

    /// Steals the token the executor sampled for logit row `i`, if it did.
    pub fn take_sampled(&mut self, i: usize) -> Option<Result<Sampled, String>> {
        self.sampled.get_mut(i).and_then(Option::take)
    }
}
