//! The engine loop: one thread owns every sequence. Each step it plans (running decodes first, then chunked
//! prefill of the sequences admitted in arrival order, under `max_num_seqs` and `max_num_batched_tokens`),
//! runs the plan on the executor, samples, appends, checks stops and streams events back. New requests
//! join between steps.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};

use sanmai_tokenizer::Tokenizer;

use crate::api::{EngineEvent, FinishReason, MetricsSnapshot, StopReason, TokenLogprob};
use crate::executor::{Executor, LogitRows, PlannedChunk, StepPlan};
use crate::handle::{Command, EngineHandle, EngineInfo, Limits};
use crate::sampler::{RowLogprobs, SampleRequest, Sampler};
use crate::sequence::{Appended, Sequence};

/// How the engine schedules.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_name: String,
    /// Sequences per step at most.
    pub max_num_seqs: usize,
    /// Tokens per step at most (decodes count one each; prefill is chunked to fit).
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// Requests allowed to wait before new ones are refused as overloaded.
    pub max_waiting: usize,
    pub default_max_tokens: Option<usize>,
    /// Ids below this are real tokens.
    pub valid_vocab: usize,
    /// Ids that end generation unless a request says `ignore_eos`.
    pub eos_ids: Vec<u32>,
}

/// Starts the engine thread and returns its handle.
pub fn start<E: Executor + 'static>(
    executor: E,
    tokenizer: Option<Tokenizer>,
    cfg: EngineConfig,
) -> EngineHandle {
    let (tx, rx) = channel();
    let info = Arc::new(EngineInfo {
        model_name: cfg.model_name.clone(),
        max_model_len: cfg.max_model_len,
        valid_vocab: cfg.valid_vocab,
        default_max_tokens: cfg.default_max_tokens,
    });
    let metrics = Arc::new(Mutex::new(MetricsSnapshot::default()));
    let limits = Arc::new(Limits {
        max_waiting: cfg.max_waiting,
        waiting: AtomicUsize::new(0),
    });
    let mut engine = Engine {
        sampler: Sampler::new(cfg.valid_vocab),
        cfg,
        executor,
        tokenizer,
        rx,
        waiting: VecDeque::new(),
        running: Vec::new(),
        metrics: metrics.clone(),
        limits: limits.clone(),
        stats: MetricsSnapshot::default(),
    };
    std::thread::Builder::new()
        .name("sanmai-engine".into())
        .spawn(move || engine.run())
        .expect("spawning the engine thread");
    EngineHandle {
        tx,
        info,
        metrics,
        limits,
    }
}

struct Engine<E: Executor> {
    cfg: EngineConfig,
    executor: E,
    tokenizer: Option<Tokenizer>,
    sampler: Sampler,
    rx: Receiver<Command>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    metrics: Arc<Mutex<MetricsSnapshot>>,
    limits: Arc<Limits>,
    stats: MetricsSnapshot,
}

