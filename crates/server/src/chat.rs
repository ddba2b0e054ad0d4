//! `POST /v1/chat/completions`: messages rendered with the chat template, `n` engine requests, and the
//! answer as one `chat.completion` or as `chat.completion.chunk` server-sent events.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use sanmai_engine::api::{EngineEvent, EngineRequest, FinishReason, TokenLogprob, Usage};
use sanmai_engine::RequestStream;
use sanmai_tokenizer::parsers::prompt_opens_think;
use serde_json::{json, Value};

use crate::error::{ApiError, SubmitFields};
use crate::logprobs::TokenText;
use crate::output::{tool_parser, ChatOutput, Delta, Message, ToolFormat};
use crate::params;
use crate::render::{render_and_encode, ChatPrompt, Encoded};
use crate::request::{fields, ChatFields, CommonFields, JsonBody};
use crate::response::{collect, finish_reason, stop_reason_json, usage_json};
use crate::state::{new_id, unix_now, AppState};
use crate::stream::{merge, sse_response, submit_all, SseSender};
use crate::structured::{self, StructuredFields, ToolChoice};

/// Checks `tools` (a list of `{"type": "function", "function": {"name": ...}}`).
fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let ok_type = t.get("type").and_then(Value::as_str).unwrap_or("function") == "function";
        let name = t
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str);
        if !ok_type || name.is_none_or(str::is_empty) {
            return Err(ApiError::invalid(
                at.clone(),
                format!("{at} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}"),
            ));
        }
    }
    Ok(())
}

/// The response's fixed fields and per-choice settings.
struct ChatCtx {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Alternatives per token when logprobs were asked for.
    top_logprobs: Option<usize>,
    token_text: TokenText,
    opens_think: bool,
    tools: Option<(ToolFormat, Vec<Value>)>,
}

impl ChatCtx {
    fn output(&self) -> ChatOutput {
        let parser = self.tools.as_ref().map(|(f, t)| tool_parser(*f, t));
        ChatOutput::new(self.opens_think, parser)
    }

    fn logprobs(&self, lps: &[TokenLogprob]) -> Value {
        match self.top_logprobs {
            Some(n) => self.token_text.chat_logprobs(lps, n),
            None => Value::Null,
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    let common: CommonFields = fields(&body)?;
    let chat: ChatFields = fields(&body)?;
    state.check_model(common.model.as_deref())?;
    let info = ready.engine.info().clone();

    let tools = chat.tools.clone().unwrap_or_default();
    check_tools(&tools)?;
    let choice = structured::tool_choice(chat.tool_choice.as_ref())?;
    let parse_tools = choice != ToolChoice::None && !tools.is_empty();
    // A forced tool call is the output's constraint; otherwise `response_format` and friends.
    let constraint = match structured::tool_constraint(&choice, &tools, ready.tool_format)? {
        Some(c) => Some(c),
        None => structured::requested(&fields::<StructuredFields>(&body)?)?,
    };
    let top_logprobs = match (chat.logprobs, chat.top_logprobs) {
        (Some(true), n) => Some(n.unwrap_or(0).max(0) as usize),
        (_, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs \"logprobs\": true",
            ))
        }
        _ => None,
    };
    let n = params::choices(&common)?;
    let sampling = params::sampling(&common, top_logprobs, "top_logprobs", info.valid_vocab)?;
    let mut stop = params::stop(&common, info.valid_vocab)?;
    let (field, requested) = match chat.max_completion_tokens {
        Some(_) => ("max_completion_tokens", chat.max_completion_tokens),
        None => ("max_tokens", common.max_tokens),
    };
    stop.max_tokens = params::positive(field, requested)?;
    let messages = chat
        .messages
        .clone()
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;

    let prompt = ChatPrompt {
        messages,
        tools: chat.tools.clone(),
        add_generation_prompt: chat.add_generation_prompt.unwrap_or(true),
        kwargs: chat.chat_template_kwargs.clone().unwrap_or_default(),
    };
    let Encoded {
        text: rendered,
        ids,
        history_len,
        images,
    } = render_and_encode(&state, ready, prompt).await?;

    let opens_think = prompt_opens_think(&rendered);
    let grammar = match constraint {
        Some(c) => Some(
            structured::compile(&ready.compilers, ready.tokenizer.as_ref(), c, opens_think).await?,
        ),
        None => None,
    };
    let ctx = ChatCtx {
        id: new_id("chatcmpl"),
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        include_usage: common
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        top_logprobs,
        token_text: ready.token_text.clone(),
        opens_think,
        tools: parse_tools.then_some((ready.tool_format, tools)),
    };
    let requests = (0..n)
        .map(|i| EngineRequest {
            id: format!("{}-{i}", ctx.id),
            prompt: ids.clone(),
            sampling: params::for_choice(&sampling, i),
            stop: stop.clone(),
            prompt_logprobs: false,
            cache_salt: Vec::new(),
            checkpoint_at: history_len.into_iter().collect(),
            images: images.clone(),
        })
        .collect();
    let fields = SubmitFields {
        prompt: "messages",
        max_tokens: field,
    };
    let streams = submit_all(&ready.engine, requests, grammar.as_ref(), fields)?;
    if common.stream.unwrap_or(false) {
        Ok(sse_response(move |sse| stream_chat(sse, ctx, streams)))
    } else {
        whole_chat(ctx, streams)
            .await
            .map(IntoResponse::into_response)
    }
}

