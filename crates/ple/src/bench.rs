//! The cold-read benchmark behind `sanmai ple bench`: gather a prompt of unseen tokens from a table
//! evicted from the page cache (`POSIX_FADV_DONTNEED`), without and with the prefetch thread, then
//! warm; and the disk's 4 KiB random-read rate at queue depth 1 (`O_DIRECT`) for comparison.

use crate::error::PleError;
use crate::hash::splitmix64_outputs;
use crate::prefetch::{PrefetchOptions, Prefetcher, WINDOW_TOKENS};
use crate::reader::PleTable;
use half::bf16;
use serde::Serialize;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What `sanmai ple bench` prints.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub tokens: usize,
    /// Unique pages the prompt's rows live on.
    pub pages: u64,
    pub cold_no_prefetch_s: f64,
    pub cold_prefetch_s: f64,
    pub warm_s: f64,
    /// Time the prefetch thread took to request every window of the prompt (in the cold run).
    pub prefetch_issue_s: f64,
    /// 4 KiB O_DIRECT random reads per second at queue depth 1 (`None` where O_DIRECT is refused).
    pub random_read_4k_per_s: Option<f64>,
    /// The same at queue depth [`PARALLEL_DEPTH`]: the disk's ceiling for prefetched gathers.
    pub random_read_4k_qd32_per_s: Option<f64>,
    /// `pages / cold_*_s`: the effective page rate of each cold run.
    pub cold_no_prefetch_pages_per_s: f64,
    pub cold_prefetch_pages_per_s: f64,
    /// Fraction of the table's pages still resident right after eviction (0 where it worked).
    pub resident_after_evict: f64,
}

/// Drops the file's clean pages from the page cache (the file must not be mapped anywhere).
pub fn evict(path: &Path) -> Result<(), PleError> {
    let f = std::fs::File::open(path).map_err(|e| PleError::io(path, e))?;
    // SAFETY: a valid descriptor; the advice changes no data.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(PleError::io(path, std::io::Error::from_raw_os_error(r)));
    }
    Ok(())
}

/// Fraction of the mapping's pages resident in memory (`mincore`).
pub fn resident_fraction(table: &PleTable) -> f64 {
    let bytes = table.bytes();
    let ps = table.page_size() as usize;
    if bytes.is_empty() {
        return 0.0;
    }
    let n = bytes.len().div_ceil(ps);
    let mut vec = vec![0u8; n];
    // SAFETY: the range is our live mapping; vec holds one byte per page.
    let r = unsafe { libc::mincore(bytes.as_ptr() as *mut _, bytes.len(), vec.as_mut_ptr()) };
    if r != 0 {
        return f64::NAN;
    }
    vec.iter().filter(|&&b| b & 1 != 0).count() as f64 / n as f64
}

/// Queue depth of the parallel random-read measurement (threads each reading at depth 1).
pub const PARALLEL_DEPTH: usize = 32;

/// 4 KiB random reads per second with `O_DIRECT` at queue depth `depth` (that many threads, each
/// reading one block at a time), over at most `budget`.
pub fn random_read_4k_rate(path: &Path, budget: Duration, depth: usize) -> Option<f64> {
    let len = std::fs::metadata(path).ok()?.len();
    let blocks = len / 4096;
    if blocks == 0 {
        return None;
    }
    let start = Instant::now();
    let counts: Vec<Option<u64>> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..depth.max(1) as u64)
            .map(|t| s.spawn(move || reads_at_depth_1(path, blocks, len ^ t ^ 0x5EED, budget)))
            .collect();
        jobs.into_iter().map(|j| j.join().ok().flatten()).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let total: Option<u64> = counts.into_iter().sum();
    total.filter(|&n| n > 0).map(|n| n as f64 / secs)
}

