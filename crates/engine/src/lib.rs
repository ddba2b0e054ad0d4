//! The engine crate owns scheduling, sequences and sampling: the loop that turns model logits into tokens
//! for many concurrent requests.
//!
//! [`api`] is the contract with the HTTP layer (requests in, events out), [`EngineHandle`] the front door
//! of the engine thread, and [`sampler`] turns one row of logits per sequence into a token id plus the
//! log-probabilities an OpenAI response reports.

pub mod api;
mod handle;
pub mod sampler;

pub use handle::{EngineHandle, EngineInfo, RequestStream};
