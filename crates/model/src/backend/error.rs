//! The error every backend op returns.

use thiserror::Error;

/// Why a backend op failed: the device failed it (out of memory, a launch or copy error), or the call
/// broke the op's contract (shapes that do not fit, a state slot not allocated, caches not
/// initialised). `op` names the trait method.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BackendError {
    #[error("{op}: {message}")]
    Device { op: &'static str, message: String },
    #[error("{op}: {message}")]
    Invalid { op: &'static str, message: String },
}

impl BackendError {
    /// A device failure of `op`.
    pub fn device(op: &'static str, message: impl std::fmt::Display) -> Self {
        Self::Device {
            op,
            message: message.to_string(),
        }
    }

    /// A call of `op` outside its contract.
    pub fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            op,
            message: message.into(),
        }
    }

    /// The op that failed.
    pub fn op(&self) -> &'static str {
        match self {
            Self::Device { op, .. } | Self::Invalid { op, .. } => op,
        }
    }
}

/// What a backend op returns.
pub type OpResult<T> = Result<T, BackendError>;