/// One reader: random 4 KiB `O_DIRECT` reads of `blocks` blocks until `budget` runs out; the count.
fn reads_at_depth_1(path: &Path, blocks: u64, seed: u64, budget: Duration) -> Option<u64> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()?;
    let layout = std::alloc::Layout::from_size_align(4096, 4096).ok()?;
    // SAFETY: a non-zero-sized layout; freed below.
    let buf = unsafe { std::alloc::alloc(layout) };
    if buf.is_null() {
        return None;
    }
    let mut state = splitmix64_outputs(seed, 1)[0];
    let start = Instant::now();
    let mut reads = 0u64;
    let mut ok = true;
    while start.elapsed() < budget && reads < 200_000 {
        state = splitmix64_outputs(state, 1)[0];
        let off = (state % blocks) * 4096;
        // SAFETY: buf is 4096 bytes, aligned for O_DIRECT.
        let r = unsafe { libc::pread(f.as_raw_fd(), buf.cast(), 4096, off as libc::off_t) };
        if r != 4096 {
            ok = false;
            break;
        }
        reads += 1;
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    ok.then_some(reads)
}

/// Gathers the prompt window by window, as a chunked prefill would, reporting each position to the
/// prefetcher (when there is one) as the engine does.
fn gather_all(
    table: &PleTable,
    tokens: &[u32],
    out: &mut [bf16],
    prefetch: Option<&Prefetcher>,
) -> Result<(), PleError> {
    let dim = table.token_dim();
    let mut pos = 0;
    while pos < tokens.len() {
        let end = (pos + WINDOW_TOKENS).min(tokens.len());
        table.gather(tokens, pos..end, &mut out[..(end - pos) * dim])?;
        pos = end;
        if let Some(p) = prefetch {
            p.progress(1, pos);
        }
    }
    Ok(())
}

/// Runs the benchmark on the table in `dir` for a prompt of `n` fresh random tokens.
pub fn run_bench(dir: &Path, n: usize, eos_token_id: i64) -> Result<BenchReport, PleError> {
    let salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let tokens: Vec<u32> = splitmix64_outputs(salt, n)
        .into_iter()
        .map(|x| (x % 248_000) as u32 + 1)
        .collect();
    let probe = PleTable::open_sidecar(dir, eos_token_id)?;
    let path = probe.path().to_path_buf();
    let pages = {
        let idx = probe.hasher().indices(&tokens);
        let mut scratch = Vec::new();
        let mut ranges = Vec::new();
        probe.page_plan_into(&idx, &mut scratch, &mut ranges) as u64
    };
    let mut out = vec![bf16::ZERO; WINDOW_TOKENS.min(n.max(1)) * probe.token_dim()];
    drop(probe);

    evict(&path)?;
    let table = PleTable::open_sidecar(dir, eos_token_id)?;
    let resident_after_evict = resident_fraction(&table);
    let t0 = Instant::now();
    gather_all(&table, &tokens, &mut out, None)?;
    let cold_no_prefetch_s = t0.elapsed().as_secs_f64();
    drop(table);

    evict(&path)?;
    let table = Arc::new(PleTable::open_sidecar(dir, eos_token_id)?);
    let opts = PrefetchOptions::default();
    let prefetcher = Prefetcher::spawn(table.clone(), opts);
    let t0 = Instant::now();
    prefetcher.submit(1, &tokens);
    let (gathered, prefetch_issue_s) = std::thread::scope(|s| {
        let issue = s.spawn(|| {
            prefetcher.flush();
            t0.elapsed().as_secs_f64()
        });
        let g = gather_all(&table, &tokens, &mut out, Some(&prefetcher));
        (g, issue.join().unwrap_or(f64::NAN))
    });
    gathered?;
    let cold_prefetch_s = t0.elapsed().as_secs_f64();
    prefetcher.cancel(1);
    drop(prefetcher);

    let t0 = Instant::now();
    gather_all(&table, &tokens, &mut out, None)?;
    let warm_s = t0.elapsed().as_secs_f64();
    drop(table);

    let random_read_4k_per_s = random_read_4k_rate(&path, Duration::from_secs(2), 1);
    let random_read_4k_qd32_per_s =
        random_read_4k_rate(&path, Duration::from_secs(2), PARALLEL_DEPTH);
    Ok(BenchReport {
        tokens: n,
        pages,
        cold_no_prefetch_s,
        cold_prefetch_s,
        warm_s,
        prefetch_issue_s,
        random_read_4k_per_s,
        random_read_4k_qd32_per_s,
        cold_no_prefetch_pages_per_s: pages as f64 / cold_no_prefetch_s,
        cold_prefetch_pages_per_s: pages as f64 / cold_prefetch_s,
        resident_after_evict,
    })
}
