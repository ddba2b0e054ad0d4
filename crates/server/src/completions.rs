//! `POST /v1/completions`: the legacy text completion API. Prompts come as a string, a list of strings,
//! a list of token ids or a list of such lists; `n` choices each; `echo` repeats the prompt, and with
//! `logprobs` reports the prompt's log-probabilities too (the first token's is null).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use sanmai_engine::api::{EngineEvent, EngineRequest, FinishReason, TokenLogprob, Usage};
use sanmai_engine::RequestStream;
use serde_json::{json, Value};

use crate::error::{ApiError, SubmitFields};
use crate::logprobs::{LegacyLogprobs, TokenText};
use crate::params;
use crate::request::{fields, parse_prompt, CommonFields, CompletionFields, JsonBody, PromptInput};
use crate::response::{collect, finish_reason, stop_reason_json, usage_json};
use crate::state::{new_id, unix_now, AppState};
use crate::stream::{merge, sse_response, submit_all, SseSender};
use crate::structured::{self, StructuredFields};
use crate::task::blocking;

/// One prompt, tokenized, with the text `echo` repeats.
struct Prompt {
    ids: Vec<u32>,
    echo: String,
}

struct CompletionCtx {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Choices per prompt.
    n: usize,
    echo: bool,
    /// Alternatives per token when `logprobs` was given.
    logprobs: Option<usize>,
    token_text: TokenText,
    prompts: Vec<Prompt>,
}

impl CompletionCtx {
    fn chunk(&self, choice: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn prompt_of(&self, choice: usize) -> &Prompt {
        &self.prompts[choice / self.n]
    }

    /// Pushes the echoed prompt's tokens (log-probabilities from `lps`, null where absent).
    fn push_prompt(
        &self,
        l: &mut LegacyLogprobs,
        choice: usize,
        lps: Option<&[Option<TokenLogprob>]>,
    ) {
        let k = self.logprobs.unwrap_or(0);
        for (j, &id) in self.prompt_of(choice).ids.iter().enumerate() {
            let lp = lps.and_then(|v| v.get(j)).and_then(Option::as_ref);
            l.push(&self.token_text, id, lp, k);
        }
    }

    fn push_tokens(&self, l: &mut LegacyLogprobs, lps: &[TokenLogprob]) {
        let k = self.logprobs.unwrap_or(0);
        for lp in lps {
            l.push(&self.token_text, lp.id, Some(lp), k);
        }
    }
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let common: CommonFields = fields(&body)?;
    let f: CompletionFields = fields(&body)?;
    state.check_model(common.model.as_deref())?;
    let info = ready.engine.info().clone();
    let inputs = parse_prompt(f.prompt.as_ref())?;
    if f.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let n = params::choices(&common)?;
    if let Some(b) = f.best_of {
        if b != n as i64 {
            return Err(ApiError::invalid(
                "best_of",
                "best_of is not supported (only best_of equal to n)",
            ));
        }
    }
    let logprobs = match f.logprobs {
        None => None,
        Some(k) if k >= 0 => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be >= 0, got {k}"),
            ))
        }
    };
    let sampling = params::sampling(&common, logprobs, "logprobs", info.valid_vocab)?;
    let mut stop = params::stop(&common, info.valid_vocab)?;
    stop.max_tokens = params::positive("max_tokens", common.max_tokens)?;
    let echo = f.echo.unwrap_or(false);

    // A token-id prompt echoes without a tokenizer as its ids (`token_id:N`), like new tokens.
    let needs_tokenizer = inputs.iter().any(|p| matches!(p, PromptInput::Text(_)));
    let tok = if needs_tokenizer {
        Some(ready.require_tokenizer()?.clone())
    } else {
        ready.tokenizer.clone()
    };
    let prompts = blocking(move || {
        inputs
            .into_iter()
            .map(|p| match (p, &tok) {
                (PromptInput::Text(text), Some(tok)) => {
                    let ids = tok
                        .encode(&text, true)
                        .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
                    Ok(Prompt { ids, echo: text })
                }
                (PromptInput::Ids(ids), tok) => {
                    let echo = match (echo, tok) {
                        (true, Some(t)) => t.decode(&ids, false).unwrap_or_default(),
                        _ => String::new(),
                    };
                    Ok(Prompt { ids, echo })
                }
                (PromptInput::Text(_), None) => {
                    Err(ApiError::invalid("prompt", "text prompts need a tokenizer"))
                }
            })
            .collect::<Result<Vec<_>, ApiError>>()
    })
    .await?;

    let id = new_id("cmpl");
    let mut requests = Vec::with_capacity(prompts.len() * n);
    for (p, prompt) in prompts.iter().enumerate() {
        if prompt.ids.is_empty() {
            return Err(ApiError::invalid("prompt", "the prompt is empty"));
        }
        for i in 0..n {
            requests.push(EngineRequest {
                id: format!("{id}-{p}-{i}"),
                prompt: prompt.ids.clone(),
                sampling: params::for_choice(&sampling, i),
                stop: stop.clone(),
                prompt_logprobs: echo && logprobs.is_some(),
                cache_salt: Vec::new(),
                checkpoint_at: Vec::new(),
                images: None,
            });
        }
    }
    let ctx = CompletionCtx {
        id,
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        include_usage: common
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        n,
        echo,
        logprobs,
        token_text: ready.token_text.clone(),
        prompts,
    };
    let grammar = match structured::requested(&fields::<StructuredFields>(&body)?)? {
        Some(c) => {
            Some(structured::compile(&ready.compilers, ready.tokenizer.as_ref(), c, false).await?)
        }
        None => None,
    };
    let fields = SubmitFields {
        prompt: "prompt",
        max_tokens: "max_tokens",
    };
    let streams = submit_all(&ready.engine, requests, grammar.as_ref(), fields)?;
    if common.stream.unwrap_or(false) {
        Ok(sse_response(move |sse| {
            stream_completions(sse, ctx, streams)
        }))
    } else {
        whole_completions(ctx, streams)
            .await
            .map(IntoResponse::into_response)
    }
}

