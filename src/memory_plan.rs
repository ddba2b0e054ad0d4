//! The memory plan of a GPU: after the weights are loaded, one profiling step of the largest size the
//! engine will schedule shows what the activations take at their peak; what is left under
//! `--gpu-memory-utilization` goes to the sequences' GDN state slots and then to K/V blocks and state
//! checkpoints. The plan is printed, and the server refuses to start, with the numbers, when a request
//! of the full context length would not fit.

use anyhow::{bail, Result};
use sanmai_model::{Backend, Model, OutRows, StepChunk, StepInput, StepStart};

/// What the device tells the plan.
pub struct GpuMemory {
    /// Total device memory.
    pub total: usize,
    /// Device memory the weights occupy.
    pub weights: usize,
    /// Free device memory now (every process's use counted).
    pub free: Box<dyn Fn() -> Result<usize> + Send + Sync>,
}

/// The plan's inputs from the engine flags.
pub struct PlanInput {
    pub utilization: f64,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub valid_vocab: usize,
    /// `--kv-cache-memory-bytes`, when given.
    pub kv_cache_memory_bytes: Option<usize>,
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(b: usize) -> String {
    format!("{:.2} GiB", b as f64 / GIB)
}

/// The plan of every stage's GPU; returns the engine's K/V budget in bytes (whole-model blocks).
pub fn plan_stages<B: Backend>(
    stages: &[Model<B>],
    gpus: &[GpuMemory],
    p: &PlanInput,
) -> Result<usize> {
    match (stages, gpus) {
        ([model], [gpu]) => plan(model, gpu, p),
        _ => bail!(
            "the GPU memory plan of {} pipeline stages is not written yet",
            stages.len()
        ),
    }
}

/// Runs the profiling step and returns the bytes for K/V blocks and state checkpoints.
fn plan<B: Backend>(model: &Model<B>, gpu: &GpuMemory, p: &PlanInput) -> Result<usize> {
    if !(p.utilization > 0.0 && p.utilization <= 1.0) {
        bail!(
            "--gpu-memory-utilization {} must be in (0, 1]",
            p.utilization
        );
    }
    // The largest step: a prefill chunk of the whole token budget, with logits for every row (a
    // request asking for prompt log-probabilities).
    let t = p.max_num_batched_tokens;
    let blocks: Vec<u32> = (0..t.div_ceil(p.block_size) as u32).collect();
    model.init_cache(blocks.len(), p.block_size)?;
    let slot = model.backend.alloc_state()?;
    let ids: Vec<u32> = (0..t)
        .map(|i| ((i * 7919 + 13) % p.valid_vocab.max(1)) as u32)
        .collect();
    let chunk = StepChunk {
        tokens: &ids,
        history: &[],
        pos0: 0,
        state: slot,
        blocks: &blocks,
        out: OutRows::All,
    };
    let out = model.step(StepInput {
        chunks: &[chunk],
        start: StepStart::Tokens,
        hidden: false,
    })?;
    if let Some(logits) = out.logits {
        model.backend.to_host(logits)?;
    }
    model.backend.free_state(slot);
    model.init_cache(0, p.block_size)?;
    let used = gpu.total.saturating_sub((gpu.free)()?);
    let budget = (gpu.total as f64 * p.utilization) as usize;
    let workspace = used.saturating_sub(gpu.weights);
    // Live GDN state (recurrent state in f32) of every sequence that may run at once.
    let state_per_seq = model.state_bytes(4);
    let states = p.max_num_seqs * state_per_seq;
    let left = budget.saturating_sub(used + states);
    let kv = p.kv_cache_memory_bytes.unwrap_or(left);
    let per_token = model.kv_bytes_per_token(B::CACHE_ELEM_BYTES).max(1);
    let one_request = p.max_model_len * per_token + state_per_seq;
    tracing::info!(
        "memory plan: {} of {} ({:.0}%): weights {}, activations and runtime {} (profiled at {t} tokens), \
         GDN state of {} sequences {}, K/V blocks and state checkpoints {} ({} tokens of K/V)",
        gib(budget),
        gib(gpu.total),
        100.0 * p.utilization,
        gib(gpu.weights),
        gib(workspace),
        p.max_num_seqs,
        gib(states),
        gib(kv),
        kv / per_token
    );
    if kv > left {
        bail!(
            "--kv-cache-memory-bytes {kv} ({}) does not fit: {} of the device under \
             --gpu-memory-utilization {} minus weights {}, activations {} and GDN state {} leaves {}",
            gib(kv),
            gib(budget),
            p.utilization,
            gib(gpu.weights),
            gib(workspace),
            gib(states),
            gib(left)
        );
    }
    if kv < one_request {
        bail!(
            "the K/V cache gets {} but one request of --max-model-len {} needs {}: lower --max-model-len \
             or --max-num-seqs ({} sequences' GDN state take {}), or raise --gpu-memory-utilization \
             (weights {}, activations {} of {} usable)",
            gib(kv),
            p.max_model_len,
            gib(one_request),
            p.max_num_seqs,
            gib(states),
            gib(gpu.weights),
            gib(workspace),
            gib(budget)
        );
    }
    Ok(kv)
}
