//! The memory plan of the pipeline stages. Each stage gets a budget (`--gpu-memory-budget`, else its
//! share of `--gpu-memory-utilization` of its card; stages sharing a card add up and are checked
//! against it) and holds its weights, a step's activations, the GDN state of `--max-num-seqs`
//! sequences, and its share of every K/V block and state checkpoint. The K/V budget is the largest
//! every stage fits; the engine's own arithmetic ([`sanmai_engine::CachePlan`]) splits it into
//! checkpoint slots and blocks, and the state slot pools are sized for those at start.
//!
//! `sanmai plan` fills a stage's numbers from the config alone ([`StageMemory::estimate`]); the
//! server fills them from the loaded stages, on a GPU with one profiling step per stage, in order,
//! each stage's activations being the drop in its card's free memory over its step. Both print
//! [`MemoryPlan::lines`], and a stage that does not fit is refused with every stage's numbers.

use std::ops::Range;

use anyhow::{bail, Result};
use sanmai_config::ModelConfig;
use sanmai_engine::{CacheGeometry, CachePlan, EngineConfig};
use sanmai_model::vision::TowerBytes;
use sanmai_model::weight_plan::{self, WeightForm, WeightStorage};
use sanmai_model::{Backend, Model};

use crate::bytes::gib;
use crate::stages::{Device, StageLayout};

mod loaded;
pub use loaded::plan_loaded;

/// What a GPU stage's device tells the plan.
pub struct GpuMemory {
    /// Total device memory.
    pub total: usize,
    /// Device memory the stage's weights occupy.
    pub weights: usize,
    /// The stage's persistent workspace after loading (expert tables, RoPE tables, step metadata).
    pub workspace: usize,
    /// Free device memory now (every process's use counted).
    pub free: Box<dyn Fn() -> Result<usize> + Send + Sync>,
}

/// The flags that set the stages' budgets.
#[derive(Debug, Clone, Copy, Default)]
pub struct BudgetFlags {
    /// `--gpu-memory-budget` (bytes per stage).
    pub budget: Option<usize>,
    /// `--gpu-memory-utilization`.
    pub utilization: Option<f64>,
    /// `--qsa-kv-offload`: the QSA K/V rows count against host RAM, not the stages' budgets.
    pub qsa_kv_offload: bool,
    /// `--qsa-row-cache-rows` in force (0 without offload): each stage's VRAM row cache.
    pub row_cache_rows: usize,
    /// The vision tower's weights and the activations of the largest image it takes, on the first
    /// stage's GPU, and its blocks in pinned host memory with `--vit-on-host` (`None`: no tower, or
    /// images turned off).
    pub vision: Option<TowerBytes>,
}

/// Default of `--gpu-memory-utilization`.
pub const GPU_MEMORY_UTILIZATION: f64 = 0.9;

impl BudgetFlags {
    /// Each stage's budget: `--gpu-memory-budget`, else its card's `--gpu-memory-utilization` split
    /// evenly over the stages on it. `totals[i]` is stage `i`'s card memory when known (`None`: no
    /// GPU to ask; the CPU). A CPU stage without `--gpu-memory-budget` has no budget (`None`).
    pub fn stage_budgets(
        &self,
        devices: &[Device],
        totals: &[Option<usize>],
    ) -> Result<Vec<Option<usize>>> {
        let util = self.utilization.unwrap_or(GPU_MEMORY_UTILIZATION);
        if !(util > 0.0 && util <= 1.0) {
            bail!("--gpu-memory-utilization {util} must be in (0, 1]");
        }
        let sharing = |d: &Device| devices.iter().filter(|x| *x == d).count();
        let mut out = Vec::with_capacity(devices.len());
        for (d, total) in devices.iter().zip(totals) {
            out.push(match (self.budget, total, d) {
                (Some(b), Some(t), _) if b > *t => bail!(
                    "--gpu-memory-budget {} is more than {d}'s {} of memory",
                    gib(b),
                    gib(*t)
                ),
                (Some(b), Some(t), _) if b * sharing(d) > *t => bail!(
                    "--gpu-memory-budget {} for each of the {} stages on {d} adds up to {}, more than its {}",
                    gib(b),
                    sharing(d),
                    gib(b * sharing(d)),
                    gib(*t)
                ),
                (Some(b), _, _) => Some(b),
                (None, Some(t), _) => Some((*t as f64 * util) as usize / sharing(d)),
                (None, None, Device::Cpu) => None,
                (None, None, Device::Cuda(_)) => bail!(
                    "--gpu-memory-budget is needed to plan {d} without a GPU to ask for its memory"
                ),
            });
        }
        Ok(out)
    }
}

