//! Planning a step: which sequences run, how many tokens each, with which blocks; preemption when the
//! block pool runs dry.

use std::sync::atomic::Ordering;

use super::Engine;
use crate::api::FinishReason;
use crate::executor::{ChunkSampling, Executor, LogitRows, PlannedChunk, SpecChunk, StepPlan};
use crate::images::cache_tokens;
use crate::sequence::Sequence;

impl<E: Executor> Engine<E> {
    /// Builds the step: running decodes, then running prefills, then admissions, all under the budgets.
    /// A sequence that cannot get blocks preempts the newest running sequence not yet in the step (or
    /// itself): its caches are freed and it waits to be recomputed. With an executor that keeps N
    /// steps in flight (pipeline stages), a step takes at most 1/N of the sequences that may run, so
    /// that N micro-batches of about equal size keep every stage busy.
    pub(super) fn schedule(&mut self) -> StepPlan {
        let mut budget = self.cfg.max_num_batched_tokens;
        let cap = self.micro_batch_cap();
        let mut plan = StepPlan::default();
        let mut planned: Vec<String> = Vec::new();
        // A sequence waiting for its grammar mask has nothing to run.
        let idle = |s: &&Sequence| !s.in_flight && !s.abort_requested && !s.deferred;
        let mut order: Vec<String> = self
            .running
            .iter()
            .filter(idle)
            .filter(|s| !s.in_prefill())
            .map(|s| s.req.id.clone())
            .collect();
        order.extend(
            self.running
                .iter()
                .filter(idle)
                .filter(|s| s.in_prefill())
                .map(|s| s.req.id.clone()),
        );
        for id in order {
            if budget == 0 || plan.chunks.len() >= cap {
                break;
            }
            let Some(i) = self.running.iter().position(|s| s.req.id == id) else {
                continue;
            };
            let len = self.chunk_len(&self.running[i], budget);
            let (drafts, propose) = self.draft_plan(&self.running[i], len, budget);
            let mut wait = false;
            loop {
                let seq = &mut self.running[i];
                let end = seq.num_computed + len + drafts + propose.saturating_sub(1);
                if self
                    .cache
                    .ensure(&mut self.executor, seq.cache.as_mut().unwrap(), end)
                {
                    break;
                }
                // The newest sequence admitted after this one (or this one) that is neither in this
                // step nor in flight: an older one is never preempted for a newer one, or sequences
                // would take each other's blocks in turn and none would finish.
                let victim = i + self.running[i..]
                    .iter()
                    .rposition(|s| !s.in_flight && !planned.contains(&s.req.id))
                    .expect("the sequence being scheduled is a candidate");
                if victim == i && self.running[i + 1..].iter().any(|s| s.in_flight) {
                    // A newer sequence is in flight: wait for its step rather than start over.
                    wait = true;
                    break;
                }
                self.preempt(victim);
                if victim == i {
                    break;
                }
            }
            if wait {
                continue;
            }
            let Some(i) = self.running.iter().position(|s| s.req.id == id) else {
                continue;
            };
            let (drafts, masks) = self.legal_drafts(i, drafts);
            let drafts = self.take_snapshot(i, drafts);
            let mut c = self.chunk(&self.running[i], len, drafts, propose);
            c.sampling = device_sampling(
                &mut self.running[i],
                c.logits,
                &c.tokens[len..],
                &masks,
                self.executor.samples_on_device() || c.spec.is_some(),
                self.cfg.valid_vocab,
                &self.cfg.eos_ids,
            );
            budget -= c.tokens.len();
            plan.chunks.push(c);
            planned.push(id);
        }
        while budget > 0 && plan.chunks.len() < cap && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let lookup = !(seq.req.prompt_logprobs && seq.num_output() == 0);
            let admitted = self.cache.admit(
                &mut self.executor,
                &cache_tokens(seq.req.images.as_deref(), &seq.tokens, 0),
                &seq.req.cache_salt,
                lookup,
            );
            let (mut cache, cached) = match admitted {
                Ok(a) => a,
                // No state slot: wait for a running sequence to free one, or fail the request
                // when nothing runs that could.
                Err(e) if self.running.is_empty() => {
                    self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
                    self.finish(seq, FinishReason::Error(e), None);
                    continue;
                }
                Err(_) => {
                    self.waiting.push_front(seq);
                    break;
                }
            };
            seq.num_computed = cached;
            if seq.num_output() == 0 {
                seq.cached_tokens = cached;
            }
            let len = self.chunk_len(&seq, budget);
            let (_, propose) = self.draft_plan(&seq, len, budget);
            let end = seq.num_computed + len + propose.saturating_sub(1);
            if !self.cache.ensure(&mut self.executor, &mut cache, end) {
                self.cache.free(&mut self.executor, cache);
                seq.num_computed = 0;
                self.waiting.push_front(seq);
                break;
            }
            self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
            seq.cache = Some(cache);
            if seq.num_computed < seq.tokens.len() {
                self.executor
                    .prefetch(seq.key(), &seq.tokens, seq.num_computed);
            }
            if lookup {
                self.cache.record_admission(seq.tokens.len(), cached);
            }
            let mut c = self.chunk(&seq, len, 0, propose);
            c.sampling = device_sampling(
                &mut seq,
                c.logits,
                &[],
                &[],
                self.executor.samples_on_device() || c.spec.is_some(),
                self.cfg.valid_vocab,
                &self.cfg.eos_ids,
            );
            budget -= c.tokens.len();
            plan.chunks.push(c);
            self.running.push(seq);
        }
        plan
    }

    /// Sequences one step may take: all of them with one step in flight at a time; with N, a 1/N
    /// share (rounded up) of the running sequences and those that may be admitted.
    fn micro_batch_cap(&self) -> usize {
        let n = self.executor.max_in_flight().max(1);
        if n == 1 {
            return usize::MAX;
        }
        let running = self.running.iter().filter(|s| !s.abort_requested).count();
        let admissible = self
            .waiting
            .len()
            .min(self.cfg.max_num_seqs.saturating_sub(self.running.len()));
        (running + admissible).div_ceil(n).max(1)
    }

    /// Tokens of `seq` to run this step: what is pending, within the budget, stopping at the next state
    /// checkpoint boundary.
    fn chunk_len(&self, seq: &Sequence, budget: usize) -> usize {
        let mut len = seq.pending().min(budget);
        if let Some(b) =
            self.cache
                .next_boundary(seq.num_computed, seq.prompt_len(), &seq.req.checkpoint_at)
        {
            len = len.min(b - seq.num_computed);
        }
        len
    }

    /// `len` of `seq`'s tokens, then `drafts` of its drafts to verify; the MTP head is to propose
    /// `propose` drafts after the step (for a sequence that drafts).
    fn chunk(&self, seq: &Sequence, len: usize, drafts: usize, propose: usize) -> PlannedChunk {
        let end = seq.num_computed + len;
        let logits = if seq.req.prompt_logprobs && seq.num_output() == 0 {
            LogitRows::All
        } else if drafts > 0 {
            LogitRows::Tail(drafts + 1)
        } else if end == seq.tokens.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        let cache = seq.cache.as_ref().expect("scheduled sequences hold caches");
        let past = self.history_tokens.min(seq.num_computed);
        let mut tokens = seq.tokens[seq.num_computed..end].to_vec();
        tokens.extend_from_slice(&seq.drafts[..drafts]);
        let images = seq
            .req
            .images
            .as_ref()
            .and_then(|im| im.chunk(seq.num_computed, tokens.len()));
        PlannedChunk {
            request: seq.key(),
            history: seq.tokens[seq.num_computed - past..seq.num_computed].to_vec(),
            state: cache.state,
            blocks: cache.blocks.clone(),
            pos0: seq.num_computed,
            tokens,
            logits,
            sampling: Vec::new(),
            spec: self.drafts(seq).then(|| SpecChunk {
                drafts,
                next: seq.tokens.get(end).copied(),
                propose,
                masked: seq.constraint.is_some(),
            }),
            images,
        }
    }

    /// Whether `seq` drafts with the MTP head: speculative decoding is on and nothing about the
    /// request needs its rows on the host (top log-probabilities, prompt log-probabilities).
    fn drafts(&self, seq: &Sequence) -> bool {
        self.cfg.num_speculative_tokens > 0
            && !seq.req.prompt_logprobs
            && seq.req.sampling.logprobs.unwrap_or(0) == 0
    }

    /// For a chunk of `len` of `seq`'s pending tokens: how many of its drafts to verify with them,
    /// and how many the MTP head is to propose after the step. Drafts are verified only after the
    /// sequence's last token, within the step's token budget, the request's remaining tokens, the
    /// context and the next state checkpoint; and not after a chunk that already repeats a rejected
    /// verify's tokens (so that chunk cannot grow). The head proposes after a chunk that ends the
    /// sequence's tokens, as many as the context has positions for.
    fn draft_plan(&self, seq: &Sequence, len: usize, budget: usize) -> (usize, usize) {
        let k = self.cfg.num_speculative_tokens;
        let end = seq.num_computed + len;
        if !self.drafts(seq) || end < seq.tokens.len() {
            return (0, 0);
        }
        let room = self.cfg.max_model_len.saturating_sub(end);
        let mut drafts = seq
            .drafts
            .len()
            .min(k)
            .min(budget.saturating_sub(len))
            .min(seq.max_tokens.saturating_sub(seq.num_output() + 1))
            .min(room.saturating_sub(1));
        if len > k + 1 {
            drafts = 0;
        }
        if let Some(b) =
            self.cache
                .next_boundary(seq.num_computed, seq.prompt_len(), &seq.req.checkpoint_at)
        {
            drafts = drafts.min(b.saturating_sub(end));
        }
        (drafts, k.min(room.saturating_sub(drafts) + 1))
    }

    /// Running sequence `i`'s drafts to verify (at most `drafts`) with the grammar's mask at each
    /// verify row (none without a grammar): under a grammar, the drafts are picked from the head's
    /// logits rows under the masks (see [`Constrained::pick_drafts`](crate::masks::Constrained::pick_drafts)).
    /// A sequence whose grammar is not yet active (it starts after a trigger, which a draft might
    /// complete) or whose next mask is not in hand verifies none.
    fn legal_drafts(&mut self, i: usize, drafts: usize) -> (usize, Vec<Vec<u32>>) {
        let seq = &mut self.running[i];
        let Some(c) = seq.constraint.as_mut().filter(|_| drafts > 0) else {
            return (drafts, Vec::new());
        };
        if !c.active() {
            return (0, Vec::new());
        }
        match c.pick_drafts(&seq.drafts, &seq.draft_logits, drafts) {
            Some(Ok((picked, masks))) => {
                let n = picked.len();
                seq.drafts = picked;
                (n, masks)
            }
            _ => (0, Vec::new()),
        }
    }

    /// Keeps the state of running sequence `i` before a step that verifies `drafts` drafts, in its
    /// snapshot slot; returns the drafts to verify (none when no slot could be had).
    fn take_snapshot(&mut self, i: usize, drafts: usize) -> usize {
        if drafts == 0 {
            return 0;
        }
        let seq = &mut self.running[i];
        let state = seq.state().expect("scheduled sequences hold caches");
        let slot = match seq.snapshot {
            Some(s) => s,
            None => match self.executor.alloc_state() {
                Ok(s) => *seq.snapshot.insert(s),
                Err(_) => return 0,
            },
        };
        match self.executor.copy_state(state, slot) {
            Ok(()) => drafts,
            Err(_) => 0,
        }
    }

    /// Frees a running sequence's caches and puts it first in line to be recomputed.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        if let Some(c) = seq.cache.take() {
            self.cache.free(&mut self.executor, c);
        }
        if let Some(s) = seq.snapshot.take() {
            self.executor.free_state(s);
        }
        self.executor.cancel_prefetch(seq.key());
        seq.num_computed = 0;
        seq.drafts.clear();
        seq.draft_logits.clear();
        // Recomputing gives the late position's logits again.
        seq.deferred = false;
        if seq.num_output() == 0 {
            seq.prompt_logprobs.clear();
        }
        self.stats.preemptions_total += 1;
        tracing::debug!(request = %seq.req.id, "preempted");
        self.limits.waiting.fetch_add(1, Ordering::Relaxed);
        self.waiting.push_front(seq);
    }
}

