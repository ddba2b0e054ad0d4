//! `sanmai serve`: the OpenAI-compatible HTTP server. It listens first (so `/health` answers 503 while
//! the model loads), loads the model, starts the engine loop, and shuts down gracefully on SIGTERM or
//! Ctrl-C. A `--preset` TOML file supplies serve flags; flags given on the command line win.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use sanmai_server::media::MediaPolicy;
use sanmai_server::{Server, ServerConfig, ToolFormat, DEFAULT_MAX_REQUEST_BYTES};
use sanmai_tokenizer::ChatTemplate;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::engine_args::EngineArgs;
use crate::load::{Loaded, ModelArgs, OnModel};

/// How long in-flight responses may take to end after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A TOML file of serve flags (e.g. configs/deploy/3x3090.toml); command-line flags override it.
    #[arg(long)]
    pub preset: Option<PathBuf>,
    /// Address to bind [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to bind (0 picks a free one) [default: 8000].
    #[arg(long)]
    pub port: Option<u16>,
    /// The model name clients send [default: the model directory's name, or sanmai-demo for the
    /// built-in model].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize. Also read from the
    /// environment (SANMAI_API_KEY), which keeps the key off the command line.
    #[arg(long, env = "SANMAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Read the API key from this file (its first line; a container secret, for example).
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// A Jinja chat template file replacing the tokenizer's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Tool-call format: qwen3_xml (qwen3_coder) or qwen3_json (hermes) [default: read from the chat
    /// template].
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Chat template variables every request starts from, as JSON (e.g. '{"enable_thinking": false}');
    /// the built-in model defaults to thinking off.
    #[arg(long)]
    pub default_chat_template_kwargs: Option<String>,
    /// Largest request body in bytes [default: 64 MiB].
    #[arg(long)]
    pub max_request_bytes: Option<usize>,
    /// Turn prefix caching on (the default; overrides a preset that turns it off).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Let `file://` image URLs read files inside this folder (symlinks and `..` cannot leave it)
    /// [default: no local files].
    #[arg(long, value_name = "DIR")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// The only hosts `http(s)://` image URLs (and their redirects) may name; space- or
    /// comma-separated, or repeated [default: any host].
    #[arg(long, value_name = "HOST", value_delimiter = ',', num_args = 1..)]
    pub allowed_media_domains: Vec<String>,
    /// Seconds an image URL's fetch may take, connecting and reading included [default: 10].
    #[arg(long, value_name = "SECONDS")]
    pub media_fetch_timeout: Option<f64>,
}

/// The serve flags a preset file may hold (kebab-case keys, as on the command line); any other key
/// is an error.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Preset {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub served_model_name: Option<String>,
    pub max_model_len: Option<usize>,
    pub chat_template: Option<PathBuf>,
    pub tool_call_parser: Option<String>,
    /// A table or a JSON string.
    pub default_chat_template_kwargs: Option<toml::Value>,
    pub max_request_bytes: Option<usize>,
    pub max_num_seqs: Option<usize>,
    pub max_num_batched_tokens: Option<usize>,
    pub max_waiting_requests: Option<usize>,
    pub block_size: Option<usize>,
    pub kv_cache_memory_bytes: Option<usize>,
    pub state_checkpoint_interval: Option<usize>,
    pub enable_prefix_caching: Option<bool>,
    pub gpu_memory_utilization: Option<f64>,
    /// Bytes, as on the command line (e.g. "23.5GiB").
    pub gpu_memory_budget: Option<String>,
    pub pipeline_parallel_size: Option<usize>,
    /// Layers per stage (e.g. "16,17,15").
    pub pp_layer_partition: Option<String>,
    /// One device, or one per stage (e.g. "cuda:0,cuda:1,cuda:2").
    pub device: Option<String>,
    pub qsa_kv_offload: Option<bool>,
    pub qsa_row_cache_rows: Option<usize>,
    /// Bytes, as on the command line (e.g. "8GiB").
    pub host_memory_reserve: Option<String>,
    /// A JSON string, as on the command line.
    pub speculative_config: Option<String>,
    /// JSON strings, as on the command line.
    pub limit_mm_per_prompt: Option<String>,
    pub mm_processor_kwargs: Option<String>,
    pub vit_on_host: Option<bool>,
}

