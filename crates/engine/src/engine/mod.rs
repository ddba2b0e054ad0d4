//! The engine loop: one thread owns every sequence. Each step it plans (running decodes first, then chunked
//! prefill of the sequences admitted in arrival order, under `max_num_seqs` and `max_num_batched_tokens`;
//! [`schedule`]), submits the plan to the executor, and when a step returns samples, appends, checks stops
//! and streams events back ([`process`]). New requests join between steps. With an executor that keeps
//! several steps in flight, a sequence is scheduled again only after its previous step has returned.
//! Sequences with a grammar (structured output) get their allowed-token masks from worker threads
//! ([`crate::masks`]) while the model runs; one whose mask is late keeps its logits and samples a step later.

mod process;
mod schedule;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sanmai_tokenizer::Tokenizer;

use crate::api::{EngineEvent, FinishReason, MetricsSnapshot, StopReason};
use crate::executor::{CacheGeometry, Executor};
use crate::handle::{Command, EngineHandle, EngineInfo, Limits};
use crate::kv_cache::CacheManager;
use crate::masks::{Constrained, MaskWorkers};
use crate::sampler::Sampler;
use crate::sequence::Sequence;

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
    /// Drafts the MTP head proposes per step for each sequence (`--speculative-config`'s
    /// `num_speculative_tokens`; 0: no speculative decoding).
    pub num_speculative_tokens: usize,
}

/// The cache plan derived from the config and the model's geometry: the K/V budget split into
/// state checkpoint slots and K/V blocks, with the arithmetic the server prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePlan {
    pub num_blocks: usize,
    pub block_size: usize,
    pub interval: usize,
    /// A checkpoint's state in blocks (rounded up): what one costs in the per-request count.
    pub checkpoint_blocks: usize,
    /// GDN state checkpoints held at most, each in a state slot of its own.
    pub checkpoint_slots: usize,
    /// The budget split: `num_blocks` blocks of `block_bytes` and `checkpoint_slots` states.
    pub budget_bytes: usize,
    pub block_bytes: usize,
    /// Bytes of a block kept in pinned host memory besides `block_bytes` (QSA K/V rows under
    /// `--qsa-kv-offload`; 0 without).
    pub host_block_bytes: usize,
    pub state_bytes: usize,
    pub max_model_len: usize,
    /// K/V blocks one request of `max_model_len` takes.
    pub request_blocks: usize,
    /// State checkpoints one such request takes (one per interval and its prompt's last block).
    pub request_checkpoints: usize,
    /// Requests of `max_model_len` whose K/V blocks fit at once.
    pub requests: usize,
    /// Of those, the requests whose checkpoints all have a slot too.
    pub requests_checkpointed: usize,
}

impl CachePlan {
    /// Blocks one request of `max_model_len` takes, its checkpoints counted in blocks.
    pub fn request_units(&self) -> usize {
        self.request_blocks + self.request_checkpoints * self.checkpoint_blocks
    }

    /// State slots the executor reserves: `max_num_seqs` running sequences (twice as many when they
    /// draft: each keeps the state from before its verify step) and the checkpoints.
    pub fn state_slots(&self, max_num_seqs: usize, drafting: bool) -> usize {
        max_num_seqs * (1 + usize::from(drafting)) + self.checkpoint_slots
    }

    /// Pinned host memory the blocks take (0 unless QSA K/V rows live in host memory).
    pub fn host_bytes(&self) -> usize {
        self.num_blocks * self.host_block_bytes
    }

    /// The block arithmetic, one line (the server's log and `sanmai plan` print it).
    pub fn describe(&self) -> String {
        let host = match self.host_block_bytes {
            0 => String::new(),
            b => format!(
                "; QSA K/V rows in pinned host memory: {} bytes ({b} bytes per block)",
                self.host_bytes()
            ),
        };
        format!(
            "K/V cache: {} bytes = {} blocks of {} tokens ({} bytes per block) + {} state checkpoint \
             slots of {} bytes; a {}-token request takes {} blocks ({} of K/V + {} checkpoints of {} \
             blocks, one per {} tokens and the prompt's last block), so {} fit at once, {} of them with all \
             their checkpoints{host}",
            self.budget_bytes,
            self.num_blocks,
            self.block_size,
            self.block_bytes,
            self.checkpoint_slots,
            self.state_bytes,
            self.max_model_len,
            self.request_units(),
            self.request_blocks,
            self.request_checkpoints,
            self.checkpoint_blocks,
            self.interval,
            self.requests,
            self.requests_checkpointed
        )
    }
}

