//! One request inside the engine: its tokens, how many of them the caches hold, its sampler state, its
//! detokenizer and stop checks, and the events it sends back.

use std::time::Instant;

use sanmai_tokenizer::{IncrementalDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{EngineEvent, EngineRequest, FinishReason, StopReason, TokenLogprob, Usage};
use crate::kv_cache::SeqCache;
use crate::masks::{Accepted, Constrained};
use crate::sampler::SamplerState;
use crate::stop::StopStrings;

pub(crate) struct Sequence {
    pub req: EngineRequest,
    pub tx: UnboundedSender<EngineEvent>,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V and state the caches hold.
    pub num_computed: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Blocks and state slot while the sequence is running.
    pub cache: Option<SeqCache>,
    /// A step with this sequence is in flight.
    pub in_flight: bool,
    /// Aborted while in flight: finish when the step returns.
    pub abort_requested: bool,
    pub sampler: SamplerState,
    detok: Option<IncrementalDecoder>,
    stops: StopStrings,
    pub prompt_logprobs: Vec<Option<TokenLogprob>>,
    pub max_tokens: usize,
    pub arrived: Instant,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    /// The grammar its output follows (structured output).
    pub constraint: Option<Constrained>,
    /// Logits of a position whose grammar mask was late: sampled once the mask arrives, meanwhile the
    /// sequence is not scheduled.
    pub deferred_row: Vec<f32>,
    pub deferred: bool,
    /// The MTP head's latest drafts for the tokens after the last one (empty when none).
    pub drafts: Vec<u32>,
    /// Under a grammar, the head's logits row behind each draft (the drafts are picked again from
    /// them under the grammar's masks).
    pub draft_logits: Vec<Vec<f32>>,
    /// A state slot holding the GDN state from before the step that verifies drafts, restored when
    /// a draft is rejected (held while the sequence drafts).
    pub snapshot: Option<usize>,
}

/// What appending a token decided.
pub(crate) enum Appended {
    Continue,
    Finished(FinishReason, Option<StopReason>),
}

impl Sequence {
    /// A number naming the request for the executor ([`EngineRequest::key`]).
    pub fn key(&self) -> u64 {
        self.req.key()
    }

    pub fn new(
        req: EngineRequest,
        tx: UnboundedSender<EngineEvent>,
        tokenizer: Option<&Tokenizer>,
        max_tokens: usize,
    ) -> Self {
        let sampler = SamplerState::new(&req.sampling, &req.prompt);
        let stops = StopStrings::new(&req.stop.stop);
        Sequence {
            tokens: req.prompt.clone(),
            num_computed: 0,
            cached_tokens: 0,
            cache: None,
            in_flight: false,
            abort_requested: false,
            sampler,
            detok: tokenizer.map(|t| IncrementalDecoder::new(t.clone(), true)),
            stops,
            prompt_logprobs: Vec::new(),
            max_tokens,
            arrived: Instant::now(),
            first_token: None,
            last_token: None,
            constraint: None,
            deferred_row: Vec::new(),
            deferred: false,
            drafts: Vec::new(),
            draft_logits: Vec::new(),
            snapshot: None,
            req,
            tx,
        }
    }

    /// The state slot while running (it identifies the sequence in a step's plan).
    pub fn state(&self) -> Option<usize> {
        self.cache.as_ref().map(|c| c.state)
    }

    pub fn prompt_len(&self) -> usize {
        self.req.prompt.len()
    }

    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len()
    }

    /// Tokens still to be fed to the model before the next token can be sampled.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    pub fn in_prefill(&self) -> bool {
        self.num_computed < self.prompt_len()
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len(),
            completion_tokens: self.num_output(),
            cached_tokens: self.cached_tokens,
        }
    }

    /// Sends an event; false when the client is gone.
    pub fn send(&self, ev: EngineEvent) -> bool {
        self.tx.send(ev).is_ok()
    }

    /// Appends a sampled token, emits its text and decides whether the sequence ends.
    pub fn append(
        &mut self,
        id: u32,
        logprob: Option<TokenLogprob>,
        eos_ids: &[u32],
        max_model_len: usize,
    ) -> Appended {
        let now = Instant::now();
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        self.tokens.push(id);
        self.sampler.accept(id);
        let prompt_len = self.req.prompt.len();
        let grammar = match self.constraint.as_mut() {
            Some(c) => c.accept(id, &self.tokens[prompt_len..]),
            None => Accepted::Continue,
        };
        let stop = &self.req.stop;
        let past_min = self.num_output() > stop.min_tokens;
        let stop_token = past_min
            && ((!stop.ignore_eos && eos_ids.contains(&id)) || stop.stop_token_ids.contains(&id));
        let mut text = String::new();
        let mut finish = None;
        if stop_token {
            finish = Some((FinishReason::Stop, Some(StopReason::Token(id))));
        } else if let Some(d) = self.detok.as_mut() {
            let piece = d.step(id).unwrap_or_default();
            let check = self.stops.feed(&piece);
            text = check.emit;
            if let Some(s) = check.matched {
                if self.num_output() >= stop.min_tokens {
                    finish = Some((FinishReason::Stop, Some(StopReason::Text(s))));
                } else {
                    // Too early to stop: the match is ordinary text.
                    text.push_str(&s);
                    text.push_str(&self.stops.feed(&check.rest).emit);
                }
            }
        }
        if finish.is_none() {
            match grammar {
                Accepted::Continue => {}
                // The grammar is complete: nothing else may follow.
                Accepted::Done => finish = Some((FinishReason::Stop, None)),
                Accepted::Failed(e) => {
                    finish = Some((FinishReason::Error(format!("structured output: {e}")), None))
                }
            }
        }
        if finish.is_none()
            && (self.num_output() >= self.max_tokens || self.tokens.len() >= max_model_len)
        {
            finish = Some((FinishReason::Length, None));
        }
        if finish.is_some() && !matches!(finish, Some((_, Some(_)))) {
            // Ending without a stop string: release what was held back.
            if let Some(d) = self.detok.as_mut() {
                let rest = d.flush().unwrap_or_default();
                text.push_str(&self.stops.feed(&rest).emit);
            }
            text.push_str(&self.stops.flush());
        }
        let logprobs = logprob.into_iter().collect();
        let alive = self.send(EngineEvent::Tokens {
            ids: vec![id],
            text,
            logprobs,
        });
        match finish {
            Some((r, s)) => Appended::Finished(r, s),
            None if !alive => Appended::Finished(FinishReason::Abort, None),
            None => Appended::Continue,
        }
    }
}
