//! Engine settings shared by every subcommand that runs the engine, and the start of the engine on a loaded
//! model.

use anyhow::{anyhow, Result};
use clap::Args;
use sanmai_config::ModelConfig;
use sanmai_engine::{
    start, EngineConfig, EngineHandle, ModelExecutor, PipelineExecutor, PipelineOptions,
};
use sanmai_model::vision::tower_device_bytes;
use sanmai_model::{Backend, KvHost};

use crate::bytes::ByteSize;
use crate::load::Loaded;
use crate::memory_plan::{self, BudgetFlags};
use crate::speculative::Speculative;

#[derive(Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// Context length in tokens (prompt + generated); default: the model's max_position_embeddings.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Sequences per step at most.
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Tokens per step at most (prefill is chunked to fit).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Positions per K/V block.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Turn prefix caching off (on by default).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Memory for K/V blocks and GDN state checkpoints, in bytes; default: room for four requests of the
    /// full context (at least), at most 8 GiB unless one request needs more.
    #[arg(long)]
    pub kv_cache_memory_bytes: Option<usize>,
    /// Tokens between GDN state checkpoints (a multiple of the block size); default: sized so that a
    /// checkpoint costs no more than the K/V of the tokens it covers.
    #[arg(long)]
    pub state_checkpoint_interval: Option<usize>,
    /// Requests allowed to wait for a place before new ones are refused as overloaded (503).
    #[arg(long)]
    pub max_waiting_requests: Option<usize>,
    /// Fraction of each GPU's memory the server may use (weights, activations, state, K/V), split
    /// evenly between the pipeline stages on it.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Bytes each pipeline stage may use on its GPU (e.g. 23.5GiB, 24124MiB), in place of
    /// --gpu-memory-utilization: every pool is sized within it at start, as on a card of that size.
    /// Stages sharing a GPU add up and must fit it.
    #[arg(long, value_name = "BYTES")]
    pub gpu_memory_budget: Option<ByteSize>,
    /// Keep the K and V rows of QSA layers in pinned host RAM (the GPU reads the rows it selects
    /// through unified addressing); the index keys and everything else stay on the device. The pool
    /// is pinned at start, stage by stage under a lock file, after a check of MemAvailable.
    #[arg(long)]
    pub qsa_kv_offload: bool,
    /// RAM that must stay available after pinning the QSA K/V pool (it serves the PLE table's page
    /// cache, for one), e.g. 8GiB [default: 0].
    #[arg(long, value_name = "BYTES")]
    pub host_memory_reserve: Option<ByteSize>,
    /// Rows of each stage's VRAM row cache under --qsa-kv-offload, split over its QSA layers
    /// (recently read K/V rows, keyed by cache slot; decode steps only); 0 turns it off [default:
    /// 48576, four 12,144-token blocks of rows, about 95 MiB at 2 KiB a row].
    #[arg(long, value_name = "ROWS")]
    pub qsa_row_cache_rows: Option<usize>,
    /// Decode steps read every QSA K/V row from host memory, not through the row cache (for A/B
    /// runs; prefills still stage rows in the arena).
    #[arg(long)]
    pub no_qsa_row_cache: bool,
    /// Speculative decoding with the checkpoint's MTP head, as vLLM's flag takes it:
    /// '{"method": "mtp", "num_speculative_tokens": K}' (K drafts a step, 1 by default; "model":
    /// DIR reads the head's mtp.* tensors from another checkpoint, such as `sanmai quantize
    /// --mtp-int4` writes). Every emitted token is drawn from the target model, so outputs are
    /// those without it.
    #[arg(long, value_name = "JSON")]
    pub speculative_config: Option<String>,
}

/// Default of `--qsa-row-cache-rows`.
pub const QSA_ROW_CACHE_ROWS: usize = 4 * 12_144;

impl EngineArgs {
    /// The flags that set the stages' memory budgets and what stays off the device.
    pub fn budget_flags(&self) -> BudgetFlags {
        BudgetFlags {
            budget: self.gpu_memory_budget.map(|b| b.0),
            utilization: self.gpu_memory_utilization,
            qsa_kv_offload: self.qsa_kv_offload,
            row_cache_rows: self.row_cache_rows(),
            vision: None,
        }
    }

    /// `--speculative-config`, read and checked against the model (it needs an MTP head).
    pub fn speculative(&self, cfg: &ModelConfig) -> Result<Option<Speculative>> {
        Speculative::for_model(self.speculative_config.as_deref(), cfg)
    }

    /// Refuses `--qsa-kv-offload` for a model without QSA layers.
    pub fn check_offload(&self, cfg: &ModelConfig) -> Result<()> {
        if self.qsa_kv_offload && cfg.qsa.is_none() {
            return Err(anyhow!(
                "--qsa-kv-offload: the model has no QSA layers (its config has no `qsa` block)"
            ));
        }
        for (given, flag) in [
            (self.host_memory_reserve.is_some(), "--host-memory-reserve"),
            (self.qsa_row_cache_rows.is_some(), "--qsa-row-cache-rows"),
            (self.no_qsa_row_cache, "--no-qsa-row-cache"),
        ] {
            if given && !self.qsa_kv_offload {
                return Err(anyhow!("{flag} applies to --qsa-kv-offload, which is off"));
            }
        }
        Ok(())
    }

