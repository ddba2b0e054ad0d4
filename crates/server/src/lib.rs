//! The OpenAI-compatible HTTP API of sanmai: routes, request validation (OpenAI JSON → engine requests),
//! chat-template rendering, image parts (fetched under the media policy: [`media`]), structured output
//! (JSON schema and mode, forced tool calls, regex, choice and Lark grammars, compiled with llguidance),
//! reasoning and tool-call parsing of outputs, responses and server-sent events in OpenAI's shapes,
//! Prometheus metrics, the API key, and graceful shutdown.
//!
//! A [`Server`] answers as soon as it listens: `/health` and the model routes say 503 until
//! [`Server::set_ready`] installs the engine (so a load balancer can watch a model load).
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `POST /tokenize`,
//! `POST /detokenize`, `GET /health`, `GET /version`, `GET /metrics`. Errors are
//! `{"error":{"message","type","param","code"}}`; a panic while handling one request answers that request
//! with a 500 and leaves the others alone.

mod chat;
mod completions;
pub mod error;
mod logprobs;
pub mod media;
pub mod metrics;
mod output;
mod params;
mod render;
mod request;
mod response;
mod routes;
mod state;
mod stream;
mod structured;
mod task;

use axum::serve::ListenerExt;
use std::future::Future;
use std::sync::Arc;

use sanmai_engine::EngineHandle;
use sanmai_tokenizer::parsers::detect_from_template;
use sanmai_tokenizer::Tokenizer;
use tokio::net::TcpListener;

pub use error::ApiError;
pub use output::ToolFormat;
pub use state::{ServerConfig, DEFAULT_MAX_REQUEST_BYTES};

use logprobs::TokenText;
use state::{AppState, Ready};

/// The HTTP server. Cloning is cheap (shared state).
#[derive(Clone)]
pub struct Server {
    state: Arc<AppState>,
}

/// Failures of the server itself (not of a request).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("the server already has a model")]
    AlreadyReady,
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Server {
    pub fn new(config: ServerConfig) -> Server {
        Server {
            state: Arc::new(AppState::new(config)),
        }
    }

    pub fn config(&self) -> &ServerConfig {
        &self.state.config
    }

    /// Installs the running engine and the model's tokenizer; model routes answer from now on.
    /// The chat template is `--chat-template`'s or the tokenizer's; the tool-call format is
    /// `--tool-call-parser`'s or read from that template.
    pub fn set_ready(
        &self,
        engine: EngineHandle,
        tokenizer: Option<Tokenizer>,
    ) -> Result<(), ServerError> {
        let cfg = &self.state.config;
        let template = cfg
            .chat_template
            .clone()
            .or_else(|| tokenizer.as_ref().and_then(|t| t.chat_template().cloned()));
        let tool_format = cfg.tool_call_parser.unwrap_or_else(|| {
            detect_from_template(template.as_ref().map(|t| t.source()).unwrap_or(""))
        });
        tracing::info!(
            model = %cfg.served_model_name,
            max_model_len = engine.info().max_model_len,
            chat_template = template.is_some(),
            tool_call_parser = tool_format.name(),
            "model ready"
        );
        let ready = Ready {
            engine,
            token_text: TokenText::new(tokenizer.clone()),
            tokenizer,
            template,
            tool_format,
            compilers: structured::Compilers::default(),
        };
        if !self.state.set_ready(ready) {
            return Err(ServerError::AlreadyReady);
        }
        // The structured-output token trie is built in the background, once.
        let state = self.state.clone();
        let spawned = std::thread::Builder::new()
            .name("sanmai-grammar-init".into())
            .spawn(move || {
                if let Some(r) = state.try_ready() {
                    if let Some(tok) = &r.tokenizer {
                        let _ = r.compilers.get(tok);
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "the token trie will be built by the first constrained request");
        }
        Ok(())
    }

    /// Whether the model is loaded.
    pub fn is_ready(&self) -> bool {
        self.state.try_ready().is_some()
    }

    /// The router, for embedding or testing.
    pub fn router(&self) -> axum::Router {
        routes::router(self.state.clone())
    }

    /// Serves on `listener` until `shutdown` resolves; then stops accepting, shuts the engine down (its
    /// running requests finish as aborted, so streams end cleanly) and waits for open responses.
    pub async fn run(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let state = self.state.clone();
        // Tokens are small writes: without TCP_NODELAY, Nagle's algorithm holds them back for ~40 ms on a
        // reused connection.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::warn!(error = %e, "could not set TCP_NODELAY");
            }
        });
        axum::serve(listener, self.router())
            .with_graceful_shutdown(async move {
                shutdown.await;
                tracing::info!("shutting down: no new connections, aborting running requests");
                if let Some(ready) = state.try_ready() {
                    // The engine's thread is joined off the runtime's workers.
                    let engine = ready.engine.clone();
                    let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
                }
            })
            .await?;
        Ok(())
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
