//! [`PipelineExecutor`]: a model split into pipeline stages (contiguous layer ranges, each a
//! [`Model`] on its own backend), one worker thread per stage. The engine submits steps; stage 0
//! embeds and runs its layers, hands its residual streams to stage 1 ([`Backend::hand_over`] /
//! [`Backend::take_over`]: a move on the host, a device copy on one GPU; or a [`Backend::link_to`]
//! link: NCCL send/receive between two GPUs), and so on; the last
//! stage samples (or returns logits) and answers. Up to one step per stage is in flight, so with
//! several micro-batches every stage works at once.
//!
//! A stage prepares each step (its layout, PLE rows, device metadata) before it waits for the
//! previous stage's streams: the deferred receive, [`PipelineOptions::deferred_receive`]. Cache
//! operations (state slots, block copies, the K/V pool) are applied to every stage by the engine
//! thread; they touch only slots and blocks of sequences with no step in flight, and each backend
//! orders them with its own work. A stage whose step fails passes the failure down the pipeline, so
//! the step's requests fail and no stage waits forever; a stage thread that stops (a panic) is a
//! fault every later step reports, and [`Executor::fault`] says so.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use sanmai_model::{
    Backend, Handover, KvHostStats, Model, PleSource, StageRecv, StageSend, StepEmbeds, StepStart,
};
use sanmai_ple::{PrefetchOptions, Prefetcher};

use crate::api::StageTimes;
use crate::executor::{answer, geometry_of, step_chunks, step_images, wants_hidden};
use crate::executor::{CacheGeometry, Executor};
use crate::executor::{StepLogits, StepPlan};

/// How a pipeline runs.
#[derive(Debug, Clone, Copy)]
pub struct PipelineOptions {
    /// Prepare a step before waiting for the previous stage's streams (off: wait, then prepare; the
    /// order of device work is the same either way).
    pub deferred_receive: bool,
    /// Sample on the last stage's device when its backend can.
    pub device_sampling: bool,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            deferred_receive: true,
            device_sampling: true,
        }
    }
}

/// A step as the stages see it.
struct Job {
    id: u64,
    plan: Arc<StepPlan>,
}

/// A stage's output for the next stage, or why the step failed upstream.
struct Passed<T> {
    id: u64,
    streams: Result<Moved<T>, String>,
}

/// How a stage's residual streams reach the next stage.
enum Moved<T> {
    /// Handed over ([`Backend::hand_over`]).
    Handed(Handover<T>),
    /// Sent through the stages' link: the next stage receives a `[rows, cols]` tensor from it.
    Linked { rows: usize, cols: usize },
}

type Answer = (u64, Result<StepLogits, String>);

/// Busy and idle nanoseconds of one stage.
#[derive(Default)]
struct Clock {
    busy: AtomicU64,
    idle: AtomicU64,
}

