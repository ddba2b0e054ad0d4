//! The engine crate owns scheduling, sequences and sampling: the loop that turns model logits into tokens
//! for many concurrent requests.
//!
//! [`api`] is the contract with the HTTP layer (requests in, events out), [`EngineHandle`] the front door
//! of the engine thread started by [`start`] (where a request is admitted: its lengths checked against the
//! context), [`executor`] the seam to the model, and [`sampler`] turns one row of logits per sequence into
//! a token id plus the log-probabilities an OpenAI response reports (with the parameter type the model
//! crate defines, re-exported there). [`images`] prepares a prompt's images (the tower's tokens, their
//! MRoPE positions and prefix-cache keys) for the steps that carry them.

pub mod api;
mod block_pool;
mod engine;
pub mod executor;
pub mod forced_drafts;
mod handle;
pub mod images;
mod kv_cache;
mod masks;
mod mtp;
pub mod pipeline;
pub mod sampler;
mod sequence;
mod step;
mod stop;

pub use engine::{start, CachePlan, EngineConfig};
pub use executor::{CacheGeometry, Executor, ModelExecutor, SpecChunk};
pub use handle::{EngineHandle, EngineInfo, RequestStream};
pub use pipeline::{PipelineExecutor, PipelineOptions};
pub use stop::{StopCheck, StopStrings};
