//! The request bodies the API reads. A body is parsed once into JSON, then each endpoint reads the fields
//! it knows from it (unknown fields are ignored); a field of the wrong type is a 400 that names it.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// A request body that is a JSON object. Over-long bodies are a 413, malformed JSON a 400.
pub struct JsonBody(pub Value);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            let status = e.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    status,
                    "the request body is larger than the server accepts (see --max-request-bytes)",
                )
            } else {
                ApiError::new(
                    status,
                    format!("cannot read the request body: {}", e.body_text()),
                )
            }
        })?;
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::bad_request(format!("the request body is not valid JSON: {e}"))
        })?;
        if !value.is_object() {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
            ));
        }
        Ok(JsonBody(value))
    }
}

/// Reads the fields of `T` from a JSON body; a type error names the field at fault.
pub fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        // serde_json appends " at line L column C" to errors of a Value; meaningless here.
        let msg = inner.to_string();
        let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
        ApiError::invalid(path.clone(), format!("invalid `{path}`: {msg}"))
    })
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields shared by chat and text completions: sampling and stopping.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub n: Option<i64>,
    pub max_tokens: Option<i64>,
    pub min_tokens: Option<i64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<Map<String, Value>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

/// Fields of `POST /v1/chat/completions` beyond [`CommonFields`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatFields {
    pub messages: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub add_generation_prompt: Option<bool>,
}

/// Fields of `POST /v1/completions` beyond [`CommonFields`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionFields {
    pub prompt: Option<Value>,
    pub echo: Option<bool>,
    pub logprobs: Option<i64>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

/// `POST /tokenize`: a text `prompt`, or chat `messages` rendered with the chat template.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TokenizeFields {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub return_token_strs: Option<bool>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DetokenizeFields {
    pub model: Option<String>,
    pub tokens: Option<Vec<u32>>,
}

/// A completions `prompt` in one of its four forms, as a list of prompts.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// Reads `prompt`: a string, a list of strings, a list of token ids, or a list of such lists.
pub fn parse_prompt(prompt: Option<&Value>) -> Result<Vec<PromptInput>, ApiError> {
    let bad = |m: &str| ApiError::invalid("prompt", m.to_string());
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    };
    match prompt {
        None | Some(Value::Null) => Err(bad("`prompt` is required")),
        Some(Value::String(s)) => Ok(vec![PromptInput::Text(s.clone())]),
        Some(Value::Array(items)) if items.is_empty() => Err(bad("`prompt` must not be empty")),
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|v| v.as_str().map(|s| PromptInput::Text(s.to_string())))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("a list of prompts must hold only strings")),
            Value::Number(_) => ids(items)
                .map(|v| vec![PromptInput::Ids(v)])
                .ok_or_else(|| bad("token ids must be integers in 0..2^32")),
            Value::Array(_) => items
                .iter()
                .map(|v| match v {
                    Value::Array(inner) if !inner.is_empty() => ids(inner).map(PromptInput::Ids),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("a list of token-id prompts must hold non-empty lists of integers")),
            _ => Err(bad("`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids")),
        },
        Some(_) => Err(bad("`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn type_errors_name_the_field() {
        let body = json!({"temperature": "hot", "messages": []});
        let err = fields::<CommonFields>(&body).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("temperature"));
        assert!(!err.message.contains("line"), "{}", err.message);
        let body = json!({"stream_options": {"include_usage": 3}});
        let err = fields::<CommonFields>(&body).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("stream_options.include_usage"));
    }

    #[test]
    fn unknown_fields_are_ignored_and_nulls_are_absent() {
        let body = json!({"user": "x", "whatever": {"a": 1}, "temperature": null, "stop": "END"});
        let f = fields::<CommonFields>(&body).unwrap();
        assert_eq!(f.temperature, None);
        assert_eq!(f.stop.unwrap().into_vec(), vec!["END".to_string()]);
    }

    #[test]
    fn prompts_in_all_four_forms() {
        use PromptInput::*;
        assert_eq!(
            parse_prompt(Some(&json!("hi"))).unwrap(),
            vec![Text("hi".into())]
        );
        assert_eq!(
            parse_prompt(Some(&json!(["a", "b"]))).unwrap(),
            vec![Text("a".into()), Text("b".into())]
        );
        assert_eq!(
            parse_prompt(Some(&json!([1, 2, 3]))).unwrap(),
            vec![Ids(vec![1, 2, 3])]
        );
        assert_eq!(
            parse_prompt(Some(&json!([[1], [2, 3]]))).unwrap(),
            vec![Ids(vec![1]), Ids(vec![2, 3])]
        );
        for bad in [
            json!([]),
            json!(["a", 1]),
            json!([1, -2]),
            json!([[1], []]),
            json!(3),
            json!(null),
        ] {
            let e = parse_prompt(Some(&bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
        }
        assert!(parse_prompt(None).is_err());
    }
}
