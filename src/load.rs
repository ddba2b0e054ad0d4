//! Where a model comes from: a checkpoint directory, random weights for a config file, or the built-in
//! default model (its trained weights embedded in the binary, or with `--load-format dummy` random
//! weights from a fixed seed; the real Qwen3.5/3.6 vocabulary either way).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{ArgMatches, Args, FromArgMatches, ValueEnum};
use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{builtin, Backend, Model, PleSource, Probe};
use sanmai_ple::PrefetchOptions;
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::{Checkpoint, Dummy, Overlay, TensorSource};

use crate::speculative::Speculative;
use crate::stages::{Device, StageFlags, StageLayout};
use crate::switches::SwitchArgs;

/// Where one stage runs without `--device`: `cuda:0` when this build has CUDA and a GPU is found,
/// else the CPU.
fn default_device() -> Device {
    #[cfg(feature = "cuda")]
    if sanmai_cuda::gpu_present() {
        return Device::Cuda(0);
    }
    Device::Cpu
}

/// The device description with the stages, when there are several (e.g. `cpu (2 threads); stages:
/// 0..2 on cpu, 2..4 on cpu`).
fn stage_names(layout: &StageLayout, device: String) -> String {
    if layout.len() == 1 {
        return device;
    }
    let stages: Vec<String> = layout
        .ranges
        .iter()
        .zip(&layout.devices)
        .map(|(r, d)| format!("layers {}..{} on {d}", r.start, r.end))
        .collect();
    format!("{device}; {} stages: {}", layout.len(), stages.join(", "))
}

/// New tokens of a request to the built-in model that gives no `max_tokens`.
const BUILTIN_DEFAULT_MAX_TOKENS: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoadFormat {
    /// Read the weights from the checkpoint's safetensors files.
    Auto,
    /// Random weights of the right shapes (for --model DIR's or --config FILE's config; without either,
    /// the built-in model's random form).
    Dummy,
}

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A Hugging Face model directory (config.json, *.safetensors, tokenizer files). Without it (and without
    /// --config) the built-in default model is used (with --load-format dummy: its random form).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// How to get the weights.
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,
    /// A config.json to build random weights for (with --load-format dummy).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory holding tokenizer.json (default: the model directory; the built-in vocabulary for
    /// models with its 248,320-row vocabulary).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Seed of dummy weights.
    #[arg(long, default_value_t = builtin::SEED)]
    pub weight_seed: u64,
    /// The PLE n-gram table directory (made with `sanmai ple create`) of a model whose config has a `ple`
    /// block. With --load-format dummy and no table, every PLE row is zero.
    #[arg(long)]
    pub ple_table: Option<PathBuf>,
    #[command(flatten)]
    pub switches: SwitchArgs,
    #[command(flatten)]
    pub mm: crate::images::MmArgs,
    /// Where the model runs: cpu, cuda or cuda:N, or one per pipeline stage (cuda:0,cuda:1,cuda:2;
    /// stages may share a GPU) [default: cuda:0 (cuda:0..N for N stages) when this build has CUDA and
    /// a GPU is found, else cpu].
    #[arg(long)]
    pub device: Option<String>,
    /// Pipeline stages: the layers split into this many contiguous ranges, each stage on its own
    /// device and worker thread [default: 1].
    #[arg(long)]
    pub pipeline_parallel_size: Option<usize>,
    /// Layers per stage, comma-separated (e.g. 16,17,15) [default: an even split, the remainder on the
    /// stages before the last].
    #[arg(long)]
    pub pp_layer_partition: Option<String>,
    // The command's `--speculative-config`, when it has one (no flag of its own).
    #[command(flatten)]
    pub speculative_config: SpeculativeFlag,
}

/// `--speculative-config` as given to the command the model flags belong to, read from its matches
/// when the command has that flag (`serve`, `generate`, `plan` through the engine flags, `bench` its
/// own): the loader keeps
/// the MTP head only for speculative decoding, and reads it from the `model` key's directory when
/// there is one. It adds no flag of its own: the command's flag is the one read.
///
/// The model flags must come before the flag's owner in a command's struct: a derived parser takes
/// its values out of the matches.
#[derive(Debug, Clone, Default)]
pub struct SpeculativeFlag(pub Option<String>);

