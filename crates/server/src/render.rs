//! A conversation into prompt tokens: `messages` checked, rendered with the chat template (the
//! server's default template kwargs under the request's) and encoded, off the async workers. A
//! model with a vision tower takes `image_url` parts: each image is fetched ([`crate::media`]),
//! prepared and run through the tower, and its placeholder token expanded to its tokens.

use std::sync::Arc;

use sanmai_engine::images::{ImageEncoder, PreparedImage, PromptImages};
use sanmai_tokenizer::TokenizerError;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::state::{AppState, Ready};
use crate::task::blocking;

/// What the chat template renders.
pub struct ChatPrompt {
    pub messages: Value,
    pub tools: Option<Vec<Value>>,
    pub add_generation_prompt: bool,
    /// The request's `chat_template_kwargs` (the server's defaults are merged under them).
    pub kwargs: Map<String, Value>,
}

/// A rendered and encoded conversation.
pub struct Encoded {
    pub text: String,
    pub ids: Vec<u32>,
    /// Tokens of the conversation history alone (without the generation prompt), when they are a proper
    /// prefix of `ids`: the point the next turn shares.
    pub history_len: Option<usize>,
    /// The conversation's images (`None` without any).
    pub images: Option<Arc<PromptImages>>,
}

/// An image content part: where it is in `messages` and its URL.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePart {
    /// `messages[i].content[j]`.
    pub at: String,
    pub url: String,
}

/// Renders a conversation and encodes it (without adding special tokens: the template writes them).
pub async fn render_and_encode(
    state: &AppState,
    ready: &Ready,
    prompt: ChatPrompt,
) -> Result<Encoded, ApiError> {
    let tok = ready.require_tokenizer()?.clone();
    let template = ready.template.clone().ok_or_else(|| {
        ApiError::bad_request(
            "this model's tokenizer has no chat template: start the server with --chat-template FILE",
        )
    })?;
    let (messages, parts) = check_messages(&prompt.messages)?;
    let encoder = match (parts.first(), ready.engine.images()) {
        (None, _) => None,
        (Some(p), None) => {
            return Err(ApiError::invalid(
                p.at.clone(),
                format!("{} is an image, but this model takes no images (it has no vision tower, or --limit-mm-per-prompt turns images off)", p.at),
            ))
        }
        (Some(_), Some(e)) => Some(e.clone()),
    };
    let images = match &encoder {
        Some(e) => prepare_images(state, e, &parts).await?,
        None => Vec::new(),
    };
    let mut kwargs = state.config.default_chat_template_kwargs.clone();
    kwargs.extend(prompt.kwargs);
    let mut req = tok.chat_request(messages);
    req.tools = prompt.tools.filter(|t| !t.is_empty()).map(Value::Array);
    req.add_generation_prompt = prompt.add_generation_prompt;
    req.kwargs = kwargs;
    blocking(move || {
        let mut req = req;
        let text = template.render(&req).map_err(|e| match e {
            TokenizerError::TemplateRaised(m) => ApiError::invalid(
                "messages",
                format!("the chat template refused the conversation: {m}"),
            ),
            other => ApiError::invalid("messages", other.to_string()),
        })?;
        let mut ids = tok
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let history_len = if req.add_generation_prompt {
            req.add_generation_prompt = false;
            template
                .render(&req)
                .ok()
                .and_then(|h| tok.encode(&h, false).ok())
                .filter(|h| !h.is_empty() && h.len() < ids.len() && ids.starts_with(h))
                .map(|h| h.len())
        } else {
            None
        };
        let (mut history_len, mut images_out) = (history_len, None);
        if let Some(e) = &encoder {
            let (expanded, prompt_images, moved) = e
                .encode(&ids, &images)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            history_len = history_len.map(|h| moved[h]);
            ids = expanded;
            images_out = Some(Arc::new(prompt_images));
        }
        Ok(Encoded {
            text,
            ids,
            history_len,
            images: images_out,
        })
    })
    .await
}

/// Fetches the images of `parts` (at most the encoder's limit) and prepares them off the async
/// workers; a part that cannot be had is a 400 naming it.
async fn prepare_images(
    state: &AppState,
    encoder: &Arc<ImageEncoder>,
    parts: &[ImagePart],
) -> Result<Vec<PreparedImage>, ApiError> {
    if parts.len() > encoder.max_images {
        return Err(ApiError::invalid(
            parts[encoder.max_images].at.clone(),
            format!(
                "the conversation has {} images, above the limit of {} per prompt (--limit-mm-per-prompt)",
                parts.len(),
                encoder.max_images
            ),
        ));
    }
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let bytes = crate::media::fetch(&p.url, &state.config.media)
            .await
            .map_err(|e| ApiError::invalid(p.at.clone(), format!("{}: {e}", p.at)))?;
        let (encoder, at) = (encoder.clone(), p.at.clone());
        out.push(
            blocking(move || {
                encoder
                    .prepare(&bytes)
                    .map_err(|e| ApiError::invalid(at.clone(), format!("{at}: {e}")))
            })
            .await?,
        );
    }
    Ok(out)
}

