//! The engine loop: one thread owns every sequence. Each step it plans (running decodes first, then chunked
//! prefill of the sequences admitted in arrival order, under `max_num_seqs` and `max_num_batched_tokens`),
//! runs the plan on the executor, samples, appends, checks stops and streams events back. New requests
//! join between steps.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rayon::prelude::*;
use sanmai_tokenizer::Tokenizer;

use crate::api::{EngineEvent, FinishReason, MetricsSnapshot, StopReason, TokenLogprob};
use crate::executor::{CacheGeometry, Executor, LogitRows, PlannedChunk, StepPlan};
use crate::handle::{Command, EngineHandle, EngineInfo, Limits};
use crate::kv_cache::CacheManager;
use crate::sampler::{RowLogprobs, SampleRequest, Sampled, Sampler};
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
    /// Positions per K/V block.
    pub block_size: usize,
    /// Memory for K/V blocks and state checkpoints.
    pub kv_cache_memory_bytes: usize,
    pub enable_prefix_caching: bool,
    /// Tokens between GDN state checkpoints (a multiple of `block_size`); `None` sizes it so a checkpoint
    /// costs no more than the K/V of the tokens it covers.
    pub state_checkpoint_interval: Option<usize>,
}

/// The cache plan derived from the config and the model's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePlan {
    pub num_blocks: usize,
    pub block_size: usize,
    pub interval: usize,
    pub checkpoint_blocks: usize,
}

impl EngineConfig {
    /// Blocks that fit the memory budget, the checkpoint interval and a checkpoint's size in blocks.
    pub fn cache_plan(&self, g: CacheGeometry) -> Result<CachePlan, String> {
        let bs = self.block_size.max(1);
        let block_bytes = (g.kv_bytes_per_token * bs).max(1);
        let num_blocks = self.kv_cache_memory_bytes / block_bytes;
        let needed = self.max_model_len.div_ceil(bs) + 1;
        if num_blocks < needed {
            return Err(format!(
                "the K/V cache budget of {} bytes holds {num_blocks} blocks of {bs} tokens ({block_bytes} bytes each), \
                 but one request of max_model_len {} needs {needed}: raise --kv-cache-memory-bytes or lower --max-model-len",
                self.kv_cache_memory_bytes, self.max_model_len
            ));
        }
        let min_interval = (g.state_bytes / g.kv_bytes_per_token.max(1)).next_multiple_of(bs);
        let interval = match self.state_checkpoint_interval {
            Some(i) if i == 0 || i % bs != 0 => {
                return Err(format!("--state-checkpoint-interval {i} must be a positive multiple of the block size {bs}"))
            }
            Some(i) => i,
            None => min_interval.max(64 * bs),
        };
        Ok(CachePlan {
            num_blocks,
            block_size: bs,
            interval,
            checkpoint_blocks: g.state_bytes.div_ceil(block_bytes).max(1),
        })
    }
}

/// Plans the caches, starts the engine thread and returns its handle.
pub fn start<E: Executor + 'static>(
    mut executor: E,
    tokenizer: Option<Tokenizer>,
    cfg: EngineConfig,
) -> Result<EngineHandle, String> {
    let g = executor.geometry();
    let plan = cfg.cache_plan(g)?;
    let per_request = cfg.max_model_len.div_ceil(plan.block_size);
    tracing::info!(
        blocks = plan.num_blocks,
        block_size = plan.block_size,
        state_checkpoint_interval = plan.interval,
        checkpoint_blocks = plan.checkpoint_blocks,
        "K/V cache: {} bytes / ({} bytes per token × {} tokens per block) = {} blocks; a {}-token request \
         needs {} blocks, so {} fit at once",
        cfg.kv_cache_memory_bytes,
        g.kv_bytes_per_token,
        plan.block_size,
        plan.num_blocks,
        cfg.max_model_len,
        per_request,
        plan.num_blocks / per_request
    );
    executor.init_cache(plan.num_blocks, plan.block_size);
    let cache = CacheManager::new(
        plan.num_blocks,
        plan.block_size,
        cfg.enable_prefix_caching,
        g.state_bytes > 0,
        plan.interval,
        plan.checkpoint_blocks,
    );
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
        cache,
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
    Ok(EngineHandle {
        tx,
        info,
        metrics,
        limits,
    })
}