/// Where `seq`'s next token is drawn, the one decision per row and step between the executor's
/// sampling op and the host sampler: the executor draws it (`Some`, what it needs to) when it samples
/// on its device (`on_device`), the chunk ends on the row to sample (`logits` is
/// [`LogitRows::Last`]: a prompt-logprob chunk returns every row's logits, a mid-prefill chunk none),
/// no top-N log-probabilities are asked for (the op returns only the token and its log-probability),
/// and a grammar's mask is in hand (a late or failed one is the host's to wait for or report). Else
/// `None`: the step returns the row's logits and the host samples them. Reserves the draw's uniform
/// from the sequence's stream, so the token is the same whichever side samples it.
///
/// A chunk that verifies `drafts` gets one row per draft besides its last token's: row `j` is drawn
/// as a step without drafts would after `drafts[..j]` (their penalty counts, `min_tokens`), with the
/// `j`-th uniform from now, and for a sequence with a grammar `masks[j]` (the grammar's mask after
/// `drafts[..j]`, see [`Constrained::draft_masks`](crate::masks::Constrained::draft_masks)).
pub(super) fn device_sampling(
    seq: &mut Sequence,
    logits: LogitRows,
    drafts: &[u32],
    masks: &[Vec<u32>],
    on_device: bool,
    valid_vocab: usize,
    eos: &[u32],
) -> Vec<ChunkSampling> {
    let last = matches!(logits, LogitRows::Last | LogitRows::Tail(_));
    if !on_device || !last || seq.req.sampling.logprobs.unwrap_or(0) > 0 {
        return Vec::new();
    }
    let mut counts = seq.sampler.counts().clone();
    let mut rows = Vec::with_capacity(drafts.len() + 1);
    for j in 0..=drafts.len() {
        if j > 0 {
            counts.add_output_token(drafts[j - 1]);
        }
        let Some(mut s) = row_sampling(seq, j, masks.get(j), valid_vocab, eos) else {
            return Vec::new();
        };
        if s.params.uses_penalties() {
            s.seen = counts.seen().to_vec();
        }
        rows.push(s);
    }
    rows
}