impl SpeculativeFlag {
    /// The argument id of a command's `--speculative-config` (`EngineArgs::speculative_config`).
    const ID: &'static str = "speculative_config";

    fn read(m: &ArgMatches) -> Option<String> {
        m.try_get_one::<String>(Self::ID).ok().flatten().cloned()
    }
}

impl FromArgMatches for SpeculativeFlag {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(SpeculativeFlag(Self::read(m)))
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        if let Some(json) = Self::read(m) {
            self.0 = Some(json);
        }
        Ok(())
    }
}

impl Args for SpeculativeFlag {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        cmd
    }
}

/// A checkpoint's config as the server loads it without speculative decoding: without the MTP
/// layer, which nothing drafts with then, so neither it nor the last stage's copy of the embedding
/// it reads is held (nothing held for no use, nothing held twice). `sanmai plan` counts the same.
/// With `--speculative-config` the loader keeps the config's MTP layer ([`ModelArgs::source`]).
pub fn served(mut cfg: ModelConfig) -> ModelConfig {
    cfg.mtp_layers = 0;
    cfg
}

/// Work to do once a model is loaded, generic over the backend it was loaded on (a function that is
/// generic over the backend, as a trait because closures cannot be).
pub trait OnModel {
    type Output;
    fn run<B: Probe + 'static>(self, loaded: Loaded<B>) -> Result<Self::Output>;
}

/// A model ready to run (one [`Model`] per pipeline stage, in layer order), with its tokenizer when
/// one is available.
pub struct Loaded<B: Backend> {
    /// How the PLE table's pages are prefetched (a model with a PLE table).
    pub ple_prefetch: PrefetchOptions,
    /// Pipeline stages prepare a step before they wait for its input.
    pub pp_deferred_receive: bool,
    /// What each stage's GPU memory plan needs (empty on the CPU).
    pub gpu: Vec<crate::memory_plan::GpuMemory>,
    /// Where each stage runs.
    pub devices: Vec<Device>,
    pub name: String,
    /// The device it runs on, for logs and reports (e.g. `cpu (16 threads)`).
    pub device: String,
    /// The stages: one for the whole model, or one per `--pipeline-parallel-size`.
    pub stages: Vec<Model<B>>,
    pub tokenizer: Option<Tokenizer>,
    /// Ids below this are real tokens; the lm_head rows above it are padding.
    pub valid_vocab: usize,
    /// Ids that end generation.
    pub eos_ids: Vec<u32>,
    /// New tokens when a request gives no limit (`None`: up to the context length).
    pub default_max_tokens: Option<usize>,
    /// What prepares prompts with images (a model with a vision tower).
    pub images: Option<sanmai_engine::images::ImageEncoder>,
    /// Seconds the weights took to load (the stages and the vision tower).
    pub load_seconds: f64,
}

impl<B: Backend> Loaded<B> {
    /// The whole model on one stage, for work (`what`) that runs the model directly.
    pub fn single(&self, what: &str) -> Result<&Model<B>> {
        match self.stages.as_slice() {
            [m] => Ok(m),
            s => bail!(
                "{what} runs the model on one stage, not {} pipeline stages: serve the stages \
                 (`sanmai serve --pipeline-parallel-size N`) and measure them with `sanmai bench serve`",
                s.len()
            ),
        }
    }
}

