//! `sanmai plan`: the memory plan of a deployment before anything is loaded. From a model config
//! (random weights: sized by the config's quantization) or a checkpoint directory (sized by its
//! headers' quantized tensors), a preset and the serve flags, it prints per pipeline stage the
//! weights, activations at the step size, GDN state, K/V blocks, state checkpoints and pinned host
//! RAM within the stage's budget, then the block arithmetic and how many `--max-model-len` requests
//! fit: the code the server runs at start ([`crate::memory_plan`]). A stage that does not fit ends
//! it with an error giving every stage's numbers.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use sanmai_config::{FfnType, ModelConfig, QuantConfig};
use sanmai_model::builtin;
use sanmai_model::weight_plan::WeightForm;
use sanmai_weights::names::text_name;
use sanmai_weights::{Checkpoint, TensorSource};

use crate::engine_args::EngineArgs;
use crate::load::{served, LoadFormat, ModelArgs};
use crate::memory_plan::{MemoryPlan, StageMemory};
use crate::serve::Preset;
use crate::speculative::Speculative;
use crate::stages::{Device, StageLayout};

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A TOML file of serve flags (e.g. configs/deploy/3x3090.toml); command-line flags override it.
    #[arg(long)]
    pub preset: Option<PathBuf>,
}

/// Where the plan's numbers come from.
struct Source {
    name: String,
    cfg: ModelConfig,
    checkpoint: Option<Checkpoint>,
    /// The quantization of the MTP head's own directory (`--speculative-config`'s `"model"`).
    mtp_quant: Option<QuantConfig>,
}

impl Source {
    fn open(m: &ModelArgs) -> Result<Source> {
        // The MTP head is counted where speculative decoding loads it.
        let served = |cfg| match &m.speculative_config.0 {
            Some(_) => cfg,
            None => served(cfg),
        };
        Ok(match (&m.model, &m.config) {
            (Some(_), Some(_)) => {
                anyhow::bail!("give either --model DIR or --config FILE, not both")
            }
            (Some(dir), None) => {
                let cfg = served(ModelConfig::from_file(&dir.join("config.json"))?);
                let checkpoint = match m.load_format {
                    LoadFormat::Auto => Some(Checkpoint::open(dir).with_context(|| {
                        format!("--model {}: opening the checkpoint", dir.display())
                    })?),
                    LoadFormat::Dummy => None,
                };
                Source {
                    name: dir.display().to_string(),
                    cfg,
                    checkpoint,
                    mtp_quant: None,
                }
            }
            (None, Some(file)) => Source {
                name: file.display().to_string(),
                cfg: served(ModelConfig::from_file(file)?),
                checkpoint: None,
                mtp_quant: None,
            },
            (None, None) => match m.load_format {
                LoadFormat::Auto => Source {
                    name: builtin::NAME.into(),
                    cfg: served(builtin::trained_config()),
                    checkpoint: Some(builtin::trained_checkpoint()),
                    mtp_quant: None,
                },
                LoadFormat::Dummy => Source {
                    name: builtin::NAME.into(),
                    cfg: served(builtin::config()),
                    checkpoint: None,
                    mtp_quant: None,
                },
            },
        })
        .and_then(|s| s.with_mtp_dir(m))
    }

    /// The MTP head's own directory, when `--speculative-config` names one: its config's
    /// quantization is the head's.
    fn with_mtp_dir(mut self, m: &ModelArgs) -> Result<Source> {
        let spec = Speculative::for_model(m.speculative_config.0.as_deref(), &self.cfg)?;
        if let Some(dir) = spec.and_then(|s| s.model) {
            let file = dir.join("config.json");
            self.mtp_quant = ModelConfig::from_file(&file)
                .with_context(|| format!("--speculative-config `model`: {}", file.display()))?
                .quantization;
        }
        Ok(self)
    }