/// Adds one choice's usage to the request's: prompt counts once per prompt.
fn add_usage(total: &mut Usage, choice: usize, n: usize, u: &Usage) {
    if choice.is_multiple_of(n) {
        total.prompt_tokens += u.prompt_tokens;
        total.cached_tokens += u.cached_tokens;
    }
    total.completion_tokens += u.completion_tokens;
}

async fn whole_completions(
    ctx: CompletionCtx,
    streams: Vec<RequestStream>,
) -> Result<Json<Value>, ApiError> {
    let outcomes = collect(streams).await?;
    let mut total = Usage::default();
    let mut choices = Vec::with_capacity(outcomes.len());
    for (i, o) in outcomes.iter().enumerate() {
        let prompt = ctx.prompt_of(i);
        let text = if ctx.echo {
            format!("{}{}", prompt.echo, o.text)
        } else {
            o.text.clone()
        };
        let logprobs = match ctx.logprobs {
            None => Value::Null,
            Some(_) => {
                let mut l = LegacyLogprobs::starting_at(0);
                if ctx.echo {
                    ctx.push_prompt(&mut l, i, o.prompt_logprobs.as_deref());
                }
                ctx.push_tokens(&mut l, &o.logprobs);
                l.take_json()
            }
        };
        choices.push(json!({
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(&o.reason, false),
            "stop_reason": stop_reason_json(&o.stop_reason),
        }));
        add_usage(&mut total, i, ctx.n, &o.usage);
    }
    Ok(Json(json!({
        "id": ctx.id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage_json(&total),
    })))
}

async fn stream_completions(sse: SseSender, ctx: CompletionCtx, streams: Vec<RequestStream>) {
    let total_choices = streams.len();
    let mut offsets: Vec<LegacyLogprobs> = vec![LegacyLogprobs::default(); total_choices];
    let mut done = vec![false; total_choices];
    // The echo is sent at once, except when it waits for the prompt's log-probabilities.
    if ctx.echo && ctx.logprobs.is_none() {
        for i in 0..total_choices {
            let c = json!({"index": i, "text": ctx.prompt_of(i).echo, "logprobs": null, "finish_reason": null});
            if !sse.json(&ctx.chunk(c)).await {
                return;
            }
        }
    }
    let mut total = Usage::default();
    let mut events = merge(streams);
    loop {
        let next = tokio::select! {
            _ = sse.closed() => return,
            ev = events.next() => ev,
        };
        let Some((i, ev)) = next else { break };
        let l = &mut offsets[i];
        let chunk = match ev {
            EngineEvent::PromptLogprobs(lps) => {
                if !ctx.echo {
                    continue;
                }
                ctx.push_prompt(l, i, Some(&lps));
                json!({"index": i, "text": ctx.prompt_of(i).echo, "logprobs": l.take_json(), "finish_reason": null})
            }
            EngineEvent::Tokens { text, logprobs, .. } => {
                if text.is_empty() && logprobs.is_empty() {
                    continue;
                }
                let lp = match ctx.logprobs {
                    Some(_) => {
                        ctx.push_tokens(l, &logprobs);
                        l.take_json()
                    }
                    None => Value::Null,
                };
                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null})
            }
            EngineEvent::Finished {
                reason,
                stop_reason,
                usage,
            } => {
                done[i] = true;
                add_usage(&mut total, i, ctx.n, &usage);
                if let FinishReason::Error(message) = &reason {
                    let err = ApiError::internal(format!("generation failed: {message}"));
                    if !sse.json(&err.body()).await {
                        return;
                    }
                    continue;
                }
                json!({"index": i, "text": "", "logprobs": null,
                    "finish_reason": finish_reason(&reason, false), "stop_reason": stop_reason_json(&stop_reason)})
            }
        };
        if !sse.json(&ctx.chunk(chunk)).await {
            return;
        }
    }
    for i in (0..total_choices).filter(|&i| !done[i]) {
        let c = json!({"index": i, "text": "", "logprobs": null, "finish_reason": "abort"});
        if !sse.json(&ctx.chunk(c)).await {
            return;
        }
    }
    if ctx.include_usage {
        let usage = json!({"id": ctx.id, "object": "text_completion", "created": ctx.created,
            "model": ctx.model, "choices": [], "usage": usage_json(&total)});
        if !sse.json(&usage).await {
            return;
        }
    }
    sse.done().await;
}
