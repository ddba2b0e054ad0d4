//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or rendering a
/// chat template. Messages name the file and the field involved where there is one.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A field of a configuration file has a missing, malformed or inconsistent value.
    #[error("{file}: field `{field}`: {message}")]
    Field {
        file: String,
        field: String,
        message: String,
    },
    /// A line of a tiktoken rank file is malformed.
    #[error("tiktoken ranks, line {line}: {message}")]
    Ranks { line: usize, message: String },
    /// The `tokenizers` library reported an error.
    #[error("{context}: {message}")]
    Backend { context: String, message: String },
    /// A chat template does not compile.
    #[error("chat template syntax error: {0}")]
    TemplateSyntax(String),
    /// A chat template called `raise_exception(msg)`.
    #[error("chat template raised: {0}")]
    TemplateRaised(String),
    /// A chat template failed while rendering.
    #[error("chat template render error: {0}")]
    TemplateRender(String),
    /// A chat request is malformed (e.g. `messages` is not an array).
    #[error("invalid chat request: {0}")]
    InvalidRequest(String),
}

impl TokenizerError {
    pub(crate) fn backend(
        context: impl Into<String>,
        err: impl std::fmt::Display,
    ) -> TokenizerError {
        TokenizerError::Backend {
            context: context.into(),
            message: err.to_string(),
        }
    }

    pub(crate) fn field(
        file: impl Into<String>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> TokenizerError {
        TokenizerError::Field {
            file: file.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