/// One stage's memory, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageMemory {
    pub layers: Range<usize>,
    pub device: Device,
    /// What the stage may use (`None`: no limit, a CPU stage without `--gpu-memory-budget`).
    pub budget: Option<usize>,
    pub weights: usize,
    /// A step's activations and the runtime workspace.
    pub activations: usize,
    /// The activations come from a profiling step (else they are an estimate).
    pub profiled: bool,
    /// GDN (and PLE conv) state of one sequence.
    pub state_per_seq: usize,
    /// K/V of one token on this stage's layers, on the device.
    pub kv_per_token: usize,
    /// K/V of one token on this stage's layers kept in pinned host memory (`--qsa-kv-offload`).
    pub kv_host_per_token: usize,
    /// Pinned host memory the stage holds: its share of the K/V blocks' host part (the step
    /// metadata staging ring is not counted).
    pub pinned_host: usize,
    /// The VRAM row cache of its QSA K/V rows in host memory (`--qsa-row-cache-rows`).
    pub row_cache: usize,
    /// The vision tower's weights and activations (the first stage on a GPU, with images on).
    pub vision: usize,
    /// Host RAM (not pinned) of the MTP head's embedding copy on a last stage without the
    /// embedding ([`sanmai_model::Model::mtp_embed`]).
    pub host_embed: usize,
}

/// What a CUDA device's runtime takes besides the tensors (the context, the cuBLAS workspace, the
/// kernel modules, the graph pools), as a profiling step measured it on an H200 (CUDA 13): about
/// 0.86 GiB more than the activations alone.
const CUDA_RUNTIME_BYTES: usize = 880 << 20;

impl StageMemory {
    /// A stage's numbers from the config alone: weights in `form` as the device stores them,
    /// activations estimated at `tokens` per step.
    pub fn estimate(
        cfg: &ModelConfig,
        layout: &StageLayout,
        form: WeightForm<'_>,
        tokens: usize,
        budgets: &[Option<usize>],
    ) -> Vec<StageMemory> {
        layout
            .ranges
            .iter()
            .zip(&layout.devices)
            .zip(budgets)
            .enumerate()
            .map(|(k, ((r, &device), &budget))| {
                let storage = storage_of(device);
                // The first stage on a GPU also pays for the device's runtime, which its profiling
                // step measures at start.
                let runtime = match device {
                    Device::Cuda(_) if !layout.devices[..k].contains(&device) => CUDA_RUNTIME_BYTES,
                    _ => 0,
                };
                StageMemory {
                    layers: r.clone(),
                    device,
                    budget,
                    weights: weight_plan::stage_weight_bytes(cfg, r.clone(), form, storage).stored
                        as usize,
                    activations: runtime
                        + weight_plan::stage_activation_bytes(cfg, r, tokens, form, storage),
                    profiled: false,
                    // The recurrent state is f32 on every backend (the engine's geometry too).
                    state_per_seq: weight_plan::stage_state_bytes(cfg, r, 4),
                    kv_per_token: weight_plan::stage_kv_bytes_per_token(
                        cfg,
                        r,
                        storage.cache_elem(),
                    ),
                    kv_host_per_token: 0,
                    pinned_host: 0,
                    row_cache: 0,
                    vision: 0,
                    host_embed: match (r.start, r.end) {
                        (s, e)
                            if s > 0
                                && e == cfg.num_layers
                                && cfg.mtp_layers > 0
                                && !cfg.tie_word_embeddings =>
                        {
                            4 * cfg.vocab_size * cfg.hidden_size
                        }
                        _ => 0,
                    },
                }
            })
            .collect()
    }

