//! The PLE hashed n-gram memory table (spec §3) of the shape a model config's `ple` block gives
//! (`sanmai_config::PleConfig`): the one row-index hash every path calls, the table file with its
//! JSON sidecar (create, check), the mmap reader that gathers 16 rows per token into a caller's
//! buffer, page plans, and the prefetch thread that asks the kernel (`process_madvise`, or
//! `madvise` per range) for a prompt's pages ahead of its gathers.

mod advise;
mod bench;
mod error;
mod hash;
mod metrics;
mod plan;
mod prefetch;
mod reader;
mod store;
mod table;

pub use advise::{AdviseMode, PageAdvisor, MAX_IOV};
pub use bench::{evict, random_read_4k_rate, resident_fraction, run_bench, BenchReport};
pub use error::PleError;
pub use hash::{splitmix64_outputs, PleHasher};
pub use metrics::{PleMetrics, PleMetricsSnapshot};
pub use plan::{page_ranges, system_page_size};
pub use prefetch::{PrefetchOptions, Prefetcher, WINDOW_TOKENS};
pub use reader::PleTable;
pub use store::PleStore;
pub use table::{
    check_shape, check_sidecar, check_table, create_table, scaled_sizes, CreateOptions, Fill,
    Sidecar, SIDECAR_FILE, TABLE_FILE,
};
