//! The server's settings ([`ServerConfig`]) and its shared state: the engine and tokenizer once the model
//! is loaded ([`Ready`]); until then model routes answer 503.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use sanmai_engine::EngineHandle;
use sanmai_tokenizer::{ChatTemplate, Tokenizer};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::logprobs::TokenText;
use crate::media::MediaPolicy;
use crate::output::ToolFormat;

/// Default `--max-request-bytes`: long agent contexts are large.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 64 << 20;

/// How the server answers, independent of the model.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name clients send as `model` (and `/v1/models` lists).
    pub served_model_name: String,
    /// When set, `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Bodies larger than this are refused with 413.
    pub max_request_bytes: usize,
    /// Chat template variables every request starts from (its `chat_template_kwargs` override them).
    pub default_chat_template_kwargs: Map<String, Value>,
    /// Replaces the tokenizer's chat template.
    pub chat_template: Option<ChatTemplate>,
    /// Tool-call format; `None` reads it from the chat template.
    pub tool_call_parser: Option<ToolFormat>,
    /// Where image URLs may point and how they are fetched.
    pub media: MediaPolicy,
}

impl ServerConfig {
    pub fn new(served_model_name: impl Into<String>) -> ServerConfig {
        ServerConfig {
            served_model_name: served_model_name.into(),
            api_key: None,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            default_chat_template_kwargs: Map::new(),
            chat_template: None,
            tool_call_parser: None,
            media: MediaPolicy::default(),
        }
    }
}

/// The loaded model behind the API.
pub struct Ready {
    pub engine: EngineHandle,
    pub tokenizer: Option<Tokenizer>,
    /// The chat template in use (`--chat-template` or the tokenizer's).
    pub template: Option<ChatTemplate>,
    /// The tool-call format of this model's outputs.
    pub tool_format: ToolFormat,
    pub token_text: TokenText,
    /// The structured-output grammar compiler (built once, in the background).
    pub compilers: crate::structured::Compilers,
}

impl Ready {
    /// The tokenizer, or a 400 for a model served without one.
    pub fn require_tokenizer(&self) -> Result<&Tokenizer, ApiError> {
        self.tokenizer.as_ref().ok_or_else(|| {
            ApiError::bad_request(
                "this model is served without a tokenizer: only /v1/completions with token-id prompts works",
            )
        })
    }
}

/// Shared by every handler.
pub struct AppState {
    pub config: ServerConfig,
    ready: OnceLock<Ready>,
}

impl AppState {
    pub fn new(config: ServerConfig) -> AppState {
        AppState {
            config,
            ready: OnceLock::new(),
        }
    }

    /// Installs the loaded model; false if one was already installed.
    pub fn set_ready(&self, ready: Ready) -> bool {
        self.ready.set(ready).is_ok()
    }

    /// The loaded model, if loading has finished.
    pub fn try_ready(&self) -> Option<&Ready> {
        self.ready.get()
    }

    /// The loaded model, or a 503 while it is loading.
    pub fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::unavailable("the model is still loading"))
    }

    /// Checks a request's `model` against the served name (an absent `model` means the served one).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Ok(()),
            Some(m) if m == self.config.served_model_name => Ok(()),
            Some(m) => Err(ApiError::not_found(format!(
                "The model `{m}` does not exist; this server serves `{}`.",
                self.config.served_model_name
            ))
            .with_param("model")),
        }
    }
}

/// Seconds since the Unix epoch (the `created` field).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh id: `prefix-` plus 24 hex digits.
pub fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    let a = h.finish();
    h.write_u64(a);
    let b = h.finish();
    format!("{prefix}-{a:016x}{:08x}", b as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_prefixed() {
        let ids: std::collections::HashSet<String> =
            (0..1000).map(|_| new_id("chatcmpl")).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids
            .iter()
            .all(|i| i.starts_with("chatcmpl-") && i.len() == 9 + 24));
    }

    #[test]
    fn model_names_are_checked() {
        let s = AppState::new(ServerConfig::new("demo"));
        assert!(s.check_model(None).is_ok());
        assert!(s.check_model(Some("demo")).is_ok());
        let e = s.check_model(Some("gpt-4")).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::NOT_FOUND);
        assert_eq!(e.param.as_deref(), Some("model"));
        assert!(s.ready().is_err());
    }
}