impl Clock {
    fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The pipeline's stages, their worker threads and the steps in flight.
pub struct PipelineExecutor<B: Backend> {
    stages: Vec<Arc<Model<B>>>,
    jobs: Vec<Sender<Job>>,
    answers: Receiver<Answer>,
    in_flight: VecDeque<(u64, Arc<StepPlan>)>,
    next_id: u64,
    clocks: Vec<Arc<Clock>>,
    fault: Arc<Mutex<Option<String>>>,
    prefetcher: Option<Prefetcher>,
    device_sampling: bool,
    workers: Vec<JoinHandle<()>>,
}

impl<B: Backend + 'static> PipelineExecutor<B> {
    /// Starts one worker per stage. `stages` are the model's stages in layer order (the first holds
    /// layer 0, the last the final norm and lm_head, each starting where the previous one ends).
    pub fn new(
        stages: Vec<Model<B>>,
        ple: PrefetchOptions,
        opts: PipelineOptions,
    ) -> Result<Self, String> {
        check_stages(&stages)?;
        let stages: Vec<Arc<Model<B>>> = stages.into_iter().map(Arc::new).collect();
        let n = stages.len();
        let prefetcher = stages.iter().find_map(|m| match &m.ple {
            Some((_, PleSource::Table(t))) if ple.enabled => {
                Some(Prefetcher::spawn(t.clone(), ple))
            }
            _ => None,
        });
        let device_sampling = opts.device_sampling && stages[n - 1].backend.device_sampling();
        let fault = Arc::new(Mutex::new(None));
        let (answer_tx, answers) = channel();
        let mut jobs = Vec::with_capacity(n);
        let mut clocks = Vec::with_capacity(n);
        let mut workers = Vec::with_capacity(n);
        let mut from_prev: Option<Receiver<Passed<B::Tensor>>> = None;
        let mut link_in: Option<Box<dyn StageRecv<B::Tensor>>> = None;
        for (k, model) in stages.iter().enumerate() {
            let (link_out, next_in) = match stages.get(k + 1) {
                Some(next) => model
                    .backend
                    .link_to(&next.backend)
                    .map_err(|e| format!("linking pipeline stages {k} and {}: {e}", k + 1))?
                    .map_or((None, None), |(s, r)| (Some(s), Some(r))),
                None => (None, None),
            };
            let (job_tx, job_rx) = channel();
            jobs.push(job_tx);
            let clock = Arc::new(Clock::default());
            clocks.push(clock.clone());
            let (to_next, next_rx) = if k + 1 < n {
                let (tx, rx) = channel();
                (Some(tx), Some(rx))
            } else {
                (None, None)
            };
            let worker = Worker {
                stage: k,
                model: model.clone(),
                jobs: job_rx,
                from_prev: from_prev.take(),
                to_next,
                link_in: link_in.take(),
                link_out,
                answers: (k + 1 == n).then(|| answer_tx.clone()),
                opts: PipelineOptions {
                    device_sampling,
                    ..opts
                },
                clock,
                fault: fault.clone(),
            };
            from_prev = next_rx;
            link_in = next_in;
            let handle = std::thread::Builder::new()
                .name(format!("sanmai-stage-{k}"))
                .spawn(move || worker.run())
                .map_err(|e| format!("starting the thread of pipeline stage {k}: {e}"))?;
            workers.push(handle);
        }
        Ok(PipelineExecutor {
            stages,
            jobs,
            answers,
            in_flight: VecDeque::new(),
            next_id: 0,
            clocks,
            fault,
            prefetcher,
            device_sampling,
            workers,
        })
    }

    /// Applies a cache operation to every stage, stopping at the first failure.
    fn each<T>(
        &self,
        what: &str,
        mut f: impl FnMut(&Model<B>) -> Result<T, String>,
    ) -> Result<Vec<T>, String> {
        self.stages
            .iter()
            .enumerate()
            .map(|(k, m)| f(m).map_err(|e| format!("{what} on pipeline stage {k}: {e}")))
            .collect()
    }
}

/// The stages' QSA K/V host counters as one: the layers of all of them in ascending order (a layer
/// met twice has its counts added), the bytes added; `None` without any.
fn merge_kv_host(parts: impl IntoIterator<Item = KvHostStats>) -> Option<KvHostStats> {
    let mut merged: Option<KvHostStats> = None;
    for part in parts {
        let m = merged.get_or_insert_with(KvHostStats::default);
        m.host_bytes_read += part.host_bytes_read;
        for l in part.layers {
            match m.layers.binary_search_by_key(&l.layer, |x| x.layer) {
                Ok(i) => {
                    m.layers[i].hits += l.hits;
                    m.layers[i].misses += l.misses;
                }
                Err(i) => m.layers.insert(i, l),
            }
        }
    }
    merged
}

/// The stages must tile the model's layers in order.
fn check_stages<B: Backend>(stages: &[Model<B>]) -> Result<(), String> {
    let Some(first) = stages.first() else {
        return Err("a pipeline needs at least one stage".into());
    };
    let mut next = 0;
    for (k, m) in stages.iter().enumerate() {
        if m.stage.start != next {
            return Err(format!(
                "pipeline stage {k} holds layers {:?} but the previous stage ends at layer {next}",
                m.stage
            ));
        }
        next = m.stage.end;
    }
    if next != first.cfg.num_layers {
        return Err(format!(
            "the pipeline's stages end at layer {next} of {}",
            first.cfg.num_layers
        ));
    }
    Ok(())
}

