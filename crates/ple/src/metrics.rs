//! Counters of the PLE read path, shared by the reader and the prefetch thread.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters since the table was opened.
#[derive(Debug, Default)]
pub struct PleMetrics {
    /// Pages handed to the kernel with MADV_WILLNEED (prefetch windows and decode rows).
    pub pages_requested: AtomicU64,
    /// Prefetch windows requested.
    pub windows_done: AtomicU64,
    /// Prefetch windows dropped because their request was cancelled.
    pub windows_dropped: AtomicU64,
    /// Time spent in gathers, nanoseconds.
    pub gather_ns: AtomicU64,
    /// Tokens gathered.
    pub gathered_tokens: AtomicU64,
}

/// A plain copy of [`PleMetrics`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PleMetricsSnapshot {
    pub pages_requested: u64,
    pub windows_done: u64,
    pub windows_dropped: u64,
    pub gather_ns: u64,
    pub gathered_tokens: u64,
}

impl PleMetrics {
    pub fn snapshot(&self) -> PleMetricsSnapshot {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PleMetricsSnapshot {
            pages_requested: r(&self.pages_requested),
            windows_done: r(&self.windows_done),
            windows_dropped: r(&self.windows_dropped),
            gather_ns: r(&self.gather_ns),
            gathered_tokens: r(&self.gathered_tokens),
        }
    }

    pub(crate) fn add(a: &AtomicU64, n: u64) {
        a.fetch_add(n, Ordering::Relaxed);
    }
}
