//! Applying a returned step to its sequences.

use rayon::prelude::*;

use super::Engine;
use crate::api::{EngineEvent, FinishReason, StopReason, TokenLogprob};
use crate::executor::{Executor, LogitRows, PlannedChunk, StepLogits, StepPlan};
use crate::images::cache_tokens;
use crate::kv_cache::Progress;
use crate::sampler::speculative::verify_drafts;
use crate::sampler::{RowLogprobs, SampleRequest, Sampled};
use crate::sequence::Appended;

impl<E: Executor> Engine<E> {
    /// Applies a returned step: prompt log-probabilities, cache bookkeeping, sampling, stop checks, events.
    pub(super) fn process(&mut self, plan: StepPlan, result: Result<StepLogits, String>) {
        for c in &plan.chunks {
            if let Some(s) = self.running.iter_mut().find(|s| s.state() == Some(c.state)) {
                s.in_flight = false;
            }
        }
        // Sequences aborted while their step was in flight end now.
        while let Some(i) = self.running.iter().position(|s| s.abort_requested) {
            let seq = self.running.remove(i);
            self.finish(seq, FinishReason::Abort, None);
        }
        let mut out = match result {
            Ok(out) => out,
            Err(msg) => {
                tracing::error!(error = %msg, "model step failed; failing its requests");
                for c in &plan.chunks {
                    if let Some(i) = self.running.iter().position(|s| s.state() == Some(c.state)) {
                        let seq = self.running.remove(i);
                        self.finish(seq, FinishReason::Error(msg.clone()), None);
                    }
                }
                return;
            }
        };
        let mut row = 0;
        let mut done = Vec::new();
        let mut to_sample: Vec<Option<usize>> = vec![None; self.running.len()];
        let mut verify = Vec::new();
        for (ci, c) in plan.chunks.iter().enumerate() {
            let rows = c.logits.count(c.tokens.len());
            let first_row = row;
            row += rows;
            // Sequences aborted meanwhile are gone; their rows are skipped.
            let Some(i) = self.running.iter().position(|s| s.state() == Some(c.state)) else {
                continue;
            };
            let seq = &mut self.running[i];
            if c.spec.is_some() {
                seq.drafts = out.drafts.get(ci).cloned().unwrap_or_default();
                seq.draft_logits = out
                    .draft_logits
                    .get_mut(ci)
                    .map(std::mem::take)
                    .unwrap_or_default();
            }
            let prompt_part = seq.prompt_len().saturating_sub(c.pos0).min(c.tokens.len());
            self.stats.prompt_tokens_total += prompt_part as u64;
            if c.spec.is_some_and(|s| s.drafts > 0) {
                // Its tokens are the sequence's once verified, below.
                verify.push((i, ci, first_row));
                continue;
            }
            if c.logits == LogitRows::All {
                let n = seq.req.sampling.logprobs.unwrap_or(0);
                for r in 0..rows {
                    let target = c.pos0 + r + 1;
                    if target < seq.prompt_len() {
                        let lp = out
                            .row(first_row + r)
                            .and_then(|row| RowLogprobs::new(row, self.cfg.valid_vocab).ok());
                        let id = seq.tokens[target];
                        seq.prompt_logprobs.push(lp.map(|lp| TokenLogprob {
                            id,
                            logprob: lp.logprob(id).unwrap_or(f32::NEG_INFINITY),
                            top: if n > 0 { lp.top(n) } else { Vec::new() },
                        }));
                    }
                }
            }
            let before = seq.num_computed;
            seq.num_computed += c.tokens.len();
            let prompt_len = seq.prompt_len();
            let progress = Progress {
                tokens: &cache_tokens(
                    seq.req.images.as_deref(),
                    &seq.tokens,
                    seq.cache
                        .as_ref()
                        .map_or(0, |c| c.hashed_tokens(self.cfg.block_size)),
                ),
                before,
                after: seq.num_computed,
                prompt_len,
                checkpoint_at: &seq.req.checkpoint_at,
            };
            self.cache.after_step(
                &mut self.executor,
                seq.cache.as_mut().expect("running sequences hold caches"),
                &progress,
            );
            if seq.num_computed < seq.tokens.len() {
                continue; // mid-prefill
            }
            if seq.req.prompt_logprobs && seq.num_output() == 0 {
                let mut all = vec![None];
                all.append(&mut seq.prompt_logprobs);
                seq.send(EngineEvent::PromptLogprobs(all));
            }
            to_sample[i] = Some(first_row + rows - 1);
        }
        for (i, ci, first_row) in verify {
            if let Some(end) = self.apply_verified(i, &plan.chunks[ci], first_row, &mut out) {
                done.push(end);
            }
        }
        // The rows the executor sampled itself: those the plan gave a `ChunkSampling` (where a row is
        // sampled was decided then, see `schedule::device_sampling`, with its uniform reserved). Every
        // other row came back as logits and is sampled here.
        for (i, r) in to_sample.iter_mut().enumerate() {
            let Some(s) = r.and_then(|r| out.take_sampled(r)) else {
                continue;
            };
            *r = None;
            self.running[i].sampler.discard_reserved();
            if let Some(end) = self.accept_sampled(i, drawn(s)) {
                done.push(end);
            }
        }
        // Sample every sequence that completed its pending tokens, in parallel (a row is the full vocabulary).
        let (sampler, eos) = (&self.sampler, &self.cfg.eos_ids);
        let (width, host) = (out.width, &out.host);
        let mut rows: Vec<Option<&mut [f32]>> =
            out.rows.chunks_mut(width.max(1)).map(Some).collect();
        let mut mine: Vec<Option<&mut [f32]>> = to_sample
            .iter()
            .map(|r| {
                let j = host.binary_search(&(*r)?).ok()?;
                rows[j].take()
            })
            .collect();
        let sampled: Vec<Option<Result<Sampled, String>>> = self
            .running
            .par_iter_mut()
            .zip(mine.par_iter_mut())
            .map(|(seq, row)| {
                // The row is sampled in place: it is not needed afterwards.
                let logits = row.take()?;
                if seq.num_output() < seq.req.stop.min_tokens {
                    // Too early to stop: end tokens cannot be drawn.
                    for &id in eos.iter().chain(&seq.req.stop.stop_token_ids) {
                        if let Some(x) = logits.get_mut(id as usize) {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                let mask = match seq.constraint.as_mut() {
                    Some(c) if c.active() => {
                        if !c.poll() {
                            // The grammar mask is late: this sequence samples when it arrives.
                            seq.deferred_row.clear();
                            seq.deferred_row.extend_from_slice(logits);
                            seq.deferred = true;
                            return None;
                        }
                        match c.mask() {
                            Some(Ok(m)) => Some(m),
                            Some(Err(e)) => return Some(Err(format!("structured output: {e}"))),
                            None => None,
                        }
                    }
                    _ => None,
                };
                let mut req = SampleRequest {
                    params: &seq.req.sampling,
                    state: &mut seq.sampler,
                    allowed: mask,
                };
                Some(sampler.sample(logits, &mut req).map_err(|e| e.to_string()))
            })
            .collect();
        for (i, s) in sampled.into_iter().enumerate() {
            let Some(s) = s else { continue };
            if let Some(end) = self.accept_sampled(i, s) {
                done.push(end);
            }
        }
        self.finish_done(done);
    }

    /// Applies a verify step of running sequence `i` (chunk `c`, whose logit rows start at
    /// `first_row`, all drawn by the executor): emits the drawn tokens up to the first that differs
    /// from its draft (`crate::sampler::speculative`), or all of them and the bonus token. When
    /// every draft was accepted the caches hold the chunk; otherwise the state before the step is
    /// restored and the chunk's accepted tokens are computed again with the next step (their K/V
    /// rows are rewritten with the same values). Returns how the sequence ends, if it does.
    fn apply_verified(
        &mut self,
        i: usize,
        c: &PlannedChunk,
        first_row: usize,
        out: &mut StepLogits,
    ) -> Option<(usize, FinishReason, Option<StopReason>)> {
        let k = c.spec.map_or(0, |s| s.drafts);
        let drafts = &c.tokens[c.tokens.len() - k..];
        let mut draws = (0..=k).map(|j| {
            out.take_sampled(first_row + j)
                .unwrap_or_else(|| Err("the executor drew no token for a verify row".to_string()))
        });
        let mut end = None;
        let mut accepted = 0;
        let verdict = verify_drafts(drafts, |j| {
            let s = draws.next().expect("one draw per verify row");
            self.running[i].sampler.discard_reserved();
            let id = s.as_ref().map(|s| s.id).ok();
            let more = j < k && id == Some(drafts[j]);
            // The grammar's next mask is asked for after the last token this step emits.
            end = self.accept_drawn(i, drawn(s), !more);
            if more {
                accepted += 1;
            }
            // An ended sequence draws no further.
            match (&end, id) {
                (None, Some(id)) => Ok(id),
                _ => Err(()),
            }
        });
        debug_assert!(verdict.map_or(true, |v| v.accepted == accepted));
        let st = &mut self.stats;
        st.spec_decode_num_drafts_total += 1;
        st.spec_decode_num_draft_tokens_total += k as u64;
        st.spec_decode_num_accepted_tokens_total += accepted as u64;
        let per_pos = &mut st.spec_decode_num_accepted_tokens_per_pos_total;
        if per_pos.len() < k {
            per_pos.resize(k, 0);
        }
        for n in &mut per_pos[..accepted] {
            *n += 1;
        }
        if end.is_some() {
            return end;
        }
        let seq = &mut self.running[i];
        let cache = seq.cache.as_mut().expect("running sequences hold caches");
        if accepted < k {
            let snapshot = seq
                .snapshot
                .expect("a verify step keeps the state before it");
            return match self.executor.copy_state(snapshot, cache.state) {
                Ok(()) => None,
                Err(e) => Some((i, FinishReason::Error(e), None)),
            };
        }
        seq.num_computed = c.pos0 + c.tokens.len();
        let progress = Progress {
            tokens: &cache_tokens(
                seq.req.images.as_deref(),
                &seq.tokens,
                cache.hashed_tokens(self.cfg.block_size),
            ),
            before: c.pos0,
            after: seq.num_computed,
            prompt_len: seq.req.prompt.len(),
            checkpoint_at: &seq.req.checkpoint_at,
        };
        self.cache.after_step(&mut self.executor, cache, &progress);
        None
    }

    /// Appends a sampled token (or fails the sequence), records its latency and asks for the next grammar
    /// mask; returns how the sequence ends, if it does.
    fn accept_sampled(
        &mut self,
        i: usize,
        s: Result<Sampled, String>,
    ) -> Option<(usize, FinishReason, Option<StopReason>)> {
        self.accept_drawn(i, s, true)
    }

    /// [`Self::accept_sampled`], asking for the next grammar mask only when `last` (no other token
    /// of this step follows).
    fn accept_drawn(
        &mut self,
        i: usize,
        s: Result<Sampled, String>,
        last: bool,
    ) -> Option<(usize, FinishReason, Option<StopReason>)> {
        let sampled = match s {
            Ok(s) => s,
            Err(e) => return Some((i, FinishReason::Error(e), None)),
        };
        let seq = &mut self.running[i];
        let prev = seq.last_token;
        let lp = seq.req.sampling.logprobs.map(|_| TokenLogprob {
            id: sampled.id,
            logprob: sampled.logprob,
            top: sampled.top_logprobs,
        });
        let outcome = seq.append(sampled.id, lp, &self.cfg.eos_ids, self.cfg.max_model_len);
        self.stats.generation_tokens_total += 1;
        match prev {
            None => self
                .stats
                .time_to_first_token
                .observe(seq.arrived.elapsed().as_secs_f64()),
            Some(p) => self
                .stats
                .inter_token_latency
                .observe(p.elapsed().as_secs_f64()),
        }
        match outcome {
            Appended::Finished(reason, stop) => Some((i, reason, stop)),
            Appended::Continue => {
                if let Some(c) = seq.constraint.as_mut().filter(|_| last) {
                    // Computed while the model runs the next step.
                    c.request_mask(&mut self.masks);
                }
                None
            }
        }
    }

    fn finish_done(&mut self, mut done: Vec<(usize, FinishReason, Option<StopReason>)>) {
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, reason, stop) in done {
            let seq = self.running.remove(i);
            self.finish(seq, reason, stop);
        }
    }

    /// Samples the sequences whose late grammar mask has arrived.
    pub(super) fn sample_deferred(&mut self) {
        let mut done = Vec::new();
        for i in 0..self.running.len() {
            let seq = &mut self.running[i];
            if !seq.deferred {
                continue;
            }
            let Some(c) = seq.constraint.as_mut() else {
                seq.deferred = false;
                continue;
            };
            if !c.poll() {
                continue;
            }
            seq.deferred = false;
            let mut row = std::mem::take(&mut seq.deferred_row);
            let s = match c.mask() {
                Some(Err(e)) => Err(format!("structured output: {e}")),
                mask => {
                    let mut req = SampleRequest {
                        params: &seq.req.sampling,
                        state: &mut seq.sampler,
                        allowed: mask.and_then(Result::ok),
                    };
                    self.sampler
                        .sample(&mut row, &mut req)
                        .map_err(|e| e.to_string())
                }
            };
            self.running[i].deferred_row = row;
            if let Some(end) = self.accept_sampled(i, s) {
                done.push(end);
            }
        }
        self.finish_done(done);
    }
}

/// A token the executor drew, as the host sampler reports one (no top log-probabilities: a row
/// that asks for them is drawn on the host).
fn drawn(s: Result<sanmai_model::sample::Sampled, String>) -> Result<Sampled, String> {
    s.map(|s| Sampled {
        id: s.id,
        logprob: s.logprob,
        top_logprobs: Vec::new(),
    })
}