    /// The stage with its QSA K/V rows in pinned host memory when `--qsa-kv-offload` is on: their
    /// bytes move from the device's share of a token to the host's; the index keys stay.
    pub fn offload_if(mut self, flags: &BudgetFlags, cfg: &ModelConfig) -> StageMemory {
        if flags.qsa_kv_offload && self.kv_host_per_token == 0 {
            let elem = storage_of(self.device).cache_elem();
            let host = weight_plan::stage_qsa_kv_bytes_per_token(cfg, &self.layers, elem);
            self.kv_per_token -= host;
            self.kv_host_per_token = host;
        }
        if flags.qsa_kv_offload {
            // Whole rows per layer: the rows split evenly over the stage's QSA layers.
            let layers = weight_plan::stage_qsa_layers(cfg, &self.layers);
            self.row_cache = match layers {
                0 => 0,
                n => flags.row_cache_rows / n * self.kv_host_per_token,
            };
        }
        self
    }

    /// A loaded stage's numbers without a profiling step: its resident weights, its caches' sizes
    /// and the activation estimate.
    pub fn loaded<B: Backend>(
        m: &Model<B>,
        device: Device,
        tokens: usize,
        budget: Option<usize>,
    ) -> StageMemory {
        let storage = storage_of(device);
        let form = WeightForm {
            quant: m.cfg.quantization.as_ref(),
            fp8: m.cfg.fp8.as_ref(),
            per_expert: false,
            mtp: None,
        };
        StageMemory {
            layers: m.stage.clone(),
            device,
            budget,
            weights: m.resident_weight_bytes() as usize,
            activations: weight_plan::stage_activation_bytes(
                &m.cfg, &m.stage, tokens, form, storage,
            ),
            profiled: false,
            state_per_seq: m.state_bytes(4),
            kv_per_token: m.kv_bytes_per_token(B::CACHE_ELEM_BYTES),
            kv_host_per_token: m.kv_host_bytes_per_token(B::CACHE_ELEM_BYTES),
            pinned_host: 0,
            row_cache: 0,
            vision: 0,
            host_embed: m.mtp_embed.as_ref().map_or(0, |t| 4 * t.len()),
        }
    }

    /// Weights, activations, the row cache, the vision tower and the live GDN state of `seqs`
    /// sequences.
    fn fixed(&self, seqs: usize) -> usize {
        self.weights + self.activations + self.row_cache + self.vision + seqs * self.state_per_seq
    }

    /// What the K/V blocks and checkpoints `plan` takes on this stage.
    fn cache_bytes(&self, plan: &CachePlan) -> (usize, usize) {
        (
            plan.num_blocks * plan.block_size * self.kv_per_token,
            plan.checkpoint_slots * self.state_per_seq,
        )
    }

    fn name(&self, k: usize) -> String {
        format!(
            "stage {k} (layers {}..{} on {})",
            self.layers.start, self.layers.end, self.device
        )
    }
}

fn storage_of(device: Device) -> WeightStorage {
    match device {
        Device::Cpu => WeightStorage::Cpu,
        Device::Cuda(_) => WeightStorage::Cuda,
    }
}

/// The K/V budget without a memory budget: room for four requests of the full context (at
/// least), at most 8 GiB unless one request needs more.
fn default_kv_bytes(per_token: usize, max_model_len: usize) -> usize {
    let one_request = max_model_len * per_token.max(1);
    (4 * one_request)
        .min(8 << 30)
        .max(one_request + one_request / 8)
}

/// The K/V budget (device bytes) of `requests` requests of `max_model_len` with all their state
/// checkpoints, two blocks to spare: what the QSA K/V rows in host memory are sized by.
fn requests_kv_bytes(g: &CacheGeometry, cfg: &EngineConfig, requests: usize) -> usize {
    let bs = cfg.block_size.max(1);
    let block_bytes = g.kv_bytes_per_token * bs;
    // A bad interval is refused by the cache plan itself.
    let checkpoints = cfg.request_checkpoints(g).unwrap_or(0);
    requests * (cfg.max_model_len.div_ceil(bs) * block_bytes + checkpoints * g.state_bytes)
        + 2 * block_bytes
}