/// The sampling of the row `j` draws after the sequence's last token (see [`device_sampling`]),
/// its penalty counts left empty, its grammar mask `mask` when given; `None` when its grammar mask
/// is not in hand.
fn row_sampling(
    seq: &mut Sequence,
    j: usize,
    mask: Option<&Vec<u32>>,
    valid_vocab: usize,
    eos: &[u32],
) -> Option<ChunkSampling> {
    let words = valid_vocab.div_ceil(32);
    let mut allowed = match seq.constraint.as_mut() {
        _ if mask.is_some() => mask.map(|m| {
            let mut m = m.clone();
            m.resize(words, 0);
            m
        }),
        Some(c) if c.active() => {
            if !c.poll() {
                return None;
            }
            match c.mask() {
                Some(Ok(m)) => {
                    let mut m = m.to_vec();
                    m.resize(words, 0);
                    Some(m)
                }
                _ => return None,
            }
        }
        _ => None,
    };
    if seq.num_output() + j < seq.req.stop.min_tokens {
        // Too early to stop: end tokens cannot be drawn.
        let m = allowed.get_or_insert_with(|| vec![u32::MAX; words]);
        for &id in eos.iter().chain(&seq.req.stop.stop_token_ids) {
            if (id as usize) < valid_vocab {
                m[id as usize / 32] &= !(1 << (id % 32));
            }
        }
    }
    let params = seq.req.sampling.clone();
    Some(ChunkSampling {
        valid_vocab,
        seen: Vec::new(),
        allowed,
        uniform: if params.is_greedy() {
            0.0
        } else {
            seq.sampler.reserve_uniform_at(j)
        },
        params,
    })
}
