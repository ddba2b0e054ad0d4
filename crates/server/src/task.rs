//! Work off the async workers: CPU-heavy steps of a request (templates, tokenizing long prompts,
//! grammar compiles) run on tokio's blocking pool.

use crate::error::ApiError;

/// Runs CPU-heavy work off the async workers; a panic in it answers the request with a 500.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| ApiError::internal("internal error while preparing the request"))?
}
