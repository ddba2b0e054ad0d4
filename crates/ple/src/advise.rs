//! Asking the kernel to read table pages ahead of a gather: `process_madvise(pidfd, iovec[≤1024],
//! MADV_WILLNEED)` on our own process, so one syscall queues many reads in parallel; where that is
//! refused (`EPERM`, e.g. a container without CAP_SYS_PTRACE, or a kernel without it) it logs once
//! and falls back to one `madvise` per range.

use crate::error::PleError;
use crate::reader::PleTable;
use std::ops::Range;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Most iovecs one `process_madvise` call takes (UIO_MAXIOV).
pub const MAX_IOV: usize = 1024;

static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// How an advisor hands pages to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdviseMode {
    /// Batches of up to 1024 ranges per `process_madvise` call.
    ProcessMadvise,
    /// One `madvise(MADV_WILLNEED)` per range.
    PerRange,
}

/// Requests table pages with `MADV_WILLNEED`; owns a reusable iovec buffer.
pub struct PageAdvisor {
    table: Arc<PleTable>,
    pidfd: Option<OwnedFd>,
    mode: AdviseMode,
    /// Test switch: behave as if `process_madvise` returned EPERM.
    force_eperm: bool,
    iov: Vec<libc::iovec>,
    pages: Vec<u64>,
    ranges: Vec<Range<u64>>,
}

// SAFETY: the iovecs only hold addresses inside the table's mapping, which the Arc keeps alive;
// the advisor is used from one thread at a time.
unsafe impl Send for PageAdvisor {}

fn pidfd_self() -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just returned this descriptor; we are its only owner.
    Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn log_fallback(why: &str) {
    if !FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
        tracing::warn!("PLE page prefetch uses per-range madvise ({why})");
    }
}

impl PageAdvisor {
    /// An advisor for `table`. With `force_eperm` the first batch takes the EPERM path (for tests).
    pub fn new(table: Arc<PleTable>, force_eperm: bool) -> Self {
        let pidfd = pidfd_self();
        let mode = if pidfd.is_some() {
            AdviseMode::ProcessMadvise
        } else {
            log_fallback("pidfd_open failed");
            AdviseMode::PerRange
        };
        PageAdvisor {
            table,
            pidfd,
            mode,
            force_eperm,
            iov: Vec::with_capacity(MAX_IOV),
            pages: Vec::new(),
            ranges: Vec::new(),
        }
    }

    pub fn mode(&self) -> AdviseMode {
        self.mode
    }

    /// Whether the one-time fallback message has been logged in this process.
    pub fn fallback_logged() -> bool {
        FALLBACK_LOGGED.load(Ordering::Relaxed)
    }

    pub fn table(&self) -> &Arc<PleTable> {
        &self.table
    }

    /// Requests the pages of the rows named by `indices` (`num_tables` per token): the decode path,
    /// one call per sampled token, no allocation once the buffers have grown. Returns the pages.
    pub fn advise_rows(&mut self, indices: &[u64]) -> Result<usize, PleError> {
        let mut pages = std::mem::take(&mut self.pages);
        let mut ranges = std::mem::take(&mut self.ranges);
        let n = self.table.page_plan_into(indices, &mut pages, &mut ranges);
        let r = self.advise(&ranges);
        self.pages = pages;
        self.ranges = ranges;
        r.map(|()| n)
    }

    /// Requests `MADV_WILLNEED` for the page-aligned file byte ranges (clipped to the mapping).
    pub fn advise(&mut self, ranges: &[Range<u64>]) -> Result<(), PleError> {
        let bytes = self.table.bytes();
        let base = bytes.as_ptr() as usize;
        let ps = self.table.page_size();
        let limit = (bytes.len() as u64).div_ceil(ps) * ps;
        let addr = |r: &Range<u64>| -> Option<(usize, usize)> {
            let end = r.end.min(limit);
            (r.start < end).then(|| (base + r.start as usize, (end - r.start) as usize))
        };
        for batch in ranges.chunks(MAX_IOV) {
            if self.mode == AdviseMode::ProcessMadvise {
                self.iov.clear();
                self.iov
                    .extend(batch.iter().filter_map(addr).map(|(a, l)| libc::iovec {
                        iov_base: a as *mut c_void,
                        iov_len: l,
                    }));
                match self.process_madvise() {
                    Ok(done) => {
                        // A short count: advise what is left range by range.
                        let mut skip = done;
                        for v in &self.iov {
                            if skip >= v.iov_len {
                                skip -= v.iov_len;
                                continue;
                            }
                            madvise(v.iov_base as usize + skip, v.iov_len - skip)?;
                            skip = 0;
                        }
                        continue;
                    }
                    Err(e) if is_unsupported(&e) => {
                        log_fallback(&e.to_string());
                        self.mode = AdviseMode::PerRange;
                    }
                    Err(e) => return Err(PleError::io(self.table.path(), e)),
                }
            }
            for (a, l) in batch.iter().filter_map(addr) {
                madvise(a, l)?;
            }
        }
        Ok(())
    }

    /// One `process_madvise` over `self.iov`; the bytes advised.
    fn process_madvise(&mut self) -> std::io::Result<usize> {
        if self.force_eperm {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
        let Some(fd) = &self.pidfd else {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        };
        if self.iov.is_empty() {
            return Ok(0);
        }
        use std::os::fd::AsRawFd;
        // SAFETY: the iovecs describe ranges inside our live mapping; the call only reads them.
        let r = unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                fd.as_raw_fd(),
                self.iov.as_ptr(),
                self.iov.len(),
                libc::MADV_WILLNEED,
                0u32,
            )
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

fn is_unsupported(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPERM) | Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EACCES)
    )
}

fn madvise(addr: usize, len: usize) -> Result<(), PleError> {
    // SAFETY: the range lies inside the table's live read-only mapping; WILLNEED changes no data.
    let r = unsafe { libc::madvise(addr as *mut c_void, len, libc::MADV_WILLNEED) };
    if r != 0 {
        return Err(PleError::Input(format!(
            "madvise(WILLNEED) of {len} bytes failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}