impl Preset {
    pub fn from_file(path: &Path) -> Result<Preset> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the preset {}", path.display()))?;
        let preset: Preset = toml::from_str(&text)
            .with_context(|| format!("parsing the preset {}", path.display()))?;
        Ok(preset)
    }

    /// Fills the engine flags not given on the command line from the preset.
    pub fn apply_engine(&self, e: &mut EngineArgs) -> Result<()> {
        e.max_model_len = e.max_model_len.or(self.max_model_len);
        e.max_num_seqs = e.max_num_seqs.or(self.max_num_seqs);
        e.max_num_batched_tokens = e.max_num_batched_tokens.or(self.max_num_batched_tokens);
        e.max_waiting_requests = e.max_waiting_requests.or(self.max_waiting_requests);
        e.block_size = e.block_size.or(self.block_size);
        e.kv_cache_memory_bytes = e.kv_cache_memory_bytes.or(self.kv_cache_memory_bytes);
        e.state_checkpoint_interval = e
            .state_checkpoint_interval
            .or(self.state_checkpoint_interval);
        e.gpu_memory_utilization = e.gpu_memory_utilization.or(self.gpu_memory_utilization);
        if e.gpu_memory_budget.is_none() {
            if let Some(text) = &self.gpu_memory_budget {
                let b = text
                    .parse()
                    .map_err(|m| anyhow::anyhow!("preset gpu-memory-budget {m}"))?;
                e.gpu_memory_budget = Some(b);
            }
        }
        e.qsa_kv_offload |= self.qsa_kv_offload.unwrap_or(false);
        e.speculative_config = e
            .speculative_config
            .clone()
            .or(self.speculative_config.clone());
        e.qsa_row_cache_rows = e.qsa_row_cache_rows.or(self.qsa_row_cache_rows);
        if e.host_memory_reserve.is_none() {
            if let Some(text) = &self.host_memory_reserve {
                let b = text
                    .parse()
                    .map_err(|m| anyhow::anyhow!("preset host-memory-reserve {m}"))?;
                e.host_memory_reserve = Some(b);
            }
        }
        Ok(())
    }

    /// Fills the pipeline stage flags, the image flags (and the loader's view of
    /// `speculative-config`) not given on the command line from the preset.
    pub fn apply_stages(&self, m: &mut ModelArgs) {
        m.pipeline_parallel_size = m.pipeline_parallel_size.or(self.pipeline_parallel_size);
        m.pp_layer_partition = m
            .pp_layer_partition
            .clone()
            .or(self.pp_layer_partition.clone());
        m.device = m.device.clone().or(self.device.clone());
        m.mm.limit_mm_per_prompt =
            m.mm.limit_mm_per_prompt
                .clone()
                .or(self.limit_mm_per_prompt.clone());
        m.mm.mm_processor_kwargs =
            m.mm.mm_processor_kwargs
                .clone()
                .or(self.mm_processor_kwargs.clone());
        m.mm.vit_on_host |= self.vit_on_host.unwrap_or(false);
        // The loader keeps the MTP head for speculative decoding.
        m.speculative_config.0 = m
            .speculative_config
            .0
            .clone()
            .or(self.speculative_config.clone());
    }
}

/// Everything `serve` runs with, after the preset and defaults are applied.
#[derive(Debug, Clone)]
pub struct Settings {
    pub addr: String,
    pub server: ServerConfig,
    pub engine: EngineArgs,
    /// The model flags with the preset's stage keys applied.
    pub model: ModelArgs,
}