/// The non-streamed answer.
async fn whole_chat(ctx: ChatCtx, streams: Vec<RequestStream>) -> Result<Json<Value>, ApiError> {
    let outcomes = collect(streams).await?;
    let mut choices = Vec::with_capacity(outcomes.len());
    let mut total = Usage::default();
    for (i, o) in outcomes.iter().enumerate() {
        let mut out = ctx.output();
        let mut msg = Message::default();
        for d in out.feed(&o.text).into_iter().chain(out.finish()) {
            msg.push(d);
        }
        let mut message = json!({
            "role": "assistant",
            "content": if msg.content.is_empty() && !msg.tool_calls.is_empty() { Value::Null } else { json!(msg.content) },
            "reasoning_content": if msg.reasoning.is_empty() { Value::Null } else { json!(msg.reasoning) },
        });
        if !msg.tool_calls.is_empty() {
            message["tool_calls"] = msg
                .tool_calls
                .iter()
                .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect();
        }
        choices.push(json!({
            "index": i,
            "message": message,
            "logprobs": ctx.logprobs(&o.logprobs),
            "finish_reason": finish_reason(&o.reason, out.has_tool_calls()),
            "stop_reason": stop_reason_json(&o.stop_reason),
        }));
        if i == 0 {
            total.prompt_tokens = o.usage.prompt_tokens;
            total.cached_tokens = o.usage.cached_tokens;
        }
        total.completion_tokens += o.usage.completion_tokens;
    }
    Ok(Json(json!({
        "id": ctx.id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage_json(&total),
    })))
}

/// One streamed choice.
struct ChoiceState {
    out: ChatOutput,
    /// Log-probabilities not yet attached to a chunk.
    pending: Vec<TokenLogprob>,
    done: bool,
}

/// The streamed answer: role chunks, deltas, final chunks, the usage chunk, `[DONE]`.
async fn stream_chat(sse: SseSender, ctx: ChatCtx, streams: Vec<RequestStream>) {
    let n = streams.len();
    let mut states: Vec<ChoiceState> = (0..n)
        .map(|_| ChoiceState {
            out: ctx.output(),
            pending: Vec::new(),
            done: false,
        })
        .collect();
    for i in 0..n {
        let first = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
        if !sse.json(&ctx.chunk(first)).await {
            return;
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
        let st = &mut states[i];
        match ev {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Tokens { text, logprobs, .. } => {
                st.pending.extend(logprobs);
                let deltas = st.out.feed(&text);
                if !send_deltas(&sse, &ctx, i, deltas, &mut st.pending).await {
                    return;
                }
            }
            EngineEvent::Finished {
                reason,
                stop_reason,
                usage,
            } => {
                st.done = true;
                let deltas = st.out.finish();
                if !send_deltas(&sse, &ctx, i, deltas, &mut st.pending).await {
                    return;
                }
                if i == 0 {
                    total.prompt_tokens = usage.prompt_tokens;
                    total.cached_tokens = usage.cached_tokens;
                }
                total.completion_tokens += usage.completion_tokens;
                if let FinishReason::Error(message) = &reason {
                    let err = ApiError::internal(format!("generation failed: {message}"));
                    if !sse.json(&err.body()).await {
                        return;
                    }
                    continue;
                }
                let last = json!({
                    "index": i,
                    "delta": {},
                    "logprobs": if st.pending.is_empty() { Value::Null } else { ctx.logprobs(&std::mem::take(&mut st.pending)) },
                    "finish_reason": finish_reason(&reason, st.out.has_tool_calls()),
                    "stop_reason": stop_reason_json(&stop_reason),
                });
                if !sse.json(&ctx.chunk(last)).await {
                    return;
                }
            }
        }
    }
    let unfinished: Vec<usize> = (0..n).filter(|&i| !states[i].done).collect();
    for i in unfinished {
        // The engine went away without finishing this choice.
        let last = json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": finish_reason(&FinishReason::Abort, false)});
        if !sse.json(&ctx.chunk(last)).await {
            return;
        }
    }
    if ctx.include_usage {
        let usage = json!({
            "id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model,
            "choices": [], "usage": usage_json(&total),
        });
        if !sse.json(&usage).await {
            return;
        }
    }
    sse.done().await;
}

/// Sends one chunk per delta; pending log-probabilities ride on the first.
async fn send_deltas(
    sse: &SseSender,
    ctx: &ChatCtx,
    index: usize,
    deltas: Vec<Delta>,
    pending: &mut Vec<TokenLogprob>,
) -> bool {
    for d in deltas {
        let delta = match d {
            Delta::Reasoning(s) => json!({"reasoning_content": s}),
            Delta::Content(s) => json!({"content": s}),
            Delta::ToolStart { index: t, id, name } => json!({"tool_calls": [{
                "index": t, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
            Delta::ToolArguments { index: t, fragment } => {
                json!({"tool_calls": [{"index": t, "function": {"arguments": fragment}}]})
            }
        };
        let logprobs = if pending.is_empty() {
            Value::Null
        } else {
            ctx.logprobs(&std::mem::take(pending))
        };
        let choice =
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null});
        if !sse.json(&ctx.chunk(choice)).await {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_are_checked() {
        assert!(check_tools(&[json!({"type": "function", "function": {"name": "f"}})]).is_ok());
        let e = check_tools(&[json!({"type": "function", "function": {}})]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0]"));
    }
}