/// Checks `messages` and returns them ready for the template (`reasoning` is accepted as an alias of
/// `reasoning_content`), with their image parts in order. Audio and video parts are refused.
pub fn check_messages(messages: &Value) -> Result<(Value, Vec<ImagePart>), ApiError> {
    let Value::Array(list) = messages else {
        return Err(ApiError::invalid("messages", "`messages` must be an array"));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    let mut images = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let at = |s: &str| format!("messages[{i}]{s}");
        let Value::Object(map) = m else {
            return Err(ApiError::invalid(
                at(""),
                format!("{} must be an object", at("")),
            ));
        };
        match map.get("role").and_then(Value::as_str) {
            Some("system" | "developer" | "user" | "assistant" | "tool" | "function") => {}
            Some(r) => {
                return Err(ApiError::invalid(
                    at(".role"),
                    format!("unknown role {r:?} in {}", at("")),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    at(".role"),
                    format!("{} has no role", at("")),
                ))
            }
        }
        match map.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let at = at(&format!(".content[{j}]"));
                    if let Some(url) = check_part(part, &at)? {
                        images.push(ImagePart { at, url });
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    at(".content"),
                    format!(
                        "{} must be a string or a list of content parts",
                        at(".content")
                    ),
                ))
            }
        }
        let mut map = map.clone();
        if !map.contains_key("reasoning_content") {
            if let Some(r) = map.get("reasoning").cloned() {
                map.insert("reasoning_content".into(), r);
            }
        }
        out.push(Value::Object(map));
    }
    Ok((Value::Array(out), images))
}

/// Checks one content part; an image part's URL.
fn check_part(part: &Value, at: &str) -> Result<Option<String>, ApiError> {
    let kind = match part {
        Value::String(_) => return Ok(None),
        Value::Object(p) => p.get("type").and_then(Value::as_str).unwrap_or("text"),
        _ => return Err(ApiError::invalid(at, format!("{at} must be an object"))),
    };
    match kind {
        "text" | "input_text" | "output_text" => match part.get("text") {
            Some(Value::String(_)) => Ok(None),
            _ => Err(ApiError::invalid(at, format!("{at} has no string `text`"))),
        },
        // OpenAI's `{"image_url": {"url": ...}}`, or the URL as a string (the Responses API's
        // `input_image`).
        "image_url" | "input_image" => {
            let url = match part.get("image_url") {
                Some(Value::String(u)) => Some(u.as_str()),
                Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
                _ => None,
            };
            match url {
                Some(u) if !u.is_empty() => Ok(Some(u.to_string())),
                _ => Err(ApiError::invalid(at, format!("{at} has no `image_url.url` string"))),
            }
        }
        "image" | "image_pil" | "image_embeds" => Err(ApiError::invalid(
            at,
            format!("{at} is a {kind} part: send images as {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}"),
        )),
        "input_audio" | "audio_url" | "video_url" | "video" | "file" | "input_file" => Err(ApiError::invalid(
            at,
            format!("{at} is a {kind} part; only text and image content is supported"),
        )),
        other => Err(ApiError::invalid(at, format!("{at} has an unknown content type {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_are_checked() {
        let ok = json!([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null, "reasoning": "r", "tool_calls": []}, {"role": "tool", "content": "x", "tool_call_id": "1"}]);
        let (out, _) = check_messages(&ok).unwrap();
        assert_eq!(out[2]["reasoning_content"], "r");
        for (bad, param) in [
            (json!("hi"), "messages"),
            (json!([]), "messages"),
            (json!([{"content": "x"}]), "messages[0].role"),
            (
                json!([{"role": "wizard", "content": "x"}]),
                "messages[0].role",
            ),
            (
                json!([{"role": "user", "content": 5}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": [{"type": "text"}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]),
                "messages[0].content[1]",
            ),
            (
                json!([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]),
                "messages[0].content[0]",
            ),
        ] {
            let e = check_messages(&bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}");
        }
        let (_, images) = check_messages(&json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, "t"]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "y"}]}])).unwrap();
        assert_eq!(
            images,
            vec![
                ImagePart {
                    at: "messages[0].content[0]".into(),
                    url: "x".into()
                },
                ImagePart {
                    at: "messages[1].content[0]".into(),
                    url: "y".into()
                },
            ]
        );
    }
}