impl<E: Executor> Engine<E> {
    fn run(&mut self) {
        loop {
            if self.waiting.is_empty() && self.running.is_empty() {
                match self.rx.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.abort_all();
                        return;
                    }
                }
            }
            if !self.waiting.is_empty() || !self.running.is_empty() {
                self.step();
            }
            self.publish();
        }
    }

    /// Applies a command; false means stop the loop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(req, tx) => {
                let room = self.cfg.max_model_len - req.prompt.len();
                let max_tokens = req
                    .stop
                    .max_tokens
                    .or(self.cfg.default_max_tokens)
                    .map_or(room, |m| m.min(room));
                let seq = Sequence::new(*req, tx, self.tokenizer.as_ref(), max_tokens);
                if seq.max_tokens == 0 {
                    self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
                    let usage = seq.usage();
                    seq.send(EngineEvent::Finished {
                        reason: FinishReason::Length,
                        stop_reason: None,
                        usage,
                    });
                } else {
                    self.waiting.push_back(seq);
                }
                true
            }
            Command::Abort(id) => {
                if let Some(i) = self.waiting.iter().position(|s| s.req.id == id) {
                    let seq = self.waiting.remove(i).unwrap();
                    self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
                    self.finish(seq, FinishReason::Abort, None);
                } else if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
                    let seq = self.running.remove(i);
                    self.finish(seq, FinishReason::Abort, None);
                }
                true
            }
            Command::Shutdown => {
                self.abort_all();
                self.publish();
                false
            }
        }
    }

    fn abort_all(&mut self) {
        while let Some(seq) = self.waiting.pop_front() {
            self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
            self.finish(seq, FinishReason::Abort, None);
        }
        for seq in std::mem::take(&mut self.running) {
            self.finish(seq, FinishReason::Abort, None);
        }
    }

    /// Builds the step: running decodes, then running prefills, then admissions, all under the budgets.
    fn schedule(&mut self) -> StepPlan {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = StepPlan::default();
        let mut order: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].in_prefill())
            .collect();
        order.extend((0..self.running.len()).filter(|&i| self.running[i].in_prefill()));
        for i in order {
            if budget == 0 {
                break;
            }
            if let Some(c) = self.chunk(&self.running[i], budget) {
                budget -= c.tokens.len();
                plan.chunks.push(c);
            }
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
            seq.slot = Some(self.executor.alloc_slot());
            if let Some(c) = self.chunk(&seq, budget) {
                budget -= c.tokens.len();
                plan.chunks.push(c);
            }
            self.running.push(seq);
        }
        plan
    }

    fn chunk(&self, seq: &Sequence, budget: usize) -> Option<PlannedChunk> {
        let len = seq.pending().min(budget);
        if len == 0 {
            return None;
        }
        let end = seq.num_computed + len;
        let logits = if seq.req.prompt_logprobs && seq.num_computed < seq.prompt_len() {
            LogitRows::All
        } else if end == seq.tokens.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        Some(PlannedChunk {
            slot: seq.slot.expect("scheduled sequences hold a slot"),
            pos0: seq.num_computed,
            tokens: seq.tokens[seq.num_computed..end].to_vec(),
            logits,
        })
    }

    fn step(&mut self) {
        let plan = self.schedule();
        if plan.chunks.is_empty() {
            return;
        }
        let executor = &mut self.executor;
        let out = match catch_unwind(AssertUnwindSafe(|| executor.execute(&plan))) {
            Ok(out) => out,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("the model step panicked")
                    .to_string();
                tracing::error!(error = %msg, "model step failed; failing its requests");
                for c in &plan.chunks {
                    if let Some(i) = self.running.iter().position(|s| s.slot == Some(c.slot)) {
                        let seq = self.running.remove(i);
                        self.finish(seq, FinishReason::Error(msg.clone()), None);
                    }
                }
                return;
            }
        };
        let mut row = 0;
        let mut done = Vec::new();
        for c in &plan.chunks {
            let i = self
                .running
                .iter()
                .position(|s| s.slot == Some(c.slot))
                .expect("planned sequences are running");
            let rows = match c.logits {
                LogitRows::None => 0,
                LogitRows::Last => 1,
                LogitRows::All => c.tokens.len(),
            };
            let first_row = row;
            row += rows;
            let seq = &mut self.running[i];
            let prompt_part = seq.prompt_len().saturating_sub(c.pos0).min(c.tokens.len());
            self.stats.prompt_tokens_total += prompt_part as u64;
            if c.logits == LogitRows::All {
                let n = seq.req.sampling.logprobs.unwrap_or(0);
                for r in 0..rows {
                    let target = c.pos0 + r + 1;
                    if target < seq.prompt_len() {
                        let lp =
                            RowLogprobs::new(out.row(first_row + r), self.cfg.valid_vocab).ok();
                        let id = seq.tokens[target];
                        seq.prompt_logprobs.push(lp.map(|lp| TokenLogprob {
                            id,
                            logprob: lp.logprob(id).unwrap_or(f32::NEG_INFINITY),
                            top: if n > 0 { lp.top(n) } else { Vec::new() },
                        }));
                    }
                }
            }
            seq.num_computed += c.tokens.len();
            if seq.num_computed < seq.tokens.len() {
                continue; // mid-prefill
            }
            if seq.req.prompt_logprobs && seq.num_output() == 0 {
                let mut all = vec![None];
                all.append(&mut seq.prompt_logprobs);
                seq.send(EngineEvent::PromptLogprobs(all));
            }
            let mut logits = out.row(first_row + rows - 1).to_vec();
            if seq.num_output() < seq.req.stop.min_tokens {
                // Too early to stop: end tokens cannot be drawn.
                for &id in self.cfg.eos_ids.iter().chain(&seq.req.stop.stop_token_ids) {
                    if let Some(x) = logits.get_mut(id as usize) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            let sampled = self.sampler.sample(
                &mut logits,
                &mut SampleRequest {
                    params: &seq.req.sampling,
                    state: &mut seq.sampler,
                    allowed: None,
                },
            );
            let sampled = match sampled {
                Ok(s) => s,
                Err(e) => {
                    done.push((i, FinishReason::Error(e.to_string()), None));
                    continue;
                }
            };
            let prev = seq.last_token;
            let lp = seq.req.sampling.logprobs.map(|_| TokenLogprob {
                id: sampled.id,
                logprob: sampled.logprob,
                top: sampled.top_logprobs.clone(),
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
            if let Appended::Finished(reason, stop) = outcome {
                done.push((i, reason, stop));
            }
        }
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, reason, stop) in done {
            let seq = self.running.remove(i);
            self.finish(seq, reason, stop);
        }
    }

    fn finish(&mut self, mut seq: Sequence, reason: FinishReason, stop: Option<StopReason>) {
        if let Some(slot) = seq.slot.take() {
            self.executor.free_slot(slot);
        }
        self.stats.requests_finished_total += 1;
        self.stats
            .e2e_request_latency
            .observe(seq.arrived.elapsed().as_secs_f64());
        let usage = seq.usage();
        seq.send(EngineEvent::Finished {
            reason,
            stop_reason: stop,
            usage,
        });
    }

    fn publish(&mut self) {
        self.stats.requests_running = self.running.len();
        self.stats.requests_waiting = self.waiting.len();
        *self.metrics.lock().unwrap() = self.stats.clone();
    }
}