impl ServeArgs {
    /// Applies the preset (command-line flags win) and the defaults, and checks the server's flags.
    pub fn settings(&self) -> Result<Settings> {
        let preset = match &self.preset {
            Some(p) => Preset::from_file(p)?,
            None => Preset::default(),
        };
        let mut engine = self.engine.clone();
        preset.apply_engine(&mut engine)?;
        let mut model = self.model.clone();
        preset.apply_stages(&mut model);
        let builtin = self.model.model.is_none() && self.model.config.is_none();
        let kwargs = match (
            &self.default_chat_template_kwargs,
            &preset.default_chat_template_kwargs,
        ) {
            (Some(s), _) => Some(parse_kwargs(s).context("--default-chat-template-kwargs")?),
            (None, Some(toml::Value::String(s))) => {
                Some(parse_kwargs(s).context("preset default-chat-template-kwargs")?)
            }
            (None, Some(v)) => match serde_json::to_value(v)? {
                Value::Object(m) => Some(m),
                _ => bail!("preset default-chat-template-kwargs must be a table"),
            },
            (None, None) => None,
        };
        let default_kwargs = kwargs.unwrap_or_else(|| {
            let mut m = Map::new();
            if builtin {
                // The built-in model answers in `content` (thinking off) unless a request asks.
                m.insert("enable_thinking".into(), Value::Bool(false));
            }
            m
        });
        let chat_template = match self.chat_template.clone().or(preset.chat_template) {
            Some(path) => {
                let src = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading the chat template {}", path.display()))?;
                Some(
                    ChatTemplate::new(&src)
                        .with_context(|| format!("compiling {}", path.display()))?,
                )
            }
            None => None,
        };
        let tool_call_parser = match self.tool_call_parser.clone().or(preset.tool_call_parser) {
            Some(name) => Some(ToolFormat::from_name(&name).context("--tool-call-parser")?),
            None => None,
        };
        let host = self
            .host
            .clone()
            .or(preset.host)
            .unwrap_or_else(|| "127.0.0.1".into());
        let port = self.port.or(preset.port).unwrap_or(8000);
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let name = self
            .served_model_name
            .clone()
            .or(preset.served_model_name)
            .unwrap_or_else(|| self.model.default_served_name());
        let mut server = ServerConfig::new(name);
        server.api_key = match &self.api_key_file {
            Some(path) => Some(read_api_key(path)?),
            None => self.api_key.clone().filter(|k| !k.is_empty()),
        };
        server.max_request_bytes = self
            .max_request_bytes
            .or(preset.max_request_bytes)
            .unwrap_or(DEFAULT_MAX_REQUEST_BYTES);
        if server.max_request_bytes == 0 {
            bail!("--max-request-bytes must be at least 1");
        }
        server.default_chat_template_kwargs = default_kwargs;
        server.chat_template = chat_template;
        server.tool_call_parser = tool_call_parser;
        server.media = self.media_policy()?;

        let e = &mut engine;
        e.no_enable_prefix_caching = if self.enable_prefix_caching {
            false
        } else {
            e.no_enable_prefix_caching || preset.enable_prefix_caching == Some(false)
        };
        Ok(Settings {
            addr,
            server,
            engine,
            model,
        })
    }
}

impl ServeArgs {
    /// `--allowed-local-media-path`, `--allowed-media-domains` and `--media-fetch-timeout`.
    fn media_policy(&self) -> Result<MediaPolicy> {
        let mut media = MediaPolicy::default();
        if let Some(dir) = &self.allowed_local_media_path {
            let real = std::fs::canonicalize(dir).with_context(|| {
                format!(
                    "--allowed-local-media-path {}: cannot open it",
                    dir.display()
                )
            })?;
            if !real.is_dir() {
                bail!(
                    "--allowed-local-media-path {}: not a directory",
                    dir.display()
                );
            }
            media.allowed_local_path = Some(real);
        }
        if !self.allowed_media_domains.is_empty() {
            let mut hosts = Vec::new();
            for host in &self.allowed_media_domains {
                let host = host.trim();
                if host.is_empty() {
                    bail!("--allowed-media-domains: an empty host name");
                }
                hosts.push(host.to_ascii_lowercase());
            }
            media.allowed_domains = Some(hosts);
        }
        if let Some(secs) = self.media_fetch_timeout {
            media.timeout = Duration::try_from_secs_f64(secs)
                .ok()
                .filter(|t| !t.is_zero())
                .with_context(|| {
                    format!("--media-fetch-timeout {secs}: must be a positive number of seconds")
                })?;
        }
        Ok(media)
    }
}

