//! [`ApiError`]: every failure the API reports, answered in OpenAI's error shape
//! `{"error":{"message","type","param","code"}}` with the matching HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use sanmai_engine::api::SubmitError;
use sanmai_engine::sampler::ParamError;
use serde_json::{json, Value};

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// A 400 naming the request field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// A 400 without a particular field.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    /// OpenAI's `error.type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::METHOD_NOT_ALLOWED => "invalid_request_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            _ => "internal_error",
        }
    }

    /// OpenAI's `error.code` for this error.
    pub fn code(&self) -> Option<&'static str> {
        match self.status {
            StatusCode::UNAUTHORIZED => Some("invalid_api_key"),
            StatusCode::NOT_FOUND if self.param.as_deref() == Some("model") => {
                Some("model_not_found")
            }
            StatusCode::PAYLOAD_TOO_LARGE => Some("request_too_large"),
            StatusCode::BAD_REQUEST if self.message.contains("context length") => {
                Some("context_length_exceeded")
            }
            _ => None,
        }
    }

    /// The `{"error": {...}}` body.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

impl From<ParamError> for ApiError {
    fn from(e: ParamError) -> ApiError {
        ApiError::invalid(e.field(), e.to_string())
    }
}

/// The request fields a refused submission names: the prompt's (`messages` or `prompt`) and the token
/// limit's (`max_tokens` or `max_completion_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubmitFields {
    pub prompt: &'static str,
    pub max_tokens: &'static str,
}

impl ApiError {
    /// The answer to a submission the engine refused: lengths against the context name the field at
    /// fault (and read as `context_length_exceeded`), an engine that cannot take more is a 503.
    pub fn submit(e: SubmitError, fields: SubmitFields) -> ApiError {
        match e {
            SubmitError::PromptTooLong { .. } | SubmitError::EmptyPrompt => {
                ApiError::invalid(fields.prompt, e.to_string())
            }
            SubmitError::TooManyTokens {
                prompt,
                max_tokens,
                max_model_len,
            } => ApiError::invalid(
                fields.max_tokens,
                format!(
                    "this model's context length is {max_model_len} tokens, but {} tokens were \
                     requested ({prompt} in the prompt, {max_tokens} in {})",
                    prompt + max_tokens,
                    fields.max_tokens
                ),
            ),
            SubmitError::MinTokens {
                min_tokens,
                max_tokens,
            } => ApiError::invalid(
                "min_tokens",
                format!(
                    "min_tokens ({min_tokens}) must not exceed {} ({max_tokens})",
                    fields.max_tokens
                ),
            ),
            SubmitError::Overloaded(_) | SubmitError::ShuttingDown => {
                ApiError::unavailable(e.to_string())
            }
            SubmitError::Invalid(m) => ApiError::bad_request(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_names_type_param_and_code() {
        let e = ApiError::invalid("temperature", "temperature must be >= 0");
        let body = e.body();
        assert_eq!(body["error"]["param"], "temperature");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["message"], "temperature must be >= 0");
        assert!(body["error"]["code"].is_null());
        let e = ApiError::not_found("no such model").with_param("model");
        assert_eq!(e.body()["error"]["code"], "model_not_found");
        let e = ApiError::submit(
            SubmitError::PromptTooLong {
                prompt: 70000,
                max_model_len: 65536,
            },
            COMPLETION,
        );
        assert!(e.message.contains("70000") && e.message.contains("65536"));
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        assert_eq!(e.body()["error"]["param"], "prompt");
    }

    #[test]
    fn param_errors_name_their_field() {
        let e: ApiError = ParamError::TopP(2.0).into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("top_p"));
    }

    const COMPLETION: SubmitFields = SubmitFields {
        prompt: "prompt",
        max_tokens: "max_tokens",
    };
    const CHAT: SubmitFields = SubmitFields {
        prompt: "messages",
        max_tokens: "max_completion_tokens",
    };

    #[test]
    fn submit_errors_map_to_statuses_and_fields() {
        let e = ApiError::submit(SubmitError::Overloaded(9), CHAT);
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        let e = ApiError::submit(
            SubmitError::PromptTooLong {
                prompt: 10,
                max_model_len: 5,
            },
            CHAT,
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("messages"));
        // prompt + max_tokens past the context names the limit's field, both lengths and their sum.
        let e = ApiError::submit(
            SubmitError::TooManyTokens {
                prompt: 10,
                max_tokens: 91,
                max_model_len: 100,
            },
            CHAT,
        );
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        assert!(
            e.message.contains("100") && e.message.contains("101"),
            "{}",
            e.message
        );
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        let e = ApiError::submit(
            SubmitError::MinTokens {
                min_tokens: 5,
                max_tokens: 4,
            },
            COMPLETION,
        );
        assert_eq!(e.param.as_deref(), Some("min_tokens"));
        assert!(e.message.contains("max_tokens (4)"), "{}", e.message);
    }
}
