//! The API the engine calls: one open table with its prefetch thread — `submit` a prompt at
//! admission, `cancel` when the request finishes or is preempted, `gather` rows for a prefill chunk,
//! and `gather_decode` for a newly sampled token (its pages requested in one call first).

use crate::advise::PageAdvisor;
use crate::error::PleError;
use crate::prefetch::{PrefetchOptions, Prefetcher};
use crate::reader::PleTable;
use half::bf16;
use sanmai_config::PleConfig;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

struct DecodeScratch {
    advisor: PageAdvisor,
    idx: Vec<u64>,
}

/// A validated table, its prefetch thread and the decode path's reusable buffers.
pub struct PleStore {
    table: Arc<PleTable>,
    prefetcher: Prefetcher,
    prefetch_on: bool,
    decode: Mutex<DecodeScratch>,
}

impl PleStore {
    /// Opens the table in `dir` for `cfg` and starts prefetch as `opts` say.
    pub fn open(dir: &Path, cfg: &PleConfig, opts: PrefetchOptions) -> Result<Self, PleError> {
        let table = Arc::new(PleTable::open(dir, cfg)?);
        let prefetcher = Prefetcher::spawn(table.clone(), opts);
        let advisor = PageAdvisor::new(table.clone(), opts.force_eperm);
        Ok(PleStore {
            prefetch_on: prefetcher.enabled(),
            prefetcher,
            decode: Mutex::new(DecodeScratch {
                advisor,
                idx: Vec::new(),
            }),
            table,
        })
    }

    pub fn table(&self) -> &Arc<PleTable> {
        &self.table
    }

    pub fn prefetcher(&self) -> &Prefetcher {
        &self.prefetcher
    }

    /// Queues a request's prompt (token ids from position 0) for page prefetch.
    pub fn submit(&self, request: u64, tokens: &[u32]) {
        if self.prefetch_on {
            self.prefetcher.submit(request, tokens);
        }
    }

    /// A request's prefill has gathered its first `pos` tokens (paces the prefetch thread).
    pub fn progress(&self, request: u64, pos: usize) {
        self.prefetcher.progress(request, pos);
    }

    /// Drops a request's pending prefetch windows.
    pub fn cancel(&self, request: u64) {
        self.prefetcher.cancel(request);
    }

    /// Gathers the rows of `positions` of `tokens` into `out` (`token_dim` bf16 per position).
    pub fn gather<T: Copy + Into<i64>>(
        &self,
        tokens: &[T],
        positions: Range<usize>,
        out: &mut [bf16],
    ) -> Result<(), PleError> {
        self.table.gather(tokens, positions, out)
    }

    /// The decode step: hashes the last position of `tokens`, requests its rows' pages in one
    /// call from a reusable iovec buffer (when prefetch is on), then gathers them into `out`.
    pub fn gather_decode<T: Copy + Into<i64>>(
        &self,
        tokens: &[T],
        out: &mut [bf16],
    ) -> Result<(), PleError> {
        let t = tokens
            .len()
            .checked_sub(1)
            .ok_or_else(|| PleError::Input("decode gather of an empty sequence".into()))?;
        let mut guard = self
            .decode
            .lock()
            .map_err(|_| PleError::Input("decode scratch poisoned".into()))?;
        let s = &mut *guard;
        s.idx.resize(self.table.num_tables(), 0);
        self.table
            .hasher()
            .fill_indices(tokens, t..t + 1, &mut s.idx)?;
        if self.prefetch_on {
            let n = s.advisor.advise_rows(&s.idx)?;
            crate::metrics::PleMetrics::add(&self.table.metrics().pages_requested, n as u64);
        }
        self.table.gather_indices(&s.idx, out)
    }
}