/// The API key in `path`: its first line, trimmed; an unreadable or empty file is an error naming it.
fn read_api_key(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--api-key-file {}: cannot read it", path.display()))?;
    let key = text.lines().next().unwrap_or("").trim();
    if key.is_empty() {
        bail!("--api-key-file {}: the file holds no key", path.display());
    }
    Ok(key.to_string())
}

fn parse_kwargs(text: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text).context("not valid JSON")? {
        Value::Object(m) => Ok(m),
        _ => bail!("must be a JSON object"),
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let settings = args.settings()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("sanmai-http")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(settings))
}

async fn serve(s: Settings) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(&s.addr)
        .await
        .with_context(|| format!("binding {}", s.addr))?;
    let addr: SocketAddr = listener.local_addr()?;
    let name = s.server.served_model_name.clone();
    let server = Server::new(s.server.clone());
    tracing::info!(model = %name, "listening on http://{addr}");

    let http = {
        let server = server.clone();
        tokio::spawn(async move {
            server
                .run(listener, async {
                    sanmai_server::shutdown_signal().await;
                    // In-flight responses get a grace period; then the process ends regardless.
                    std::thread::spawn(|| {
                        std::thread::sleep(SHUTDOWN_GRACE);
                        tracing::warn!("responses still open after the grace period; exiting");
                        std::process::exit(1);
                    });
                })
                .await
        })
    };
    let loading = {
        let server = server.clone();
        tokio::task::spawn_blocking(move || load_and_start(&server, &s))
    };
    tokio::pin!(http);
    tokio::select! {
        res = &mut http => {
            res.context("the HTTP server task failed")??;
            tracing::info!("stopped before the model finished loading");
            return Ok(());
        }
        res = loading => {
            res.context("the loading task failed")??;
        }
    }
    http.await.context("the HTTP server task failed")??;
    tracing::info!("server stopped");
    Ok(())
}

/// Loads the model, starts the engine and hands it to the server.
fn load_and_start(server: &Server, s: &Settings) -> Result<()> {
    s.model.load_then(StartEngine { server, s })
}

struct StartEngine<'a> {
    server: &'a Server,
    s: &'a Settings,
}