    /// The weights' form: a checkpoint's packed tensors and expert layout, or the config's
    /// quantization for random weights.
    fn form(&self) -> WeightForm<'_> {
        let form = match &self.checkpoint {
            Some(ckpt) => checkpoint_form(&self.cfg, ckpt),
            None => WeightForm {
                quant: self.cfg.quantization.as_ref(),
                fp8: self.cfg.fp8.as_ref(),
                per_expert: false,
                mtp: None,
            },
        };
        WeightForm {
            mtp: self.mtp_quant.as_ref(),
            ..form
        }
    }
}

/// The form of a checkpoint's weights, from its headers: the quantization its packed (or FP8) tensors
/// follow and whether its routed experts come one tensor per expert.
pub fn checkpoint_form<'a>(cfg: &ModelConfig, ckpt: &'a Checkpoint) -> WeightForm<'a> {
    let moe_layer = (0..cfg.num_layers).find(|&i| cfg.ffn_types[i] == FfnType::Moe);
    let per_expert = moe_layer.is_some_and(|i| {
        let layer = |rel: &str| text_name(cfg, &format!("layers.{i}.{rel}"));
        !ckpt.contains(&layer("mlp.experts.gate_up_proj"))
            && ckpt.contains(&layer("mlp.experts.0.gate_proj.weight"))
    });
    WeightForm {
        quant: ckpt.quantization(),
        fp8: ckpt.fp8(),
        per_expert,
        mtp: None,
    }
}

/// The card memory of each stage's device, when this build can ask a GPU.
fn card_totals(layout: &StageLayout) -> Vec<Option<usize>> {
    #[cfg(feature = "cuda")]
    let cards = sanmai_cuda::probe().unwrap_or_default();
    layout
        .devices
        .iter()
        .map(|d| match d {
            Device::Cpu => None,
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => cards
                .iter()
                .find(|c| c.ordinal == *n)
                .map(|c| c.total_memory),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => None,
        })
        .collect()
}

/// The plan of `args` (after the preset), with the model's name and layout.
pub fn make_plan(args: &PlanArgs) -> Result<(String, StageLayout, MemoryPlan)> {
    let preset = match &args.preset {
        Some(p) => Preset::from_file(p)?,
        None => Preset::default(),
    };
    let mut engine = args.engine.clone();
    preset.apply_engine(&mut engine)?;
    if preset.enable_prefix_caching == Some(false) {
        engine.no_enable_prefix_caching = true;
    }
    let mut model = args.model.clone();
    preset.apply_stages(&mut model);
    let src = Source::open(&model)?;
    // A plan is of a GPU deployment unless --device says otherwise.
    let layout = model
        .stage_flags()
        .layout(src.cfg.num_layers, Device::Cuda(0))?;
    let cfg = engine.engine_config(
        &src.cfg,
        model.default_served_name(),
        src.cfg.vocab_size,
        Vec::new(),
        None,
    )?;
    engine.check_offload(&src.cfg)?;
    let mut flags = engine.budget_flags();
    flags.vision = model.mm.tower_bytes(
        &src.cfg,
        model.model.as_deref(),
        model.model.is_none() && model.config.is_none(),
    )?;
    let budgets = flags.stage_budgets(&layout.devices, &card_totals(&layout))?;
    let stages = StageMemory::estimate(
        &src.cfg,
        &layout,
        src.form(),
        cfg.max_num_batched_tokens,
        &budgets,
    )
    .into_iter()
    .map(|s| s.offload_if(&flags, &src.cfg))
    .collect();
    let plan = MemoryPlan::new(stages, &cfg, engine.kv_cache_memory_bytes, &flags)?;
    Ok((src.name, layout, plan))
}

pub fn run(args: PlanArgs) -> Result<()> {
    let (name, layout, plan) = make_plan(&args)?;
    println!(
        "memory plan of {name}: {} pipeline stages, up to {} sequences of {} tokens, steps of {} tokens",
        layout.len(),
        plan.max_num_seqs,
        plan.cache.max_model_len,
        plan.max_num_batched_tokens
    );
    for line in plan.lines() {
        println!("memory plan: {line}");
    }
    Ok(())
}