/// The stages' memory and the cache plan they share.
#[derive(Debug, Clone)]
pub struct MemoryPlan {
    pub stages: Vec<StageMemory>,
    pub cache: CachePlan,
    pub max_num_seqs: usize,
    /// The sequences draft with the MTP head (each keeps a second GDN state).
    pub drafting: bool,
    pub max_num_batched_tokens: usize,
    /// The flag a stage's budget came from, for the refusals.
    budget_flag: &'static str,
    /// The vision tower's blocks in pinned host memory (on the first stage).
    tower_host: usize,
}

impl MemoryPlan {
    /// Plans `stages` under `cfg` (its `kv_cache_memory_bytes` is `--kv-cache-memory-bytes` when
    /// given, else ignored). Refuses, with every stage's numbers, a stage whose weights,
    /// activations and live state leave no room, and a K/V budget some stage cannot hold.
    pub fn new(
        mut stages: Vec<StageMemory>,
        cfg: &EngineConfig,
        kv_cache_memory_bytes: Option<usize>,
        flags: &BudgetFlags,
    ) -> Result<MemoryPlan> {
        let mut tower_host = 0;
        if let (Some(t), Some(first)) = (flags.vision, stages.first_mut()) {
            if matches!(first.device, Device::Cuda(_)) {
                first.vision = t.weights + t.activations;
                tower_host = t.host;
            }
        }
        let seqs = cfg.max_num_seqs;
        let drafting = cfg.num_speculative_tokens > 0;
        // A sequence that drafts keeps a second state: the one before its verify step.
        let slots = seqs * (1 + usize::from(drafting));
        let who = state_holders(seqs, drafting);
        let budget_flag = if flags.budget.is_some() {
            "--gpu-memory-budget"
        } else {
            "--gpu-memory-utilization"
        };
        let table = |stages: &[StageMemory]| {
            stages
                .iter()
                .enumerate()
                .map(|(k, s)| {
                    format!(
                        "{}: weights {} + activations {}{} + GDN state of {who} {} = {} of {}",
                        s.name(k),
                        gib(s.weights),
                        gib(s.activations),
                        match s.vision {
                            0 => String::new(),
                            b => format!(" + vision tower {}", gib(b)),
                        },
                        gib(slots * s.state_per_seq),
                        gib(s.fixed(slots)),
                        s.budget.map_or("no budget".into(), gib)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        if stages
            .iter()
            .any(|s| s.budget.is_some_and(|b| s.fixed(slots) >= b))
        {
            let images = match stages.first().map_or(0, |s| s.vision) {
                0 => "",
                _ => {
                    "; the vision tower counts the largest image: lower its max_pixels with \
                      --mm-processor-kwargs, keep its blocks in host memory with --vit-on-host, \
                      or turn images off with --limit-mm-per-prompt '{\"image\": 0}'"
                }
            };
            bail!(
                "a pipeline stage does not fit {budget_flag}: {} (lower --max-num-seqs or \
                 --max-num-batched-tokens, or give the stages other layers with \
                 --pp-layer-partition{images})",
                table(&stages)
            );
        }
        let geometry = CacheGeometry {
            kv_bytes_per_token: stages.iter().map(|s| s.kv_per_token).sum(),
            host_kv_bytes_per_token: stages.iter().map(|s| s.kv_host_per_token).sum(),
            state_bytes: stages.iter().map(|s| s.state_per_seq).sum(),
            history_tokens: 0,
        };
        // The largest whole-model K/V budget every stage holds: a stage holds `share` of each
        // block and of each checkpoint, so `room / share` of the larger share is safe.
        let fits = stages.iter().filter_map(|s| {
            let room = s.budget? - s.fixed(slots);
            let share = |part: usize, whole: usize| part as f64 / whole.max(1) as f64;
            let share = share(s.kv_per_token, geometry.kv_bytes_per_token)
                .max(share(s.state_per_seq, geometry.state_bytes));
            Some(if share > 0.0 {
                (room as f64 / share) as usize
            } else {
                usize::MAX
            })
        });
        let offload = geometry.host_kv_bytes_per_token > 0;
        let kv = match (kv_cache_memory_bytes, fits.min()) {
            (Some(kv), _) => kv,
            // With the QSA K/V rows in host memory a block costs the device little: hold the
            // blocks and checkpoints of `max_num_seqs` full-length requests, not every block the
            // device could index, so the pinned pool is what those requests need.
            (None, Some(kv)) if kv < usize::MAX && offload => {
                kv.min(requests_kv_bytes(&geometry, cfg, cfg.max_num_seqs))
            }
            (None, Some(kv)) if kv < usize::MAX => kv,
            // No budget (the CPU): four requests, as without the host pool, with their checkpoints.
            _ if offload => requests_kv_bytes(&geometry, cfg, cfg.max_num_seqs.min(4)),
            _ => default_kv_bytes(geometry.kv_bytes_per_token, cfg.max_model_len),
        };
        let mut cfg = cfg.clone();
        cfg.kv_cache_memory_bytes = kv;
        let cache = cfg.cache_plan(geometry).map_err(|e| {
            anyhow::anyhow!(
                "{e} (under {budget_flag}, {} leave {} for K/V and state checkpoints)",
                table(&stages),
                gib(kv)
            )
        })?;
        for (k, s) in stages.iter().enumerate() {
            let (blocks, checkpoints) = s.cache_bytes(&cache);
            if let Some(b) = s
                .budget
                .filter(|&b| s.fixed(slots) + blocks + checkpoints > b)
            {
                bail!(
                    "--kv-cache-memory-bytes {kv} does not fit {}: its K/V blocks {} and state \
                     checkpoints {} on top of {} exceed its {} ({})",
                    s.name(k),
                    gib(blocks),
                    gib(checkpoints),
                    gib(s.fixed(slots)),
                    gib(b),
                    table(&stages)
                );
            }
        }
        for s in &mut stages {
            s.pinned_host = cache.num_blocks * cache.block_size * s.kv_host_per_token;
        }
        if let Some(first) = stages.first_mut() {
            first.pinned_host += tower_host;
        }
        Ok(MemoryPlan {
            stages,
            cache,
            max_num_seqs: seqs,
            drafting,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            budget_flag,
            tower_host,
        })
    }

    /// The K/V budget the engine gets (whole-model bytes).
    pub fn kv_cache_memory_bytes(&self) -> usize {
        self.cache.budget_bytes
    }

    /// The plan as printed: one line per stage, then the block arithmetic.
    pub fn lines(&self) -> Vec<String> {
        let seqs = self.max_num_seqs;
        let slots = seqs * (1 + usize::from(self.drafting));
        let who = state_holders(seqs, self.drafting);
        let mut out: Vec<String> = self
            .stages
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let (blocks, checkpoints) = s.cache_bytes(&self.cache);
                let total = s.fixed(slots) + blocks + checkpoints;
                format!(
                    "{}: weights {}, activations {} ({} at {} tokens), {}GDN state {} ({who} \
                     of {} bytes), K/V blocks {} ({} bytes a token), state checkpoints {}, \
                     {}pinned host RAM {}{}; {} of {}",
                    s.name(k),
                    gib(s.weights),
                    gib(s.activations),
                    if s.profiled { "profiled" } else { "estimated" },
                    self.max_num_batched_tokens,
                    match s.vision {
                        0 => String::new(),
                        b => format!("vision tower {} (weights and the largest image), ", gib(b)),
                    },
                    gib(slots * s.state_per_seq),
                    s.state_per_seq,
                    gib(blocks),
                    s.kv_per_token,
                    gib(checkpoints),
                    match s.row_cache {
                        0 => String::new(),
                        b => format!("QSA row cache {}, ", gib(b)),
                    },
                    gib(s.pinned_host),
                    match s.host_embed {
                        0 => String::new(),
                        b => format!(", the MTP head's embedding in host RAM {}", gib(b)),
                    },
                    gib(total),
                    s.budget.map_or_else(
                        || "no budget".into(),
                        |b| format!("{} ({})", gib(b), self.budget_flag)
                    )
                )
            })
            .collect();
        out.push(self.cache.describe());
        let pinned: usize = self.stages.iter().map(|s| s.pinned_host).sum();
        if pinned > 0 {
            // What is left of the RAM serves the page cache (the PLE table's, for one).
            let available = sanmai_pinned::mem_available().map_or_else(
                |e| format!("unknown ({e})"),
                |b| format!("{} ({b} bytes)", gib(b)),
            );
            out.push(format!(
                "pinned host RAM: {} ({pinned} bytes) for {}; MemAvailable now {available}",
                gib(pinned),
                match (pinned - self.tower_host, self.tower_host) {
                    (_, 0) => format!("the QSA K/V rows of {} blocks", self.cache.num_blocks),
                    (0, t) => format!("the vision tower's blocks ({})", gib(t)),
                    (_, t) => format!(
                        "the QSA K/V rows of {} blocks and the vision tower's blocks ({})",
                        self.cache.num_blocks,
                        gib(t)
                    ),
                }
            ));
        }
        out
    }

    /// Logs the plan (the server's start).
    pub fn log(&self) {
        for line in self.lines() {
            tracing::info!("memory plan: {line}");
        }
    }
}

/// Who holds the live GDN states: the sequences, and with drafting their verify snapshots.
fn state_holders(seqs: usize, drafting: bool) -> String {
    match drafting {
        true => format!("{seqs} sequences and their verify snapshots"),
        false => format!("{seqs} sequences"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stages::StageFlags;
    use sanmai_cpu::CpuBackend;
    use sanmai_model::PleSource;
    use sanmai_weights::{Checkpoint, Dummy, TensorSource};

    fn repo(rel: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
    }

    fn cpu_layout(cfg: &ModelConfig, n: usize) -> StageLayout {
        StageFlags {
            pipeline_parallel_size: Some(n),
            pp_layer_partition: None,
            device: Some("cpu"),
        }
        .layout(cfg.num_layers, Device::Cpu)
        .unwrap()
    }

    /// Every stage of `cfg` from `src`, estimated before loading and measured once loaded.
    fn check(what: &str, cfg: &ModelConfig, src: &dyn TensorSource, form: WeightForm<'_>) {
        for n in [1, 2] {
            let layout = cpu_layout(cfg, n);
            let estimated = StageMemory::estimate(cfg, &layout, form, 64, &vec![None; n]);
            for (r, est) in layout.ranges.iter().zip(&estimated) {
                let ple = cfg.ple.as_ref().map(|_| PleSource::Zeros);
                let m =
                    Model::load_stage(cfg.clone(), src, CpuBackend::new(), ple, r.clone()).unwrap();
                let loaded = StageMemory::loaded(&m, Device::Cpu, 64, None);
                assert_eq!(*est, loaded, "{what}, layers {r:?}");
                let w = weight_plan::stage_weight_bytes(cfg, r.clone(), form, WeightStorage::Cpu);
                assert_eq!(w.packed_tensors, m.packed.len(), "{what}, layers {r:?}");
                let packed: usize = m.packed.iter().map(|p| p.bytes).sum();
                assert_eq!(w.packed_bytes as usize, packed, "{what}, layers {r:?}");
            }
            let whole =
                weight_plan::stage_weight_bytes(cfg, 0..cfg.num_layers, form, WeightStorage::Cuda);
            let stages: u64 = layout
                .ranges
                .iter()
                .map(|r| {
                    weight_plan::stage_weight_bytes(cfg, r.clone(), form, WeightStorage::Cuda)
                        .stored
                })
                .sum();
            // Only a last stage that also embeds (tied) holds a weight twice on the device (an MTP
            // head's copy is in host memory).
            let twice = n > 1 && cfg.tie_word_embeddings;
            assert_eq!(
                stages == whole.stored,
                !twice,
                "{what}: {stages} vs {}",
                whole.stored
            );
        }
    }

    #[test]
    fn estimates_before_loading_match_the_loaded_stages() {
        for name in [
            "qwen3_next_tiny",
            "qwen3_5_moe_tiny",
            "qwen3_5_moe_text_tiny",
            "qwen3_5_moe_text_tiny_quant",
            "qwen4_exp_all_tiny",
            "qwen4_exp_hc_tiny",
            "qwen4_exp_ple_tiny",
            "qwen4_exp_qsa_tiny",
        ] {
            let dir = repo("tests/fixtures").join(name);
            let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
            let ckpt = Checkpoint::open(&dir).unwrap();
            let form = crate::plan::checkpoint_form(&cfg, &ckpt);
            check(name, &cfg, &ckpt, form);
            // The same config with random weights, quantized as its config says.
            let dummy = Dummy::new(3)
                .with_quantization(cfg.quantization.clone())
                .with_fp8(cfg.fp8.clone());
            let form = WeightForm {
                quant: cfg.quantization.as_ref(),
                fp8: cfg.fp8.as_ref(),
                per_expert: false,
                mtp: None,
            };
            check(&format!("{name} (dummy)"), &cfg, &dummy, form);
        }
        // FP8 configs with random weights: the converted Linears come as FP8 bytes with per-row
        // scales. (Their checkpoints are counted from the config too, which can differ from the
        // stored dtypes: transformers matched `modules_to_not_convert` as substrings, so
        // qwen3_next_fp8_tiny's `layers.1.mlp.gate_proj` stayed bf16 beside `layers.1.mlp.gate`.)
        for name in ["qwen3_next_fp8_tiny", "qwen3_5_moe_fp8_tiny"] {
            let dir = repo("tests/fixtures").join(name);
            let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
            let dummy = Dummy::new(3).with_fp8(cfg.fp8.clone());
            let form = WeightForm {
                quant: None,
                fp8: cfg.fp8.as_ref(),
                per_expert: false,
                mtp: None,
            };
            check(&format!("{name} (dummy)"), &cfg, &dummy, form);
        }
        // The 125B config's quantization on a shrunken copy (4 layers, 4 experts, 512 tokens).
        let mut cfg =
            ModelConfig::from_file(&repo("configs/models/qwen4-exp-125b-a6b.json")).unwrap();
        cfg.num_layers = 4;
        cfg.layer_types.truncate(4);
        cfg.ffn_types.truncate(4);
        cfg.vocab_size = 512;
        cfg.moe.as_mut().unwrap().num_experts = 4;
        cfg.moe.as_mut().unwrap().top_k = 2;
        let dummy = Dummy::new(3).with_quantization(cfg.quantization.clone());
        let form = WeightForm {
            quant: cfg.quantization.as_ref(),
            fp8: None,
            per_expert: false,
            mtp: None,
        };
        check("qwen4-exp-125b-a6b (shrunken)", &cfg, &dummy, form);
    }

    #[test]
    fn budgets_add_up_on_a_shared_card() {
        let three = [Device::Cuda(0); 3];
        let card = [Some(80usize << 30); 3];
        let flags = |b: Option<usize>, u: Option<f64>| BudgetFlags {
            budget: b,
            utilization: u,
            ..BudgetFlags::default()
        };
        let b = flags(Some(20 << 30), None)
            .stage_budgets(&three, &card)
            .unwrap();
        assert_eq!(b, vec![Some(20 << 30); 3]);
        let b = flags(None, Some(0.75))
            .stage_budgets(&three, &card)
            .unwrap();
        assert_eq!(b, vec![Some(20 << 30); 3]);
        for (f, want) in [
            (flags(Some(30 << 30), None), "adds up to 90.00 GiB"),
            (flags(Some(90 << 30), None), "more than cuda:0's 80.00 GiB"),
            (flags(None, Some(1.5)), "--gpu-memory-utilization"),
        ] {
            let e = f.stage_budgets(&three, &card).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{e}");
        }
        let e = flags(None, None)
            .stage_budgets(&three, &[None; 3])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--gpu-memory-budget is needed"), "{e}");
        // The CPU has no budget unless one is given.
        let cpu = [Device::Cpu; 2];
        assert_eq!(
            flags(None, None).stage_budgets(&cpu, &[None; 2]).unwrap(),
            vec![None; 2]
        );
    }
}
