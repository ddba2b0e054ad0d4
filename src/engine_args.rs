//! Engine settings shared by every subcommand that runs the engine, and the start of the engine on a loaded
//! model.

use anyhow::{anyhow, Result};
use clap::Args;
use sanmai_engine::{
    start, EngineConfig, EngineHandle, ModelExecutor, PipelineExecutor, PipelineOptions,
};
use sanmai_model::Backend;

use crate::load::Loaded;
use crate::memory_plan::{self, PlanInput};

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
    /// Fraction of the GPU's memory the server may use (weights, activations, state, K/V).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
}

/// Default of `--gpu-memory-utilization`.
pub const GPU_MEMORY_UTILIZATION: f64 = 0.9;

impl EngineArgs {
    /// Starts the engine on `loaded` (the model moves into the engine thread).
    pub fn start<B: Backend + 'static>(
        &self,
        loaded: Loaded<B>,
        served_name: String,
    ) -> Result<EngineHandle> {
        let Loaded {
            ple_prefetch,
            pp_deferred_receive,
            gpu,
            mut stages,
            tokenizer,
            valid_vocab,
            eos_ids,
            default_max_tokens,
            ..
        } = loaded;
        let model = &stages[0];
        let max_model_len = self
            .max_model_len
            .unwrap_or(model.cfg.max_position_embeddings);
        if max_model_len < 2 || max_model_len > model.cfg.max_position_embeddings {
            return Err(anyhow!(
                "--max-model-len {max_model_len} must be in 2..={} (the model's max_position_embeddings)",
                model.cfg.max_position_embeddings
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
        let kv_cache_memory_bytes = match gpu.as_slice() {
            [] => {
                let per_token: usize = stages.iter().map(|m| m.kv_bytes_per_token(4)).sum();
                let one_request = max_model_len * per_token.max(1);
                self.kv_cache_memory_bytes.unwrap_or_else(|| {
                    (4 * one_request)
                        .min(8 << 30)
                        .max(one_request + one_request / 8)
                })
            }
            gpus => memory_plan::plan_stages(
                &stages,
                gpus,
                &PlanInput {
                    utilization: self
                        .gpu_memory_utilization
                        .unwrap_or(GPU_MEMORY_UTILIZATION),
                    max_model_len,
                    max_num_seqs,
                    max_num_batched_tokens,
                    block_size,
                    valid_vocab,
                    kv_cache_memory_bytes: self.kv_cache_memory_bytes,
                },
            )?,
        };
        let cfg = EngineConfig {
            model_name: served_name,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            max_waiting: self.max_waiting_requests.unwrap_or(4096),
            default_max_tokens,
            valid_vocab,
            eos_ids,
            block_size,
            kv_cache_memory_bytes,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            state_checkpoint_interval: self.state_checkpoint_interval,
        };
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
        .map_err(|e| anyhow!(e))
    }
}
