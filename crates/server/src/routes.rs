//! The router: every route, the API-key check, the body-size limit, per-request panic isolation, and the
//! small endpoints (`/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/version`, `/metrics`).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::FutureExt;
use serde_json::{json, Value};

use crate::chat;
use crate::completions;
use crate::error::ApiError;
use crate::metrics;
use crate::render::{render_and_encode, ChatPrompt};
use crate::request::{fields, DetokenizeFields, JsonBody, TokenizeFields};
use crate::state::{unix_now, AppState};
use crate::task::blocking;

/// The API's router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.max_request_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .layer(middleware::from_fn(catch_panic))
        .with_state(state)
}

/// A panic in one handler becomes that request's 500; the server and other requests carry on.
async fn catch_panic(req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(resp) => resp,
        Err(_) => {
            tracing::error!(%path, "a request handler panicked");
            ApiError::internal("internal error while handling the request").into_response()
        }
    }
}

/// Whether `path` needs the API key.
fn protected(path: &str) -> bool {
    path.starts_with("/v1/") || path == "/tokenize" || path == "/detokenize"
}

async fn check_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        if protected(req.uri().path()) && !bearer_matches(req.headers(), key) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key: send `Authorization: Bearer KEY`",
            )
            .into_response();
        }
    }
    next.run(req).await
}

fn bearer_matches(headers: &HeaderMap, key: &str) -> bool {
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some((scheme, token)) = value.trim().split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && constant_time_eq(token.trim().as_bytes(), key.as_bytes())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route {} {}", req.method(), req.uri().path()))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// The served model's card.
fn model_card(state: &AppState) -> Result<Value, ApiError> {
    let ready = state.ready()?;
    Ok(json!({
        "id": state.config.served_model_name,
        "object": "model",
        "created": unix_now(),
        "owned_by": "sanmai",
        "root": ready.engine.info().model_name,
        "parent": null,
        "max_model_len": ready.engine.info().max_model_len,
    }))
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    Ok(Json(
        json!({"object": "list", "data": [model_card(&state)?]}),
    ))
}

async fn model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if id != state.config.served_model_name {
        return Err(
            ApiError::not_found(format!("the model `{id}` does not exist")).with_param("model"),
        );
    }
    Ok(Json(model_card(&state)?))
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ready() {
        Ok(ready) => match ready.engine.metrics().fault {
            None => StatusCode::OK.into_response(),
            Some(fault) => ApiError::unavailable(fault).into_response(),
        },
        Err(e) => e.into_response(),
    }
}

async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let text = metrics::render(&ready.engine.metrics(), &state.config.served_model_name);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f: TokenizeFields = fields(&body)?;
    state.check_model(f.model.as_deref())?;
    let tok = ready.require_tokenizer()?.clone();
    let tokens = match (&f.prompt, &f.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give either `prompt` or `messages`, not both",
            ))
        }
        (Some(text), None) => {
            let text = text.clone();
            let special = f.add_special_tokens.unwrap_or(true);
            blocking(move || {
                tok.encode(&text, special)
                    .map_err(|e| ApiError::invalid("prompt", e.to_string()))
            })
            .await?
        }
        (None, Some(messages)) => {
            let req = ChatPrompt {
                messages: messages.clone(),
                tools: f.tools.clone(),
                add_generation_prompt: f.add_generation_prompt.unwrap_or(true),
                kwargs: f.chat_template_kwargs.clone().unwrap_or_default(),
            };
            render_and_encode(&state, ready, req).await?.ids
        }
        (None, None) => return Err(ApiError::invalid("prompt", "give `prompt` or `messages`")),
    };
    let token_strs: Option<Vec<String>> = f
        .return_token_strs
        .unwrap_or(false)
        .then(|| tokens.iter().map(|&t| ready.token_text.text(t)).collect());
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": ready.engine.info().max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    })))
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f: DetokenizeFields = fields(&body)?;
    state.check_model(f.model.as_deref())?;
    let tok = ready.require_tokenizer()?.clone();
    let tokens = f
        .tokens
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` is required"))?;
    let vocab = ready.engine.info().valid_vocab;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            "tokens",
            format!("token id {bad} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    let text = blocking(move || {
        tok.decode(&tokens, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))
    })
    .await?;
    Ok(Json(json!({"prompt": text})))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::HeaderValue;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    #[tokio::test]
    async fn a_panicking_handler_answers_500_and_the_router_carries_on() {
        let app = Router::new()
            .route(
                "/boom",
                get(|| async {
                    if true {
                        panic!("handler bug");
                    }
                    "unreachable"
                }),
            )
            .route("/ok", get(|| async { "fine" }))
            .layer(middleware::from_fn(catch_panic));
        let req = |p: &str| Request::get(p).body(Body::empty()).unwrap();
        let resp = app.clone().oneshot(req("/boom")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "internal_error");
        let resp = app.oneshot(req("/ok")).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"fine");
    }

    #[test]
    fn bearer_keys() {
        let mut h = HeaderMap::new();
        assert!(!bearer_matches(&h, "k"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        assert!(bearer_matches(&h, "k"));
        assert!(!bearer_matches(&h, "kk"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  k "),
        );
        assert!(bearer_matches(&h, "k"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k"));
        assert!(!bearer_matches(&h, "k"));
        assert!(protected("/v1/models") && protected("/tokenize"));
        assert!(!protected("/health") && !protected("/metrics") && !protected("/version"));
    }
}