impl EngineConfig {
    /// Tokens between GDN state checkpoints: `--state-checkpoint-interval`, else sized so that a
    /// checkpoint costs no more than the K/V of the tokens it covers (64 blocks at least).
    pub fn checkpoint_interval(&self, g: &CacheGeometry) -> Result<usize, String> {
        let bs = self.block_size.max(1);
        match self.state_checkpoint_interval {
            Some(i) if i == 0 || i % bs != 0 => Err(format!(
                "--state-checkpoint-interval {i} must be a positive multiple of the block size {bs}"
            )),
            Some(i) => Ok(i),
            None => Ok((g.state_bytes / g.kv_bytes_per_token.max(1))
                .next_multiple_of(bs)
                .max(64 * bs)),
        }
    }

    /// State checkpoints one request of `max_model_len` takes (one per interval and its prompt's
    /// last block; none without prefix caching or GDN state).
    pub fn request_checkpoints(&self, g: &CacheGeometry) -> Result<usize, String> {
        Ok(if self.enable_prefix_caching && g.state_bytes > 0 {
            self.max_model_len / self.checkpoint_interval(g)? + 1
        } else {
            0
        })
    }

    /// Splits `kv_cache_memory_bytes` into state checkpoint slots (those of the requests of
    /// `max_model_len` that fit) and K/V blocks, and sets the checkpoint interval.
    pub fn cache_plan(&self, g: CacheGeometry) -> Result<CachePlan, String> {
        let bs = self.block_size.max(1);
        let budget = self.kv_cache_memory_bytes;
        let block_bytes = (g.kv_bytes_per_token * bs).max(1);
        let needed = self.max_model_len.div_ceil(bs) + 1;
        let interval = self.checkpoint_interval(&g)?;
        let checkpoint_blocks = g.state_bytes.div_ceil(block_bytes).max(1);
        let request_blocks = self.max_model_len.div_ceil(bs);
        let request_checkpoints = self.request_checkpoints(&g)?;
        // The checkpoints of the requests that fit with theirs (of one at least), as many as
        // leave one request's blocks.
        let units = budget / block_bytes;
        let with_checkpoints =
            units / (request_blocks + request_checkpoints * checkpoint_blocks).max(1);
        let spare = budget.saturating_sub(needed * block_bytes);
        let checkpoint_slots =
            (with_checkpoints.max(1) * request_checkpoints).min(spare / g.state_bytes.max(1));
        let num_blocks = (budget - checkpoint_slots * g.state_bytes) / block_bytes;
        if num_blocks < needed {
            return Err(format!(
                "the K/V cache budget of {budget} bytes holds {num_blocks} blocks of {bs} tokens ({block_bytes} bytes each), \
                 but one request of max_model_len {} needs {needed}: raise --kv-cache-memory-bytes or lower --max-model-len",
                self.max_model_len
            ));
        }
        Ok(CachePlan {
            num_blocks,
            block_size: bs,
            interval,
            checkpoint_blocks,
            checkpoint_slots,
            budget_bytes: budget,
            block_bytes,
            host_block_bytes: g.host_kv_bytes_per_token * bs,
            state_bytes: g.state_bytes,
            max_model_len: self.max_model_len,
            request_blocks,
            request_checkpoints,
            requests: num_blocks / request_blocks.max(1),
            requests_checkpointed: match request_checkpoints {
                0 => num_blocks / request_blocks.max(1),
                c => (checkpoint_slots / c).min(num_blocks / request_blocks.max(1)),
            },
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
    tracing::info!(
        blocks = plan.num_blocks,
        block_size = plan.block_size,
        state_checkpoint_interval = plan.interval,
        checkpoint_slots = plan.checkpoint_slots,
        "{}",
        plan.describe()
    );
    executor
        .init_cache(plan.num_blocks, plan.block_size)
        .map_err(|e| format!("allocating the K/V cache: {e}"))?;
    executor
        .reserve_states(plan.state_slots(cfg.max_num_seqs, cfg.num_speculative_tokens > 0))
        .map_err(|e| format!("allocating the state slots: {e}"))?;
    let cache = CacheManager::new(
        plan.num_blocks,
        plan.block_size,
        cfg.enable_prefix_caching,
        g.state_bytes > 0,
        plan.interval,
        plan.checkpoint_slots,
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
    let per_pos = vec![0; cfg.num_speculative_tokens];
    let mut engine = Engine {
        cache,
        sampler: Sampler::new(cfg.valid_vocab),
        cfg,
        executor,
        tokenizer,
        rx,
        waiting: VecDeque::new(),
        running: Vec::new(),
        in_flight: 0,
        metrics: metrics.clone(),
        limits: limits.clone(),
        stats: MetricsSnapshot {
            // Drafting shows its counters from the start.
            spec_decode_num_accepted_tokens_per_pos_total: per_pos,
            ..MetricsSnapshot::default()
        },
        masks: MaskWorkers::new(2),
        history_tokens: g.history_tokens,
    };
    let thread = std::thread::Builder::new()
        .name("sanmai-engine".into())
        .spawn(move || engine.run())
        .expect("spawning the engine thread");
    Ok(EngineHandle {
        tx,
        info,
        metrics,
        limits,
        images: None,
        thread: Arc::new(Mutex::new(Some(thread))),
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
    /// Steps submitted and not yet processed.
    in_flight: usize,
    metrics: Arc<Mutex<MetricsSnapshot>>,
    limits: Arc<Limits>,
    stats: MetricsSnapshot,
    /// Grammar mask workers (structured output).
    masks: MaskWorkers,
    /// Tokens before a chunk each step carries (the executor's [`CacheGeometry::history_tokens`]).
    history_tokens: usize,
}

impl<E: Executor> Engine<E> {
    fn run(&mut self) {
        loop {
            if self.waiting.is_empty() && self.running.is_empty() && self.in_flight == 0 {
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
            self.advance();
            self.publish();
        }
    }

    /// Applies a command; false means stop the loop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(req, max_tokens, tx, constraint) => {
                let mut seq = Sequence::new(*req, tx, self.tokenizer.as_ref(), max_tokens);
                if let Some(c) = constraint {
                    // The first mask is computed while the prompt is prefilled.
                    let mut c = Constrained::new(*c);
                    c.request_mask(&mut self.masks);
                    seq.constraint = Some(c);
                }
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
                    if self.running[i].in_flight {
                        // Its step may still be writing its blocks: finish it when the step returns.
                        self.running[i].abort_requested = true;
                    } else {
                        let seq = self.running.remove(i);
                        self.finish(seq, FinishReason::Abort, None);
                    }
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
        while self.in_flight > 0 {
            self.collect();
        }
        while let Some(seq) = self.waiting.pop_front() {
            self.limits.waiting.fetch_sub(1, Ordering::Relaxed);
            self.finish(seq, FinishReason::Abort, None);
        }
        for seq in std::mem::take(&mut self.running) {
            self.finish(seq, FinishReason::Abort, None);
        }
    }

    /// Submits a step if the executor has room and there is work; otherwise waits for the oldest step in
    /// flight and processes it.
    fn advance(&mut self) {
        let started = Instant::now();
        self.sample_deferred();
        self.stats.overhead_seconds_total += started.elapsed().as_secs_f64();
        if self.in_flight < self.executor.max_in_flight().max(1) {
            let started = Instant::now();
            let plan = self.schedule();
            self.stats.overhead_seconds_total += started.elapsed().as_secs_f64();
            if !plan.chunks.is_empty() {
                for c in &plan.chunks {
                    if let Some(s) = self.running.iter_mut().find(|s| s.state() == Some(c.state)) {
                        s.in_flight = true;
                    }
                }
                let started = Instant::now();
                self.executor.submit(plan);
                self.stats.execute_seconds_total += started.elapsed().as_secs_f64();
                self.in_flight += 1;
                if self.in_flight < self.executor.max_in_flight() {
                    return;
                }
            } else if self.in_flight == 0 {
                // Nothing to run: only late grammar masks are awaited.
                if let Some(c) = self
                    .running
                    .iter()
                    .find(|s| s.deferred)
                    .and_then(|s| s.constraint.as_ref())
                {
                    c.wait(Duration::from_millis(2));
                }
            }
        }
        if self.in_flight > 0 {
            self.collect();
        }
    }

    /// Waits for the oldest step in flight and processes its results.
    fn collect(&mut self) {
        let started = Instant::now();
        let (plan, out) = self.executor.wait();
        self.stats.execute_seconds_total += started.elapsed().as_secs_f64();
        self.in_flight -= 1;
        let started = Instant::now();
        self.process(plan, out);
        self.stats.overhead_seconds_total += started.elapsed().as_secs_f64();
        self.stats.steps_total += 1;
    }

    fn finish(&mut self, mut seq: Sequence, reason: FinishReason, stop: Option<StopReason>) {
        if let Some(c) = seq.cache.take() {
            self.cache.free(&mut self.executor, c);
        }
        if let Some(s) = seq.snapshot.take() {
            self.executor.free_state(s);
        }
        self.executor.cancel_prefetch(seq.key());
        self.stats.requests_finished_total += 1;
        self.stats
            .e2e_request_latency
            .observe(seq.arrived.elapsed().as_secs_f64());
        let usage = seq.usage();
        // A client that reads /metrics after its response sees the request counted.
        self.publish();
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
        self.stats.ple = self.executor.ple_metrics();
        self.stats.stages = self.executor.stage_times();
        self.stats.kv_host = self.executor.kv_host_stats();
        self.stats.fault = self.executor.fault();
        *self.metrics.lock().unwrap() = self.stats.clone();
    }
}
