//! The executor seam: the engine loop submits [`StepPlan`]s to an [`Executor`] and waits for their logits
//! (or, when every row of a step says how to draw its token and the executor samples where the logits
//! are, for the sampled tokens: see [`ChunkSampling`]).
//! An executor may keep several steps in flight (pipeline stages on several GPUs: microbatches of different
//! sequences overlap); the engine never schedules a sequence again before its previous step has returned.
//! [`ModelExecutor`] runs a [`Model`] on one backend, one step at a time.

use std::collections::VecDeque;

use sanmai_model::sample::RowSampling;
use sanmai_model::{
    Backend, KvHostStats, Model, OpResult, PleSource, SampleCall, StepChunk, StepEmbeds, StepError,
    StepInput, StepMultimodal, StepOutput, StepStart,
};
use sanmai_ple::{PrefetchOptions, Prefetcher};

pub use crate::step::{ChunkSampling, LogitRows, PlannedChunk, SpecChunk, StepLogits, StepPlan};

/// Sizes the engine needs to plan its cache budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheGeometry {
    /// K/V bytes of one token across all attention layers, on the device.
    pub kv_bytes_per_token: usize,
    /// K/V bytes of one token kept in pinned host memory (QSA K/V rows under `--qsa-kv-offload`).
    pub host_kv_bytes_per_token: usize,
    /// Bytes of one GDN state (all GDN layers); 0 for models without GDN layers.
    pub state_bytes: usize,
    /// Tokens before a chunk that a step needs besides the caches (see [`PlannedChunk::history`]).
    pub history_tokens: usize,
}

/// Runs steps for the engine loop and owns the device-side caches they use.
pub trait Executor: Send {
    fn geometry(&self) -> CacheGeometry;
    /// Allocates the K/V block pool.
    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), String>;
    /// A zeroed GDN state slot, or why none could be had (the device is out of memory).
    fn alloc_state(&mut self) -> Result<usize, String>;
    /// Sizes the state slot pool for `slots` live slots, allocated now and never grown: past them
    /// [`Executor::alloc_state`] fails.
    fn reserve_states(&mut self, slots: usize) -> Result<(), String>;
    fn free_state(&mut self, slot: usize);
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), String>;
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String>;
    /// A request whose prompt positions from `from` on will be computed was admitted: an executor that
    /// reads per-token data from disk (the PLE table) may start requesting it now.
    fn prefetch(&mut self, request: u64, prompt: &[u32], from: usize) {
        let _ = (request, prompt, from);
    }
    /// The request finished or was preempted: drop what is pending for it.
    fn cancel_prefetch(&mut self, request: u64) {
        let _ = request;
    }
    /// The PLE table's read counters, when the model reads one.
    fn ple_metrics(&self) -> Option<sanmai_ple::PleMetricsSnapshot> {
        None
    }
    /// What the QSA K/V host pool has served (row-cache hits and misses per QSA layer, bytes read
    /// from host memory), when the model keeps its QSA K/V rows in host memory (`--qsa-kv-offload`);
    /// `None` otherwise. Read between steps, or while they run.
    fn kv_host_stats(&self) -> Option<KvHostStats> {
        None
    }
    /// Whether the executor samples a step's tokens itself when every row of it carries a
    /// [`ChunkSampling`] (the engine then attaches them; otherwise it samples on the host).
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Steps that may be in flight at once (1: each step finishes before the next is submitted).
    fn max_in_flight(&self) -> usize {
        1
    }
    /// Each pipeline stage's busy and idle time so far (empty for an executor without stages).
    fn stage_times(&self) -> Vec<crate::api::StageTimes> {
        Vec::new()
    }
    /// Why the executor can no longer run steps (a pipeline stage stopped), if it cannot.
    fn fault(&self) -> Option<String> {
        None
    }
    /// Starts a step.
    fn submit(&mut self, plan: StepPlan);
    /// Waits for the oldest step in flight and returns its plan with its logits, or the reason it failed.
    fn wait(&mut self) -> (StepPlan, Result<StepLogits, String>);
}

/// An executor over a model on one backend: a step runs to completion when it is submitted. A model
/// with a PLE table gets a page prefetch thread for admitted prompts, paced by the prefill.
pub struct ModelExecutor<B: Backend> {
    pub model: Model<B>,
    done: VecDeque<(StepPlan, Result<StepLogits, String>)>,
    prefetcher: Option<Prefetcher>,
    device_sampling: bool,
}

impl<B: Backend> ModelExecutor<B> {
    /// An executor with the default PLE page prefetch (on).
    pub fn new(model: Model<B>) -> Self {
        Self::with_prefetch(model, PrefetchOptions::default())
    }