impl OnModel for StartEngine<'_> {
    type Output = ();

    fn run<B: sanmai_model::Probe + 'static>(self, loaded: Loaded<B>) -> Result<()> {
        let tokenizer = loaded.tokenizer.clone();
        let engine = self
            .s
            .engine
            .start(loaded, self.server.config().served_model_name.clone())
            .context("starting the engine")?;
        self.server.set_ready(engine, tokenizer)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn args(argv: &[&str]) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("serve").chain(argv.iter().copied()))
            .unwrap()
            .serve
    }

    fn repo_file(rel: &str) -> String {
        format!("{}/{rel}", env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn defaults_for_the_builtin_model() {
        let s = args(&[]).settings().unwrap();
        assert_eq!(s.addr, "127.0.0.1:8000");
        assert_eq!(s.server.served_model_name, "sanmai-demo");
        assert_eq!(
            s.server.default_chat_template_kwargs["enable_thinking"],
            false
        );
        assert_eq!(s.server.max_request_bytes, 64 << 20);
        assert!(s.server.api_key.is_none());
        assert!(!s.engine.no_enable_prefix_caching);
        assert_eq!(s.engine.max_num_seqs, None);
    }

    #[test]
    fn presets_apply_and_flags_override() {
        let preset = repo_file("configs/deploy/3x3090.toml");
        let s = args(&["--preset", &preset]).settings().unwrap();
        assert_eq!(s.engine.max_num_seqs, Some(4));
        assert_eq!(s.engine.max_num_batched_tokens, Some(256));
        assert_eq!(s.engine.max_model_len, Some(262_144));
        assert!(!s.engine.no_enable_prefix_caching);
        assert_eq!(s.model.pipeline_parallel_size, Some(3));
        assert!(s.engine.qsa_kv_offload);
        let s = args(&[
            "--preset",
            &preset,
            "--max-num-seqs",
            "8",
            "--no-enable-prefix-caching",
            "--served-model-name",
            "qwen",
        ])
        .settings()
        .unwrap();
        assert_eq!(s.engine.max_num_seqs, Some(8));
        assert_eq!(s.engine.max_num_batched_tokens, Some(256));
        assert!(s.engine.no_enable_prefix_caching);
        assert_eq!(s.server.served_model_name, "qwen");
        let h200 = repo_file("configs/deploy/1xh200.toml");
        let s = args(&["--preset", &h200]).settings().unwrap();
        assert_eq!(s.engine.max_num_seqs, Some(256));
        assert_eq!(s.model.pipeline_parallel_size, None);
        let mtp = repo_file("configs/deploy/3x3090-mtp.toml");
        let s = args(&["--preset", &mtp]).settings().unwrap();
        assert_eq!(s.engine.max_num_seqs, Some(1));
        assert_eq!(s.model.pipeline_parallel_size, Some(3));
        assert_eq!(s.model.pp_layer_partition.as_deref(), Some("16,17,15"));
        let spec = s.engine.speculative_config.as_deref().unwrap();
        assert!(spec.contains("\"num_speculative_tokens\": 1"), "{spec}");

        // A preset's kwargs table and its prefix-caching switch; the flag turns caching back on.
        let dir = std::env::temp_dir().join(format!("sanmai-preset-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("p.toml");
        std::fs::write(
            &file,
            "enable-prefix-caching = false\nport = 9001\n[default-chat-template-kwargs]\nenable_thinking = true\n",
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let s = args(&["--preset", f]).settings().unwrap();
        assert!(s.engine.no_enable_prefix_caching);
        assert_eq!(s.addr, "127.0.0.1:9001");
        assert_eq!(
            s.server.default_chat_template_kwargs["enable_thinking"],
            true
        );
        let s = args(&["--preset", f, "--enable-prefix-caching", "--port", "9002"])
            .settings()
            .unwrap();
        assert!(!s.engine.no_enable_prefix_caching);
        assert_eq!(s.addr, "127.0.0.1:9002");
        std::fs::write(&file, "max-num-seqs = \"four\"\n").unwrap();
        assert!(args(&["--preset", f]).settings().is_err());
        // Stage keys apply; the flags win.
        std::fs::write(
            &file,
            "pipeline-parallel-size = 2\npp-layer-partition = \"1,3\"\ndevice = \"cpu\"\n",
        )
        .unwrap();
        let s = args(&["--preset", f]).settings().unwrap();
        assert_eq!(s.model.pipeline_parallel_size, Some(2));
        assert_eq!(s.model.pp_layer_partition.as_deref(), Some("1,3"));
        assert_eq!(s.model.device.as_deref(), Some("cpu"));
        let s = args(&[
            "--preset",
            f,
            "--pipeline-parallel-size",
            "3",
            "--pp-layer-partition",
            "1,1,2",
        ])
        .settings()
        .unwrap();
        assert_eq!(s.model.pipeline_parallel_size, Some(3));
        assert_eq!(s.model.pp_layer_partition.as_deref(), Some("1,1,2"));
        // A key no flag has is an error naming it.
        std::fs::write(&file, "num-speculative-tokens = 2\n").unwrap();
        let err = format!("{:#}", args(&["--preset", f]).settings().unwrap_err());
        assert!(err.contains("num-speculative-tokens"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_api_key_comes_from_a_flag_or_a_file() {
        let dir = std::env::temp_dir().join(format!("sanmai-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "s3cret\n").unwrap();
        let f = file.to_str().unwrap();
        let s = args(&["--api-key-file", f]).settings().unwrap();
        assert_eq!(s.server.api_key.as_deref(), Some("s3cret"));
        let s = args(&["--api-key", "k"]).settings().unwrap();
        assert_eq!(s.server.api_key.as_deref(), Some("k"));
        std::fs::write(&file, "\n").unwrap();
        let err = format!("{:#}", args(&["--api-key-file", f]).settings().unwrap_err());
        assert!(
            err.contains("--api-key-file") && err.contains("no key"),
            "{err}"
        );
        let missing = dir.join("missing");
        let err = format!(
            "{:#}",
            args(&["--api-key-file", missing.to_str().unwrap()])
                .settings()
                .unwrap_err()
        );
        assert!(err.contains("cannot read"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn media_flags_fill_the_media_policy() {
        let s = args(&[]).settings().unwrap();
        assert_eq!(s.server.media.allowed_local_path, None);
        assert_eq!(s.server.media.allowed_domains, None);
        assert_eq!(s.server.media.timeout, Duration::from_secs(10));

        let dir = std::env::temp_dir().join(format!("sanmai-media-flags-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("images")).unwrap();
        let images = dir.join("images");
        let s = args(&[
            "--allowed-local-media-path",
            images.to_str().unwrap(),
            "--allowed-media-domains",
            "Example.com,cdn.example.com",
            "upload.wikimedia.org",
            "--allowed-media-domains",
            "images.test",
            "--media-fetch-timeout",
            "2.5",
        ])
        .settings()
        .unwrap();
        let media = &s.server.media;
        assert_eq!(
            media.allowed_local_path.as_deref(),
            Some(images.canonicalize().unwrap().as_path())
        );
        assert_eq!(
            media.allowed_domains.as_deref().unwrap(),
            [
                "example.com",
                "cdn.example.com",
                "upload.wikimedia.org",
                "images.test"
            ]
        );
        assert_eq!(media.timeout, Duration::from_millis(2500));

        let missing = dir.join("missing");
        let err = format!(
            "{:#}",
            args(&["--allowed-local-media-path", missing.to_str().unwrap()])
                .settings()
                .unwrap_err()
        );
        assert!(
            err.contains("--allowed-local-media-path") && err.contains(missing.to_str().unwrap()),
            "{err}"
        );
        let file = dir.join("file.png");
        std::fs::write(&file, b"x").unwrap();
        let err = format!(
            "{:#}",
            args(&["--allowed-local-media-path", file.to_str().unwrap()])
                .settings()
                .unwrap_err()
        );
        assert!(err.ends_with("not a directory"), "{err}");
        for bad in ["0", "-1", "nan", "inf"] {
            let err = format!(
                "{:#}",
                args(&[&format!("--media-fetch-timeout={bad}")])
                    .settings()
                    .unwrap_err()
            );
            assert!(err.contains("--media-fetch-timeout"), "{bad}: {err}");
        }
        let err = format!(
            "{:#}",
            args(&["--allowed-media-domains", "a.test,,b.test"])
                .settings()
                .unwrap_err()
        );
        assert!(err.contains("empty host"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_flags_are_refused() {
        for argv in [
            &["--default-chat-template-kwargs", "[1]"][..],
            &["--default-chat-template-kwargs", "{"],
            &["--tool-call-parser", "nope"],
            &["--max-request-bytes", "0"],
            &["--chat-template", "no/such/template.jinja"],
            &["--preset", "no/such/preset.toml"],
        ] {
            assert!(args(argv).settings().is_err(), "{argv:?}");
        }
        let s = args(&[
            "--default-chat-template-kwargs",
            r#"{"enable_thinking": true}"#,
            "--host",
            "::1",
            "--port",
            "0",
        ])
        .settings()
        .unwrap();
        assert_eq!(
            s.server.default_chat_template_kwargs["enable_thinking"],
            true
        );
        assert_eq!(s.addr, "[::1]:0");
    }
}
