//! The PLE hashed n-gram memory table (spec §3): the one row-index hash every path calls, the model
//! config's `ple` block, the table file with its JSON sidecar (create, check), and the mmap reader
//! that gathers 16 rows per token into a caller's buffer.

mod config;
mod error;
mod hash;
mod reader;
mod table;

pub use config::PleConfig;
pub use error::PleError;
pub use hash::{splitmix64_outputs, PleHasher};
pub use reader::PleTable;
pub use table::{
    check_table, create_table, scaled_sizes, CreateOptions, Fill, Sidecar, SIDECAR_FILE, TABLE_FILE,
};