struct Engine<E: Executor> {
    cfg: EngineConfig,
    executor: E,
    cache: CacheManager,
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
    /// A sequence that cannot get blocks preempts the newest running sequence not yet in the step (or
    /// itself): its caches are freed and it waits to be recomputed.
    fn schedule(&mut self) -> StepPlan {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = StepPlan::default();
        let mut planned: Vec<String> = Vec::new();
        let mut order: Vec<String> = self
            .running
            .iter()
            .filter(|s| !s.in_prefill())
            .map(|s| s.req.id.clone())
            .collect();
        order.extend(
            self.running
                .iter()
                .filter(|s| s.in_prefill())
                .map(|s| s.req.id.clone()),
        );
        for id in order {
            if budget == 0 {
                break;
            }
            let Some(i) = self.running.iter().position(|s| s.req.id == id) else {
                continue;
            };
            let len = self.chunk_len(&self.running[i], budget);
            loop {
                let seq = &mut self.running[i];
                let end = seq.num_computed + len;
                if self
                    .cache
                    .ensure(&mut self.executor, seq.cache.as_mut().unwrap(), end)
                {
                    break;
                }
                let victim = self
                    .running
                    .iter()
                    .rposition(|s| !planned.contains(&s.req.id))
                    .unwrap();
                self.preempt(victim);
                if victim == i {
                    break;
                }
            }
            let Some(i) = self.running.iter().position(|s| s.req.id == id) else {
                continue;
            };
            let c = self.chunk(&self.running[i], len);
            budget -= c.tokens.len();
            plan.chunks.push(c);
            planned.push(id);
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let lookup = !(seq.req.prompt_logprobs && seq.num_output() == 0);
            let (mut cache, cached) =
                self.cache
                    .admit(&mut self.executor, &seq.tokens, &seq.req.cache_salt, lookup);
            seq.num_computed = cached;
            if seq.num_output() == 0 {
                seq.cached_tokens = cached;
            }
            let len = self.chunk_len(&seq, budget);
            if !self
                .cache
                .ensure(&mut self.executor, &mut cache, seq.num_computed + len)
            {
                self.cache.free(&mut self.executor, cache);
                seq.num_computed = 0;
                self.waiting.push_front(seq);
                break;
            }
            self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
            seq.cache = Some(cache);
            let c = self.chunk(&seq, len);
            budget -= c.tokens.len();
            plan.chunks.push(c);
            self.running.push(seq);
        }
        plan
    }

    /// Tokens of `seq` to run this step: what is pending, within the budget, stopping at the next state
    /// checkpoint boundary.
    fn chunk_len(&self, seq: &Sequence, budget: usize) -> usize {
        let mut len = seq.pending().min(budget);
        if let Some(b) = self.cache.next_boundary(seq.num_computed) {
            len = len.min(b - seq.num_computed);
        }
        len
    }

    fn chunk(&self, seq: &Sequence, len: usize) -> PlannedChunk {
        let end = seq.num_computed + len;
        let logits = if seq.req.prompt_logprobs && seq.num_output() == 0 {
            LogitRows::All
        } else if end == seq.tokens.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        let cache = seq.cache.as_ref().expect("scheduled sequences hold caches");
        PlannedChunk {
            state: cache.state,
            blocks: cache.blocks.clone(),
            pos0: seq.num_computed,
            tokens: seq.tokens[seq.num_computed..end].to_vec(),
            logits,
        }
    }

    /// Frees a running sequence's caches and puts it first in line to be recomputed.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        if let Some(c) = seq.cache.take() {
            self.cache.free(&mut self.executor, c);
        }
        seq.num_computed = 0;
        if seq.num_output() == 0 {
            seq.prompt_logprobs.clear();
        }
        self.stats.preemptions_total += 1;
        tracing::debug!(request = %seq.req.id, "preempted");
        self.limits.waiting.fetch_add(1, Ordering::Relaxed);
        self.waiting.push_front(seq);
    }

    fn step(&mut self) {
        let started = Instant::now();
        self.step_inner();
        self.stats.steps_total += 1;
        self.stats.step_seconds_total += started.elapsed().as_secs_f64();
    }

    fn step_inner(&mut self) {
        let plan = self.schedule();
        if plan.chunks.is_empty() {
            return;
        }
        let executor = &mut self.executor;
        let exec_started = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| executor.execute(&plan)));
        self.stats.execute_seconds_total += exec_started.elapsed().as_secs_f64();
        let mut out = match result {
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
                    if let Some(i) = self
                        .running
                        .iter()
                        .position(|s| s.cache.as_ref().map(|k| k.state) == Some(c.state))
                    {
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
        for c in &plan.chunks {
            let i = self
                .running
                .iter()
                .position(|s| s.cache.as_ref().map(|k| k.state) == Some(c.state))
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
            let before = seq.num_computed;
            seq.num_computed += c.tokens.len();
            let prompt_len = seq.prompt_len();
            self.cache.after_step(
                &mut self.executor,
                seq.cache.as_mut().expect("running sequences hold caches"),
                &seq.tokens,
                before,
                seq.num_computed,
                prompt_len,
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
        // Sample every sequence that completed its pending tokens, in parallel (a row is the full vocabulary).
        let (sampler, eos) = (&self.sampler, &self.cfg.eos_ids);
        let width = out.width;
        let mut rows: Vec<Option<&mut [f32]>> =
            out.rows.chunks_mut(width.max(1)).map(Some).collect();
        let mut mine: Vec<Option<&mut [f32]>> = to_sample
            .iter()
            .map(|r| r.and_then(|r| rows[r].take()))
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
                let mut req = SampleRequest {
                    params: &seq.req.sampling,
                    state: &mut seq.sampler,
                    allowed: None,
                };
                Some(sampler.sample(logits, &mut req).map_err(|e| e.to_string()))
            })
            .collect();
        for (i, s) in sampled.into_iter().enumerate() {
            let Some(s) = s else { continue };
            let sampled = match s {
                Ok(s) => s,
                Err(e) => {
                    done.push((i, FinishReason::Error(e), None));
                    continue;
                }
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
        if let Some(c) = seq.cache.take() {
            self.cache.free(&mut self.executor, c);
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
        self.stats.kv_cache_usage = self.cache.usage();
        self.stats.prefix_cache_queries_total = self.cache.stats.queries;
        self.stats.prefix_cache_hits_total = self.cache.stats.hits;
        *self.metrics.lock().unwrap() = self.stats.clone();
    }
}