impl<B: Backend + 'static> Executor for PipelineExecutor<B> {
    fn geometry(&self) -> CacheGeometry {
        // A block holds its positions on every stage: the whole model's bytes per token.
        let parts: Vec<CacheGeometry> = self.stages.iter().map(|m| geometry_of(m)).collect();
        CacheGeometry {
            kv_bytes_per_token: parts.iter().map(|g| g.kv_bytes_per_token).sum(),
            host_kv_bytes_per_token: parts.iter().map(|g| g.host_kv_bytes_per_token).sum(),
            state_bytes: parts.iter().map(|g| g.state_bytes).sum(),
            history_tokens: parts.iter().map(|g| g.history_tokens).max().unwrap_or(0),
        }
    }

    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), String> {
        self.each("allocating the K/V cache", |m| {
            m.init_cache(num_blocks, block_size)
                .map_err(|e| e.to_string())
        })
        .map(drop)
    }

    fn alloc_state(&mut self) -> Result<usize, String> {
        let mut slots = Vec::with_capacity(self.stages.len());
        for (k, m) in self.stages.iter().enumerate() {
            match m.backend.alloc_state() {
                Ok(s) => slots.push(s),
                Err(e) => {
                    for (m, &s) in self.stages.iter().zip(&slots) {
                        m.backend.free_state(s);
                    }
                    return Err(format!("a state slot on pipeline stage {k}: {e}"));
                }
            }
        }
        // Every stage saw the same allocations and frees in the same order.
        if slots.iter().any(|&s| s != slots[0]) {
            for (m, &s) in self.stages.iter().zip(&slots) {
                m.backend.free_state(s);
            }
            return Err(format!(
                "the pipeline stages gave different state slots {slots:?}"
            ));
        }
        Ok(slots[0])
    }

    fn reserve_states(&mut self, slots: usize) -> Result<(), String> {
        self.each("reserving the state slots", |m| {
            m.backend.reserve_states(slots).map_err(|e| e.to_string())
        })
        .map(drop)
    }

    fn free_state(&mut self, slot: usize) {
        for m in &self.stages {
            m.backend.free_state(slot);
        }
    }

    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), String> {
        self.each("copying a state slot", |m| {
            m.backend.copy_state(src, dst).map_err(|e| e.to_string())
        })
        .map(drop)
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
        self.each("copying a K/V block", |m| {
            m.backend.copy_block(src, dst).map_err(|e| e.to_string())
        })
        .map(drop)
    }

    fn prefetch(&mut self, request: u64, prompt: &[u32], from: usize) {
        if let Some(p) = &self.prefetcher {
            p.submit_from(request, prompt, from);
        }
    }

    fn cancel_prefetch(&mut self, request: u64) {
        if let Some(p) = &self.prefetcher {
            p.cancel(request);
        }
    }

    fn ple_metrics(&self) -> Option<sanmai_ple::PleMetricsSnapshot> {
        self.stages.iter().find_map(|m| match &m.ple {
            Some((_, PleSource::Table(t))) => Some(t.metrics().snapshot()),
            _ => None,
        })
    }

    /// Every stage's counters together: each stage's QSA layers (disjoint across stages) and the
    /// sum of their host bytes; `None` when no stage keeps its QSA K/V rows in host memory.
    fn kv_host_stats(&self) -> Option<KvHostStats> {
        merge_kv_host(
            self.stages
                .iter()
                .filter_map(|m| m.backend.kv_host_stats().ok().flatten()),
        )
    }

    fn samples_on_device(&self) -> bool {
        self.device_sampling
    }

    fn max_in_flight(&self) -> usize {
        self.stages.len()
    }

    fn stage_times(&self) -> Vec<StageTimes> {
        self.clocks
            .iter()
            .map(|c| StageTimes {
                busy_seconds: c.busy.load(Ordering::Relaxed) as f64 * 1e-9,
                idle_seconds: c.idle.load(Ordering::Relaxed) as f64 * 1e-9,
            })
            .collect()
    }

    fn fault(&self) -> Option<String> {
        self.fault.lock().unwrap().clone()
    }

    fn submit(&mut self, plan: StepPlan) {
        let id = self.next_id;
        self.next_id += 1;
        let plan = Arc::new(plan);
        for tx in &self.jobs {
            // A stage that stopped is found out when its answer does not come.
            let _ = tx.send(Job {
                id,
                plan: plan.clone(),
            });
        }
        self.in_flight.push_back((id, plan));
    }

    fn wait(&mut self) -> (StepPlan, Result<StepLogits, String>) {
        let (id, plan) = self
            .in_flight
            .pop_front()
            .expect("wait() without a step in flight");
        let out = match self.answers.recv() {
            Ok((got, out)) if got == id => out,
            Ok((got, _)) => Err(format!(
                "the pipeline answered step {got} while step {id} was due"
            )),
            Err(_) => Err(self
                .fault()
                .unwrap_or_else(|| "the pipeline's last stage stopped".into())),
        };
        if let Some(p) = &self.prefetcher {
            for c in &plan.chunks {
                p.progress(c.request, c.pos0 + c.tokens.len());
            }
        }
        let plan = Arc::try_unwrap(plan).unwrap_or_else(|p| (*p).clone());
        (plan, out)
    }
}