    /// Rows of each stage's row cache (0 without --qsa-kv-offload).
    pub fn row_cache_rows(&self) -> usize {
        match self.qsa_kv_offload {
            true => self.qsa_row_cache_rows.unwrap_or(QSA_ROW_CACHE_ROWS),
            false => 0,
        }
    }

    /// What each stage's backend needs to pin its QSA K/V pool, when `--qsa-kv-offload` is on.
    fn kv_host(&self, stage: usize, stages: usize) -> Option<KvHost> {
        self.qsa_kv_offload.then(|| KvHost {
            what: if stages == 1 {
                "the QSA K/V pool".into()
            } else {
                format!("the QSA K/V pool of stage {stage}")
            },
            reserve: self.host_memory_reserve.map_or(0, |b| b.0),
            lock_path: std::env::temp_dir().join("sanmai-pin.lock"),
            row_cache_rows: self.row_cache_rows(),
            row_cache: !self.no_qsa_row_cache,
        })
    }

    /// The engine's settings for a model of `cfg` (the K/V budget left to the memory plan).
    pub fn engine_config(
        &self,
        cfg: &ModelConfig,
        served_name: String,
        valid_vocab: usize,
        eos_ids: Vec<u32>,
        default_max_tokens: Option<usize>,
    ) -> Result<EngineConfig> {
        let max_model_len = self.max_model_len.unwrap_or(cfg.max_position_embeddings);
        if max_model_len < 2 || max_model_len > cfg.max_position_embeddings {
            return Err(anyhow!(
                "--max-model-len {max_model_len} must be in 2..={} (the model's max_position_embeddings)",
                cfg.max_position_embeddings
            ));
        }
        let max_num_seqs = self.max_num_seqs.unwrap_or(256);
        let max_num_batched_tokens = self.max_num_batched_tokens.unwrap_or(2048);
        let block_size = self.block_size.unwrap_or(16);
        if max_num_seqs == 0 || max_num_batched_tokens == 0 || block_size == 0 {
            return Err(anyhow!(
                "--max-num-seqs, --max-num-batched-tokens and --block-size must be positive"
            ));
        }
        Ok(EngineConfig {
            model_name: served_name,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            max_waiting: self.max_waiting_requests.unwrap_or(4096),
            default_max_tokens,
            valid_vocab,
            eos_ids,
            block_size,
            kv_cache_memory_bytes: 0,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            state_checkpoint_interval: self.state_checkpoint_interval,
            num_speculative_tokens: self
                .speculative(cfg)?
                .map_or(0, |s| s.num_speculative_tokens),
        })
    }

    /// Starts the engine on `loaded` (the model moves into the engine thread) after planning the
    /// stages' memory.
    pub fn start<B: Backend + 'static>(
        &self,
        loaded: Loaded<B>,
        served_name: String,
    ) -> Result<EngineHandle> {
        let Loaded {
            ple_prefetch,
            pp_deferred_receive,
            gpu,
            devices,
            mut stages,
            tokenizer,
            valid_vocab,
            eos_ids,
            default_max_tokens,
            images,
            ..
        } = loaded;
        let mut cfg = self.engine_config(
            &stages[0].cfg,
            served_name,
            valid_vocab,
            eos_ids,
            default_max_tokens,
        )?;
        self.check_offload(&stages[0].cfg)?;
        let mut flags = self.budget_flags();
        flags.vision = images.as_ref().and_then(|e| {
            tower_device_bytes(
                &stages[0].cfg,
                e.preprocessor().max_pixels,
                e.blocks_on_host(),
            )
        });
        let plan = memory_plan::plan_loaded(
            &stages,
            &devices,
            &gpu,
            &cfg,
            self.kv_cache_memory_bytes,
            &flags,
        )?;
        plan.log();
        cfg.kv_cache_memory_bytes = plan.kv_cache_memory_bytes();
        let n = stages.len();
        for (k, m) in stages.iter_mut().enumerate() {
            m.kv_host = self.kv_host(k, n);
        }
        if stages.len() == 1 {
            let model = stages.pop().expect("one stage");
            start(
                ModelExecutor::with_prefetch(model, ple_prefetch),
                tokenizer,
                cfg,
            )
        } else {
            let opts = PipelineOptions {
                deferred_receive: pp_deferred_receive,
                ..PipelineOptions::default()
            };
            let exec = PipelineExecutor::new(stages, ple_prefetch, opts).map_err(|e| anyhow!(e))?;
            start(exec, tokenizer, cfg)
        }
        .map(|h| match images {
            Some(e) => h.with_images(e),
            None => h,
        })
        .map_err(|e| anyhow!(e))
    }
}
