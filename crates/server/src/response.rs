//! Pieces shared by the chat and text completion answers: a whole request's [`Outcome`] per choice,
//! `finish_reason`, `stop_reason` and `usage` in OpenAI's (and vLLM's) spelling.

use futures_util::StreamExt;
use sanmai_engine::api::{EngineEvent, FinishReason, StopReason, TokenLogprob, Usage};
use sanmai_engine::RequestStream;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::stream::merge;

/// Everything one choice produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub text: String,
    pub ids: Vec<u32>,
    /// One per generated token when asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// One per prompt token (the first `None`) when asked for.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub reason: FinishReason,
    pub stop_reason: Option<StopReason>,
    pub usage: Usage,
}

impl Default for Outcome {
    fn default() -> Self {
        Outcome {
            text: String::new(),
            ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: None,
            // A choice whose engine went away without a `Finished` counts as aborted.
            reason: FinishReason::Abort,
            stop_reason: None,
            usage: Usage::default(),
        }
    }
}

/// Waits for every choice to finish. A failed choice fails the request (500); one aborted by a
/// shutdown gives 503.
pub async fn collect(streams: Vec<RequestStream>) -> Result<Vec<Outcome>, ApiError> {
    let mut out = vec![Outcome::default(); streams.len()];
    let mut events = merge(streams);
    while let Some((i, ev)) = events.next().await {
        let o = &mut out[i];
        match ev {
            EngineEvent::PromptLogprobs(lps) => o.prompt_logprobs = Some(lps),
            EngineEvent::Tokens {
                ids,
                text,
                logprobs,
            } => {
                o.ids.extend(ids);
                o.text.push_str(&text);
                o.logprobs.extend(logprobs);
            }
            EngineEvent::Finished {
                reason,
                stop_reason,
                usage,
            } => {
                o.reason = reason;
                o.stop_reason = stop_reason;
                o.usage = usage;
            }
        }
    }
    for o in &out {
        match &o.reason {
            FinishReason::Error(m) => {
                return Err(ApiError::internal(format!("generation failed: {m}")))
            }
            FinishReason::Abort => {
                return Err(ApiError::unavailable(
                    "the request was aborted: the server is shutting down",
                ))
            }
            _ => {}
        }
    }
    Ok(out)
}

/// `finish_reason`: `stop` (or `tool_calls` when the choice called tools), `length`, `abort`, `error`.
pub fn finish_reason(reason: &FinishReason, tool_calls: bool) -> &'static str {
    match reason {
        FinishReason::Stop if tool_calls => "tool_calls",
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Error(_) => "error",
    }
}

/// vLLM's `stop_reason`: the stop string or stop token id that ended the choice, else null.
pub fn stop_reason_json(reason: &Option<StopReason>) -> Value {
    match reason {
        Some(StopReason::Token(id)) => json!(id),
        Some(StopReason::Text(s)) => json!(s),
        None => Value::Null,
    }
}

/// The `usage` object.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_and_usage() {
        assert_eq!(finish_reason(&FinishReason::Stop, false), "stop");
        assert_eq!(finish_reason(&FinishReason::Stop, true), "tool_calls");
        assert_eq!(finish_reason(&FinishReason::Length, true), "length");
        assert_eq!(stop_reason_json(&Some(StopReason::Token(7))), json!(7));
        assert_eq!(
            stop_reason_json(&Some(StopReason::Text("x".into()))),
            json!("x")
        );
        let u = usage_json(&Usage {
            prompt_tokens: 5,
            completion_tokens: 3,
            cached_tokens: 2,
        });
        assert_eq!(u["total_tokens"], 8);
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 2);
    }
}