impl ModelArgs {
    /// The stage flags as given.
    pub fn stage_flags(&self) -> StageFlags<'_> {
        StageFlags {
            pipeline_parallel_size: self.pipeline_parallel_size,
            pp_layer_partition: self.pp_layer_partition.as_deref(),
            device: self.device.as_deref(),
        }
    }

    /// Where the stages of a model of `cfg`'s shape run and which layers each holds.
    pub fn layout(&self, cfg: &ModelConfig) -> Result<StageLayout> {
        self.stage_flags().layout(cfg.num_layers, default_device())
    }

    /// Where the weights come from: the served name, the config and the tensor source. Without
    /// `--speculative-config` the config is [`served`] (no MTP layer); with it the MTP layer stays
    /// (the model must have one), and its `model` key's directory gives the `mtp.*` tensors
    /// through an [`Overlay`] over the checkpoint.
    pub fn source(&self) -> Result<(String, ModelConfig, Box<dyn TensorSource>)> {
        let (name, cfg, src) = self.source_as_written()?;
        let Some(spec) = Speculative::for_model(self.speculative_config.0.as_deref(), &cfg)? else {
            return Ok((name, served(cfg), src));
        };
        let src = match &spec.model {
            Some(dir) => self.mtp_overlay(&name, src, dir)?,
            None => src,
        };
        Ok((name, cfg, src))
    }

    /// `base` with its `mtp.*` tensors read from the checkpoint in `dir` (`--speculative-config`'s
    /// `model`).
    fn mtp_overlay(
        &self,
        name: &str,
        base: Box<dyn TensorSource>,
        dir: &Path,
    ) -> Result<Box<dyn TensorSource>> {
        let key = format!("--speculative-config: `model` {}", dir.display());
        if self.load_format == LoadFormat::Dummy {
            bail!(
                "{key}: the MTP head is read over a checkpoint's weights, and --load-format dummy \
                 makes up every weight (drop `model`, or load the checkpoint)"
            );
        }
        if self.model.is_none() {
            bail!(
                "{key}: the MTP head is read over a checkpoint's weights: give it with --model DIR"
            );
        }
        let mtp =
            Checkpoint::open(dir).with_context(|| format!("{key}: opening the checkpoint"))?;
        if !mtp.names().any(|n| n.starts_with("mtp.")) {
            bail!("{key} has no MTP tensors (mtp.*)");
        }
        tracing::info!(model = %dir.display(), "the MTP head's tensors come from the speculative config's model");
        Ok(Box::new(Overlay::new(
            "mtp.",
            base,
            format!("the checkpoint {name}"),
            Box::new(mtp),
            format!("the MTP checkpoint {}", dir.display()),
        )))
    }

    fn source_as_written(&self) -> Result<(String, ModelConfig, Box<dyn TensorSource>)> {
        Ok(match (&self.model, &self.config, self.load_format) {
            (Some(_), Some(_), _) => bail!("give either --model DIR or --config FILE, not both"),
            (None, Some(_), LoadFormat::Auto) => {
                bail!("--config FILE builds random weights: add --load-format dummy, or use --model DIR")
            }
            (Some(dir), None, format) => {
                let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
                let src: Box<dyn TensorSource> =
                    match format {
                        LoadFormat::Auto => Box::new(Checkpoint::open(dir).with_context(|| {
                            format!("opening the checkpoint in {}", dir.display())
                        })?),
                        LoadFormat::Dummy => Box::new(
                            Dummy::new(self.weight_seed)
                                .with_quantization(cfg.quantization.clone())
                                .with_fp8(cfg.fp8.clone()),
                        ),
                    };
                (dir.display().to_string(), cfg, src)
            }
            (None, Some(file), LoadFormat::Dummy) => {
                let cfg = ModelConfig::from_file(file)?;
                let src = Dummy::new(self.weight_seed)
                    .with_quantization(cfg.quantization.clone())
                    .with_fp8(cfg.fp8.clone());
                (file.display().to_string(), cfg, Box::new(src))
            }
            (None, None, LoadFormat::Auto) => (
                builtin::NAME.to_string(),
                builtin::trained_config(),
                Box::new(builtin::trained_checkpoint()),
            ),
            // The random built-in model: shapes, not answers.
            (None, None, LoadFormat::Dummy) => (
                builtin::NAME.to_string(),
                builtin::config(),
                Box::new(Dummy::new(self.weight_seed)),
            ),
        })
    }

    /// Loads the model's stages on their devices and hands them to `work`.
    pub fn load_then<W: OnModel>(&self, work: W) -> Result<W::Output> {
        let (name, cfg, source) = self.source()?;
        let layout = self.layout(&cfg)?;
        let desc = |d: String| stage_names(&layout, d);
        match layout.devices[0] {
            Device::Cpu => {
                let cuda_flags = self.switches.cuda_flags();
                if !cuda_flags.is_empty() {
                    tracing::warn!(flags = ?cuda_flags, "CUDA switches have no effect on the CPU");
                }
                let threads = rayon::current_num_threads();
                let backends = layout.devices.iter().map(|_| Ok(CpuBackend::new()));
                let loaded = self.load_stages(
                    (name, cfg, source.as_ref()),
                    &layout,
                    backends,
                    desc(format!("cpu ({threads} threads)")),
                )?;
                work.run(loaded)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                let options = self.switches.cuda_options();
                let mut info = None;
                let backends = layout.devices.iter().map(|d| {
                    let Device::Cuda(n) = *d else {
                        unreachable!("a layout's devices are all CPU or all CUDA")
                    };
                    let backend = sanmai_cuda::CudaBackend::new(n, &options)
                        .with_context(|| format!("opening CUDA device {n}"))?;
                    backend.gpu().keep_pool_memory()?;
                    info.get_or_insert_with(|| backend.gpu().info().clone());
                    Ok(backend)
                });
                let backends: Vec<Result<_>> = backends.collect();
                let Some(info) = info else {
                    // No device opened: the first one's error says why.
                    return Err(backends
                        .into_iter()
                        .find_map(Result::err)
                        .unwrap_or_else(|| anyhow::anyhow!("no pipeline stage to load")));
                };
                let mut device = format!("cuda ({}", info.name);
                if !options.cuda_graphs {
                    device.push_str(", CUDA graphs off");
                }
                if !options.gpu.pdl {
                    device.push_str(", PDL off");
                }
                device.push(')');
                let mut loaded = self.load_stages(
                    (name, cfg, source.as_ref()),
                    &layout,
                    backends.into_iter(),
                    desc(device),
                )?;
                // The vision tower runs on stage 0's device.
                if let Some(encoder) = loaded.images.take() {
                    let gpu = loaded.stages[0].backend.gpu();
                    let on_host = self.mm.vit_on_host;
                    let tower = sanmai_cuda::CudaTower::new(encoder.vision(), gpu, on_host)
                        .context("loading the vision tower on the GPU")?;
                    loaded.images = Some(encoder.with_tower(Box::new(tower)));
                }
                loaded.gpu = loaded
                    .stages
                    .iter()
                    .map(|m| {
                        let info = m.backend.gpu().info().clone();
                        let ctx = m.backend.gpu().context().clone();
                        let report = m.backend.memory();
                        crate::memory_plan::GpuMemory {
                            total: info.total_memory,
                            weights: report.weights,
                            workspace: report.workspace,
                            free: Box::new(move || Ok(sanmai_cuda::device_memory(&ctx)?.0)),
                        }
                    })
                    .collect();
                work.run(loaded)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => bail!(
                "--device {}: this build has no CUDA support (build with `--features cuda`)",
                self.device.as_deref().unwrap_or("cuda")
            ),
        }
    }

    /// Loads stage `i` of `layout` on the `i`-th backend.
    fn load_stages<B: Backend>(
        &self,
        (name, cfg, source): (String, ModelConfig, &dyn TensorSource),
        layout: &StageLayout,
        backends: impl Iterator<Item = Result<B>>,
        device: String,
    ) -> Result<Loaded<B>> {
        let started = Instant::now();
        let tokenizer = self.tokenizer(&cfg)?;
        let ple = self.ple_source(&cfg)?;
        let mut stages = Vec::with_capacity(layout.len());
        for (range, backend) in layout.ranges.iter().zip(backends) {
            let model =
                Model::load_stage(cfg.clone(), source, backend?, ple.clone(), range.clone())
                    .with_context(|| format!("loading the weights of {name}"))?;
            stages.push(model);
        }
        let cfg = &stages[0].cfg;
        let valid_vocab = match &tokenizer {
            Some(t) => t.backend().get_vocab_size(true).min(cfg.vocab_size),
            None => cfg.vocab_size,
        };
        let mut eos_ids = cfg.eos_token_ids.clone();
        if let Some(t) = &tokenizer {
            eos_ids.extend(t.eos_token_ids());
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        tracing::info!(
            model = %name,
            device = %device,
            arch = cfg.arch.model_type(),
            layers = cfg.num_layers,
            hidden = cfg.hidden_size,
            vocab = cfg.vocab_size,
            seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
            "model loaded"
        );
        let images = self.mm.encoder(
            cfg,
            source,
            self.model.as_deref(),
            self.model.is_none() && self.config.is_none(),
        )?;
        let default_max_tokens = match &self.model {
            None if self.config.is_none() => Some(BUILTIN_DEFAULT_MAX_TOKENS),
            Some(dir) => generation_max_new_tokens(dir),
            None => None,
        };
        Ok(Loaded {
            ple_prefetch: self.switches.ple_prefetch(),
            pp_deferred_receive: self.switches.pp_deferred_receive(),
            gpu: Vec::new(),
            devices: layout.devices.clone(),
            name,
            device,
            stages,
            tokenizer,
            valid_vocab,
            eos_ids,
            default_max_tokens,
            images,
            load_seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Where a PLE model's table rows come from: `--ple-table`, or zero rows for dummy weights.
    fn ple_source(&self, cfg: &ModelConfig) -> Result<Option<PleSource>> {
        let dummy = self.load_format == LoadFormat::Dummy || self.model.is_none();
        match (&cfg.ple, &self.ple_table) {
            (None, None) => Ok(None),
            (None, Some(_)) => bail!("--ple-table: the model config has no `ple` block"),
            (Some(_), None) if dummy => Ok(Some(PleSource::Zeros)),
            (Some(_), None) => {
                bail!("the model config has a `ple` block: give its table with --ple-table DIR")
            }
            (Some(p), Some(dir)) => {
                Ok(Some(PleSource::open(dir, p, dummy).with_context(|| {
                    format!("--ple-table {}", dir.display())
                })?))
            }
        }
    }

    /// The name the model is served under by default.
    pub fn default_served_name(&self) -> String {
        match (&self.model, &self.config) {
            (Some(dir), _) => dir.file_name().map_or_else(
                || dir.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            (None, Some(file)) => file.file_stem().map_or_else(
                || file.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            (None, None) => builtin::NAME.to_string(),
        }
    }

    fn tokenizer(&self, cfg: &ModelConfig) -> Result<Option<Tokenizer>> {
        let dir = self.tokenizer.as_ref().or(self.model.as_ref());
        if let Some(dir) = dir {
            if dir.join("tokenizer.json").exists() {
                return Ok(Some(Tokenizer::from_dir(dir)?));
            }
            if self.tokenizer.is_some() {
                bail!("{}: no tokenizer.json", dir.display());
            }
        }
        if cfg.vocab_size == builtin::config().vocab_size {
            return Ok(Some(Tokenizer::builtin()?));
        }
        Ok(None)
    }
}

/// `max_new_tokens` from a checkpoint's `generation_config.json`, if it sets one.
fn generation_max_new_tokens(dir: &std::path::Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("generation_config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("max_new_tokens")?.as_u64().map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command};

    fn parse<A: Args>(args: &[&str]) -> A {
        let cmd = A::augment_args(Command::new("sanmai"));
        cmd.clone().debug_assert();
        A::from_arg_matches(&cmd.try_get_matches_from(args).unwrap()).unwrap()
    }

    #[test]
    fn model_flags_read_the_commands_speculative_config() {
        let json = r#"{"method": "mtp", "model": "/x"}"#;
        let argv = ["sanmai", "--model", "m", "--speculative-config", json];
        let g: crate::generate::GenerateArgs = parse(&argv);
        assert_eq!(g.model.speculative_config.0.as_deref(), Some(json));
        assert_eq!(g.engine.speculative_config.as_deref(), Some(json));
        let s: crate::serve::ServeArgs = parse(&argv);
        assert_eq!(s.model.speculative_config.0.as_deref(), Some(json));
        assert_eq!(s.engine.speculative_config.as_deref(), Some(json));
        let p: crate::plan::PlanArgs = parse(&argv);
        assert_eq!(p.model.speculative_config.0.as_deref(), Some(json));
        let b: crate::bench::BenchArgs = parse(&argv);
        assert_eq!(b.model.speculative_config.0.as_deref(), Some(json));
        assert_eq!(b.speculative_config.as_deref(), Some(json));
        // Without the flag.
        let g: crate::generate::GenerateArgs = parse(&["sanmai", "--model", "m"]);
        assert_eq!(g.model.speculative_config.0, None);
        let b: crate::bench::BenchArgs = parse(&["sanmai", "--batch", "2"]);
        assert_eq!(b.model.speculative_config.0, None);
    }
}
