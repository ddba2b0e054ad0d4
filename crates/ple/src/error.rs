//! Errors of the PLE crate.

use sanmai_config::PleConfigError;
use std::path::PathBuf;

/// Everything that can go wrong reading a config, hashing, or opening, writing and reading a table.
#[derive(Debug, thiserror::Error)]
pub enum PleError {
    /// The `ple` block (or a sidecar read as one) is missing or malformed; it names the field.
    #[error(transparent)]
    Config(#[from] PleConfigError),
    /// A table on disk disagrees with the config or with its own sidecar; `what` names the mismatch.
    #[error("ple table {dir}: {what}")]
    Table { dir: PathBuf, what: String },
    /// A token id or position range that does not fit the call.
    #[error("ple: {0}")]
    Input(String),
    #[error("ple: {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl PleError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        PleError::Io {
            path: path.into(),
            source,
        }
    }
}