    /// An executor whose PLE prefetch thread (for a model with a PLE table) runs as `opts` say.
    pub fn with_prefetch(model: Model<B>, opts: PrefetchOptions) -> Self {
        let prefetcher = match &model.ple {
            Some((_, PleSource::Table(t))) if opts.enabled => {
                Some(Prefetcher::spawn(t.clone(), opts))
            }
            _ => None,
        };
        let device_sampling = model.backend.device_sampling();
        ModelExecutor {
            model,
            done: VecDeque::new(),
            prefetcher,
            device_sampling,
        }
    }

    /// Samples through [`Backend::sample`] (`true`; the default where the backend samples on the
    /// device) or returns logits for the engine to sample (`false`).
    pub fn set_device_sampling(&mut self, on: bool) {
        self.device_sampling = on;
    }
}

impl<B: Backend> Executor for ModelExecutor<B> {
    fn geometry(&self) -> CacheGeometry {
        geometry_of(&self.model)
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
        match &self.model.ple {
            Some((_, PleSource::Table(t))) => Some(t.metrics().snapshot()),
            _ => None,
        }
    }

    /// The backend's counters; a backend that fails to read them reports none.
    fn kv_host_stats(&self) -> Option<KvHostStats> {
        self.model.backend.kv_host_stats().ok().flatten()
    }

    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), String> {
        self.model
            .init_cache(num_blocks, block_size)
            .map_err(|e| e.to_string())
    }

    fn samples_on_device(&self) -> bool {
        self.device_sampling
    }

    fn alloc_state(&mut self) -> Result<usize, String> {
        self.model.backend.alloc_state().map_err(|e| e.to_string())
    }

    fn reserve_states(&mut self, slots: usize) -> Result<(), String> {
        self.model
            .backend
            .reserve_states(slots)
            .map_err(|e| e.to_string())
    }

    fn free_state(&mut self, slot: usize) {
        self.model.backend.free_state(slot);
    }

    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), String> {
        self.model
            .backend
            .copy_state(src, dst)
            .map_err(|e| e.to_string())
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
        self.model
            .backend
            .copy_block(src, dst)
            .map_err(|e| e.to_string())
    }

    fn submit(&mut self, plan: StepPlan) {
        // A failed step fails its requests, not the engine.
        let out = run_step(&self.model, &plan).map_err(|e| e.to_string());
        if let Some(p) = &self.prefetcher {
            for c in &plan.chunks {
                p.progress(c.request, c.pos0 + c.tokens.len());
            }
        }
        self.done.push_back((plan, out));
    }

    fn wait(&mut self) -> (StepPlan, Result<StepLogits, String>) {
        self.done
            .pop_front()
            .expect("wait() without a step in flight")
    }
}

/// The cache sizes of `m`'s layers (a whole model or one pipeline stage).
pub(crate) fn geometry_of<B: Backend>(m: &Model<B>) -> CacheGeometry {
    CacheGeometry {
        kv_bytes_per_token: m.kv_bytes_per_token(B::CACHE_ELEM_BYTES),
        host_kv_bytes_per_token: m.kv_host_bytes_per_token(B::CACHE_ELEM_BYTES),
        // The recurrent state is f32 on every backend.
        state_bytes: m.state_bytes(4),
        history_tokens: m
            .cfg
            .ple
            .as_ref()
            .map_or(0, |p| p.orders.iter().max().map_or(0, |o| o - 1)),
    }
}

/// Each logit row's sampling (in chunk order): the [`ChunkSampling`]s of a chunk that carries one
/// per logit row, `None` for a row whose logits go to the host; with the rows' vocabulary.
fn device_rows(plan: &StepPlan) -> (usize, Vec<Option<RowSampling<'_>>>) {
    let mut vocab = None;
    let mut rows = Vec::new();
    for c in &plan.chunks {
        let n = c.logits.count(c.tokens.len());
        if c.sampling.len() != n || n == 0 {
            rows.extend((0..n).map(|_| None));
            continue;
        }
        for s in &c.sampling {
            let v = *vocab.get_or_insert(s.valid_vocab);
            assert_eq!(
                v, s.valid_vocab,
                "the sampled rows of a step share one vocabulary"
            );
            rows.push(Some(s.row()));
        }
    }
    (vocab.unwrap_or(0), rows)
}