impl<B: Backend> Drop for PipelineExecutor<B> {
    fn drop(&mut self) {
        // Closing the job channels ends every worker after the steps it holds.
        self.jobs.clear();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// One stage's worker thread.
struct Worker<B: Backend> {
    stage: usize,
    model: Arc<Model<B>>,
    jobs: Receiver<Job>,
    from_prev: Option<Receiver<Passed<B::Tensor>>>,
    to_next: Option<Sender<Passed<B::Tensor>>>,
    /// The link from the previous stage, where the two backends have one.
    link_in: Option<Box<dyn StageRecv<B::Tensor>>>,
    /// The link to the next stage, where the two backends have one.
    link_out: Option<Box<dyn StageSend<B::Tensor>>>,
    answers: Option<Sender<Answer>>,
    opts: PipelineOptions,
    clock: Arc<Clock>,
    fault: Arc<Mutex<Option<String>>>,
}

impl<B: Backend> Worker<B> {
    fn run(self) {
        let stage = self.stage;
        let fault = self.fault.clone();
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve()));
        if let Err(p) = res {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            let msg = format!("pipeline stage {stage} stopped: {msg}");
            tracing::error!("{msg}");
            fault.lock().unwrap().get_or_insert(msg);
        }
    }

    fn serve(&self) {
        loop {
            let waiting = Instant::now();
            let Ok(job) = self.jobs.recv() else {
                return;
            };
            Clock::add(&self.clock.idle, waiting);
            let started = Instant::now();
            let mut idle_ns = 0u64;
            let out = self.step(&job, &mut idle_ns);
            let busy = started.elapsed().as_nanos() as u64;
            self.clock
                .busy
                .fetch_add(busy.saturating_sub(idle_ns), Ordering::Relaxed);
            self.clock.idle.fetch_add(idle_ns, Ordering::Relaxed);
            let sent = match (&self.to_next, &self.answers) {
                (Some(next), _) => next
                    .send(Passed {
                        id: job.id,
                        streams: out.map(|o| o.expect_streams()),
                    })
                    .is_ok(),
                (None, Some(answers)) => answers
                    .send((job.id, out.map(|o| o.expect_logits())))
                    .is_ok(),
                (None, None) => unreachable!("the last stage answers the engine"),
            };
            if !sent {
                // The next stage or the engine is gone: nothing is waiting for this stage.
                return;
            }
        }
    }

