//! The PLE hashed n-gram memory table (spec §3): the one row-index hash every path calls, the model
//! config's `ple` block, the table file with its JSON sidecar (create, check), and the mmap reader
//! that gathers 16 rows per token into a caller's buffer.

mod config;
mod error;
mod hash;

pub use config::PleConfig;
pub use error::PleError;
pub use hash::{splitmix64_outputs, PleHasher};
