//! The plan of the loaded stages: on GPUs, one profiling step per stage measures its activations.

use anyhow::Result;
use sanmai_engine::EngineConfig;
use sanmai_model::{Backend, Model, OutRows, StepChunk, StepInput, StepStart};

use super::{BudgetFlags, GpuMemory, MemoryPlan, StageMemory};
use crate::stages::Device;

/// The plan of the loaded stages. On GPUs (`gpus`, one per stage) each stage runs one profiling
/// step of the largest size the engine schedules, in order, and its activations are the drop in its
/// card's free memory over the step; what else the card holds (contexts, other processes) counts
/// on the first stage on it. Without GPUs the numbers are the loaded stages' sizes and the
/// activation estimate.
pub fn plan_loaded<B: Backend>(
    stages: &[Model<B>],
    devices: &[Device],
    gpus: &[GpuMemory],
    cfg: &EngineConfig,
    kv_cache_memory_bytes: Option<usize>,
    flags: &BudgetFlags,
) -> Result<MemoryPlan> {
    let t = cfg.max_num_batched_tokens;
    if gpus.is_empty() {
        let budgets = flags.stage_budgets(devices, &vec![None; devices.len()])?;
        let mem = stages
            .iter()
            .zip(devices)
            .zip(budgets)
            .map(|((m, &d), b)| StageMemory::loaded(m, d, t, b).offload_if(flags, &m.cfg))
            .collect();
        return MemoryPlan::new(mem, cfg, kv_cache_memory_bytes, flags);
    }
    let totals: Vec<Option<usize>> = gpus.iter().map(|g| Some(g.total)).collect();
    let budgets = flags.stage_budgets(devices, &totals)?;
    // Before any profiling: what each card holds besides the stages' weights and workspace.
    let mut other = vec![0usize; stages.len()];
    for (k, d) in devices.iter().enumerate() {
        if devices[..k].contains(d) {
            continue;
        }
        let on_card: Vec<usize> = (0..stages.len()).filter(|&j| devices[j] == *d).collect();
        let used = gpus[k].total.saturating_sub((gpus[k].free)()?);
        let ours: usize = on_card
            .iter()
            .map(|&j| gpus[j].weights + gpus[j].workspace)
            .sum();
        other[k] = used.saturating_sub(ours);
    }
    // The tower's weights are on the first stage's card already; the plan counts them as the
    // tower's.
    if let Some(t) = flags.vision {
        other[0] = other[0].saturating_sub(t.weights);
    }
    let mut mem = Vec::with_capacity(stages.len());
    for (k, m) in stages.iter().enumerate() {
        let before = (gpus[k].free)()?;
        profile(m, cfg)?;
        let after = (gpus[k].free)()?;
        let mut s = StageMemory::loaded(m, devices[k], t, budgets[k]).offload_if(flags, &m.cfg);
        let mut step = before.saturating_sub(after);
        if devices[..k].contains(&devices[k]) {
            // The card's memory pool may hand this step what an earlier stage's step freed, but
            // the stages run at once: count at least the estimate.
            step = step.max(s.activations);
        }
        s.weights = gpus[k].weights;
        s.activations = gpus[k].workspace + step + other[k];
        s.profiled = true;
        mem.push(s);
    }
    MemoryPlan::new(mem, cfg, kv_cache_memory_bytes, flags)
}

/// One step of the whole token budget on `m` (logits for every row on the last stage: a request
/// asking for prompt log-probabilities), with one state slot and the blocks it needs; the caches
/// are released after it.
fn profile<B: Backend>(m: &Model<B>, cfg: &EngineConfig) -> Result<()> {
    let t = cfg.max_num_batched_tokens;
    let blocks: Vec<u32> = (0..t.div_ceil(cfg.block_size) as u32).collect();
    m.init_cache(blocks.len(), cfg.block_size)?;
    m.backend.reserve_states(1)?;
    let slot = m.backend.alloc_state()?;
    let ids: Vec<u32> = (0..t)
        .map(|i| ((i * 7919 + 13) % cfg.valid_vocab.max(1)) as u32)
        .collect();
    let chunk = StepChunk {
        tokens: &ids,
        history: &[],
        pos0: 0,
        state: slot,
        blocks: &blocks,
        out: OutRows::All,
    };
    let start = if m.is_first_stage() {
        StepStart::Tokens
    } else {
        // The residual streams the previous stage would hand over, small and varied.
        let width = m
            .cfg
            .hyper_connections
            .as_ref()
            .map_or(1, |h| h.num_streams)
            * m.cfg.hidden_size;
        let x = (0..t * width)
            .map(|i| ((i * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        StepStart::Streams(m.backend.upload(t, width, x)?)
    };
    let out = m.step(StepInput {
        chunks: &[chunk],
        start,
        hidden: false,
    })?;
    if let Some(logits) = out.logits {
        m.backend.to_host(logits)?;
    }
    if let Some(streams) = out.streams {
        m.backend.to_host(streams)?;
    }
    m.backend.free_state(slot);
    m.backend.reserve_states(0)?;
    m.init_cache(0, cfg.block_size)?;
    Ok(())
}