    /// Runs one step on this stage; `idle_ns` gets the time spent waiting for the previous stage.
    fn step(&self, job: &Job, idle_ns: &mut u64) -> Result<StageOut<B::Tensor>, String> {
        let m = &*self.model;
        let chunks = step_chunks(&job.plan);
        // Prompts with images: every stage turns their rows at the MRoPE positions; the first
        // stage takes the image rows' embeddings.
        let images = job
            .plan
            .chunks
            .iter()
            .any(|c| c.images.is_some())
            .then(|| step_images(&job.plan));
        let prepare = || match &images {
            Some(i) => m.prepare_multimodal(&chunks, &i.positions),
            None => m.prepare(&chunks),
        };
        let early = self
            .opts
            .deferred_receive
            .then(|| prepare().map_err(|e| e.to_string()));
        let start = match &self.from_prev {
            None => StepStart::Tokens,
            Some(rx) => {
                let waiting = Instant::now();
                let got = rx.recv();
                *idle_ns += waiting.elapsed().as_nanos() as u64;
                let passed =
                    got.map_err(|_| format!("pipeline stage {} stopped", self.stage - 1))?;
                // A linked send is received whatever else fails, so the link stays in step.
                let streams = match passed.streams? {
                    Moved::Handed(h) => m.backend.take_over(h),
                    Moved::Linked { rows, cols } => self
                        .link_in
                        .as_ref()
                        .ok_or_else(|| format!("pipeline stage {} has no link in", self.stage))?
                        .recv(rows, cols),
                }
                .map_err(|e| e.to_string())?;
                if passed.id != job.id {
                    return Err(format!(
                        "pipeline stage {} got step {} while step {} was due",
                        self.stage, passed.id, job.id
                    ));
                }
                StepStart::Streams(streams)
            }
        };
        let prepared = match early {
            Some(p) => p?,
            None => prepare().map_err(|e| e.to_string())?,
        };
        let embeds = match &images {
            Some(i) if self.from_prev.is_none() && !i.rows.is_empty() => Some(StepEmbeds {
                rows: &i.rows,
                values: m
                    .backend
                    .upload(i.rows.len(), m.cfg.hidden_size, i.values.clone())
                    .map_err(|e| e.to_string())?,
            }),
            _ => None,
        };
        let out = m
            .run_prepared_multimodal(prepared, start, wants_hidden(&job.plan), embeds.as_ref())
            .map_err(|e| e.to_string())?;
        if self.to_next.is_some() {
            let streams = out
                .streams
                .ok_or_else(|| format!("pipeline stage {} returned no streams", self.stage))?;
            let moved = match &self.link_out {
                Some(link) => {
                    let (rows, cols) = link.send(&streams).map_err(|e| e.to_string())?;
                    Moved::Linked { rows, cols }
                }
                None => Moved::Handed(m.backend.hand_over(streams).map_err(|e| e.to_string())?),
            };
            return Ok(StageOut::Streams(moved));
        }
        let logits = answer(m, &job.plan, out).map_err(|e| e.to_string())?;
        Ok(StageOut::Logits(logits))
    }
}

/// What a stage's step produced.
enum StageOut<T> {
    Streams(Moved<T>),
    Logits(StepLogits),
}

impl<T> StageOut<T> {
    fn expect_streams(self) -> Moved<T> {
        match self {
            StageOut::Streams(h) => h,
            StageOut::Logits(_) => unreachable!("a stage before the last hands over streams"),
        }
    }

    fn expect_logits(self) -> StepLogits {
        match self {
            StageOut::Logits(l) => l,
            StageOut::Streams(_) => unreachable!("the last stage returns logits"),
        }
    }
}

#[cfg(test)]
mod tests {
    use sanmai_model::RowCacheCounts;

    use super::*;

    fn counts(layer: usize, hits: u64, misses: u64) -> RowCacheCounts {
        RowCacheCounts {
            layer,
            hits,
            misses,
        }
    }

    #[test]
    fn kv_host_stats_merge_layers_in_order_and_add_bytes() {
        assert_eq!(merge_kv_host(Vec::new()), None);
        let a = KvHostStats {
            layers: vec![counts(7, 1, 2), counts(11, 3, 4)],
            host_bytes_read: 100,
        };
        let b = KvHostStats {
            layers: vec![counts(3, 5, 6), counts(9, 7, 8)],
            host_bytes_read: 20,
        };
        // A stage without QSA layers still counts as offloaded.
        let empty = KvHostStats::default();
        let merged = merge_kv_host([a.clone(), empty.clone(), b]).unwrap();
        let layers: Vec<usize> = merged.layers.iter().map(|l| l.layer).collect();
        assert_eq!(layers, [3, 7, 9, 11]);
        assert_eq!(merged.layers[1], counts(7, 1, 2));
        assert_eq!(merged.host_bytes_read, 120);
        assert_eq!(merge_kv_host([empty.clone()]), Some(empty));
        // A layer met twice adds up.
        let twice = merge_kv_host([a.clone(), a]).unwrap();
        assert_eq!(twice.layers, [counts(7, 2, 4), counts(11, 6, 8)]);
        assert_eq!(twice.host_bytes_read, 200);
    }
}