/// The last stage's answer to a step: the sampled tokens or logits of [`finish_step`], and the MTP
/// head's drafts ([`crate::mtp::propose`]) when a chunk asks for them (`out` then carries every
/// row's hidden state).
pub(crate) fn answer<B: Backend>(
    m: &Model<B>,
    plan: &StepPlan,
    out: StepOutput<B::Tensor>,
) -> OpResult<StepLogits> {
    let mut answer = match out.logits {
        Some(logits) => finish_step(m, plan, logits)?,
        None => StepLogits::default(),
    };
    if let Some(h) = out.hidden.filter(|_| wants_hidden(plan)) {
        (answer.drafts, answer.draft_logits) = crate::mtp::propose(m, plan, &h, &answer)?;
    }
    Ok(answer)
}

/// Whether a step's last stage keeps every row's hidden state for the MTP head.
pub(crate) fn wants_hidden(plan: &StepPlan) -> bool {
    plan.chunks.iter().any(|c| c.spec.is_some())
}

/// The step's result from its logits: the rows that carry their [`ChunkSampling`] are sampled by
/// the backend and only the others' logits are copied to the host.
pub(crate) fn finish_step<B: Backend>(
    m: &Model<B>,
    plan: &StepPlan,
    logits: B::Tensor,
) -> OpResult<StepLogits> {
    let (vocab, rows) = device_rows(plan);
    let on_device: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].is_some()).collect();
    let host: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].is_none()).collect();
    if on_device.is_empty() {
        let (n, width, data) = m.backend.to_host(logits)?;
        return Ok(StepLogits {
            width,
            rows: data,
            host: (0..n).collect(),
            ..StepLogits::default()
        });
    }
    let (mut out, logits) = if host.is_empty() {
        (StepLogits::default(), logits)
    } else {
        let (_, width, data) = m.backend.to_host(m.backend.rows(&logits, &host)?)?;
        let picked = m.backend.rows(&logits, &on_device)?;
        (
            StepLogits {
                width,
                rows: data,
                host,
                ..StepLogits::default()
            },
            picked,
        )
    };
    let params: Vec<RowSampling<'_>> = rows.iter().flatten().copied().collect();
    let call = SampleCall {
        valid_vocab: vocab,
        rows: &params,
    };
    let mut drawn = m.backend.sample(logits, &call)?.into_iter();
    out.sampled = rows
        .iter()
        .map(|r| {
            r.as_ref().map(|_| match drawn.next() {
                Some(s) => s.map_err(|e| e.to_string()),
                None => Err("the backend drew no token for this row".to_string()),
            })
        })
        .collect();
    Ok(out)
}

/// The model's view of a step's chunks.
pub(crate) fn step_chunks(plan: &StepPlan) -> Vec<StepChunk<'_>> {
    plan.chunks
        .iter()
        .map(|c| StepChunk {
            tokens: &c.tokens,
            history: &c.history,
            pos0: c.pos0,
            state: c.state,
            blocks: &c.blocks,
            out: c.logits,
        })
        .collect()
}

fn run_step<B: Backend>(m: &Model<B>, plan: &StepPlan) -> Result<StepLogits, StepError> {
    let chunks = step_chunks(plan);
    let input = StepInput {
        chunks: &chunks,
        start: StepStart::Tokens,
        hidden: wants_hidden(plan),
    };
    let out = if plan.chunks.iter().any(|c| c.images.is_some()) {
        let StepImages {
            positions,
            rows,
            values,
        } = step_images(plan);
        let embeds = match rows.is_empty() {
            true => None,
            false => Some(StepEmbeds {
                rows: &rows,
                values: m.backend.upload(rows.len(), m.cfg.hidden_size, values)?,
            }),
        };
        m.step_multimodal(
            input,
            StepMultimodal {
                positions: &positions,
                embeds,
            },
        )?
    } else {
        m.step(input)?
    };
    Ok(answer(m, plan, out)?)
}

/// A step's images, as the model takes them.
pub(crate) struct StepImages<'a> {
    /// Each chunk's explicit MRoPE positions (`None` for a plain chunk).
    pub positions: Vec<Option<&'a [[u32; 3]]>>,
    /// The step rows that take an image embedding, and their values `[rows, hidden]`.
    pub rows: Vec<usize>,
    pub values: Vec<f32>,
}

/// The images of a step's chunks.
pub(crate) fn step_images(plan: &StepPlan) -> StepImages<'_> {
    let mut positions = Vec::with_capacity(plan.chunks.len());
    let (mut rows, mut values) = (Vec::new(), Vec::new());
    let mut start = 0;
    for c in &plan.chunks {
        positions.push(c.images.as_ref().map(|i| i.positions.as_slice()));
        if let Some(i) = &c.images {
            rows.extend(i.rows.iter().map(|r| start + r));
            values.extend_from_slice(&i.embeds);
        }
        start += c.tokens.len();
    }
    StepImages {
        positions,
        rows,
        values,
    }
}
