//! The prompt prefetch thread: when a request is admitted its prompt's rows are hashed here, window
//! by window of 1024 tokens in order, and each window's pages are requested from the kernel
//! ([`PageAdvisor`]) so the reads run in parallel ahead of the prefill's gathers. The thread stays at
//! most [`PrefetchOptions::max_ahead_windows`] windows ahead of the position the prefill reports
//! ([`Prefetcher::progress`]), so a long prompt's pages do not push its own earlier pages (or the
//! K/V pool) out of memory before they are read. A cancelled (finished or preempted) request's
//! pending windows are dropped. [`PrefetchOptions::enabled`] off turns the thread off: `submit` and
//! `cancel` then do nothing.

use crate::advise::{AdviseMode, PageAdvisor};
use crate::metrics::PleMetrics;
use crate::reader::PleTable;
use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Tokens per prefetch window.
pub const WINDOW_TOKENS: usize = 1024;

/// Windows the thread runs ahead of the reported prefill position by default (16k tokens: about
/// 1 GiB of pages for the full-size table).
pub const DEFAULT_MAX_AHEAD_WINDOWS: usize = 16;

/// How the prefetch thread runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchOptions {
    /// Whether the thread runs at all.
    pub enabled: bool,
    /// Test switch: take the EPERM fallback path as if `process_madvise` were refused.
    pub force_eperm: bool,
    /// Windows requested at most beyond a request's reported prefill position; 0 = no limit.
    pub max_ahead_windows: usize,
}

impl Default for PrefetchOptions {
    fn default() -> Self {
        PrefetchOptions {
            enabled: true,
            force_eperm: false,
            max_ahead_windows: DEFAULT_MAX_AHEAD_WINDOWS,
        }
    }
}

enum Cmd {
    Submit(u64, Arc<[u32]>, usize),
    Progress(u64, usize),
    Cancel(u64),
    Pause,
    Resume,
    /// Reply once every queued window has been requested.
    Flush(Sender<AdviseMode>),
}

struct Job {
    request: u64,
    tokens: Arc<[u32]>,
    next: usize,
    /// The prefill position the engine last reported.
    done: usize,
}

impl Job {
    fn windows_left(&self) -> u64 {
        (self.tokens.len().saturating_sub(self.next)).div_ceil(WINDOW_TOKENS) as u64
    }

    /// Whether its next window is within `ahead` windows of the prefill position (0: no limit).
    fn runnable(&self, ahead: usize) -> bool {
        ahead == 0 || self.next < self.done + ahead * WINDOW_TOKENS
    }
}

/// The handle the engine holds: `submit` at admission, `cancel` when a request finishes or is
/// preempted. Dropping it stops the thread.
pub struct Prefetcher {
    tx: Option<Sender<Cmd>>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Starts the thread for `table` (none when `opts.enabled` is false).
    pub fn spawn(table: Arc<PleTable>, opts: PrefetchOptions) -> Self {
        if !opts.enabled {
            return Prefetcher {
                tx: None,
                thread: None,
            };
        }
        let (tx, rx) = channel();
        let thread = std::thread::Builder::new()
            .name("ple-prefetch".into())
            .spawn(move || {
                worker(
                    PageAdvisor::new(table, opts.force_eperm),
                    opts.max_ahead_windows,
                    rx,
                )
            })
            .ok();
        Prefetcher {
            tx: thread.as_ref().map(|_| tx),
            thread,
        }
    }

    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    fn send(&self, c: Cmd) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(c);
        }
    }

    /// Queues `tokens` (the request's whole prompt, from position 0) for prefetch.
    pub fn submit(&self, request: u64, tokens: &[u32]) {
        self.submit_from(request, tokens, 0);
    }

    /// Queues the positions from `from` on of `tokens` (the request's whole prompt, from position 0):
    /// the positions before it are already computed (a cached prefix) and will not be gathered.
    pub fn submit_from(&self, request: u64, tokens: &[u32], from: usize) {
        self.send(Cmd::Submit(request, tokens.into(), from));
    }

    /// The request's prefill has gathered its first `pos` tokens: windows up to
    /// `max_ahead_windows` beyond it may be requested.
    pub fn progress(&self, request: u64, pos: usize) {
        self.send(Cmd::Progress(request, pos));
    }

    /// Drops the request's pending windows.
    pub fn cancel(&self, request: u64) {
        self.send(Cmd::Cancel(request));
    }

    /// Holds the thread between windows until [`Self::resume`] (commands still apply).
    pub fn pause(&self) {
        self.send(Cmd::Pause);
    }

    pub fn resume(&self) {
        self.send(Cmd::Resume);
    }

    /// Waits until every queued window that the reported positions allow has been requested (after
    /// a `resume` if paused); returns the advisor's mode then (`None` when prefetch is off).
    pub fn flush(&self) -> Option<AdviseMode> {
        let (tx, rx) = channel();
        self.send(Cmd::Flush(tx));
        rx.recv().ok()
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn worker(mut advisor: PageAdvisor, ahead: usize, rx: Receiver<Cmd>) {
    let table = advisor.table().clone();
    let metrics: &PleMetrics = table.metrics();
    let nt = table.num_tables();
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut flushes: Vec<Sender<AdviseMode>> = Vec::new();
    let mut paused = false;
    let mut idx: Vec<u64> = Vec::new();
    let mut pages: Vec<u64> = Vec::new();
    let mut ranges = Vec::new();
    loop {
        // Apply every pending command; block when there is nothing to do.
        loop {
            let idle = paused || !queue.iter().any(|j| j.runnable(ahead));
            let cmd = if idle {
                if !paused {
                    for f in flushes.drain(..) {
                        let _ = f.send(advisor.mode());
                    }
                }
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                }
            };
            match cmd {
                Cmd::Submit(_, tokens, from) if from >= tokens.len() => {}
                Cmd::Submit(request, tokens, from) => queue.push_back(Job {
                    request,
                    tokens,
                    next: from,
                    done: from,
                }),
                Cmd::Progress(request, pos) => {
                    for j in queue.iter_mut().filter(|j| j.request == request) {
                        j.done = j.done.max(pos);
                    }
                }
                Cmd::Cancel(request) => queue.retain(|j| {
                    if j.request == request {
                        PleMetrics::add(&metrics.windows_dropped, j.windows_left());
                    }
                    j.request != request
                }),
                Cmd::Pause => paused = true,
                Cmd::Resume => paused = false,
                Cmd::Flush(f) => flushes.push(f),
            }
        }
        // One window of the oldest request that may run ahead.
        let Some(at) = queue.iter().position(|j| j.runnable(ahead)) else {
            continue;
        };
        let job = &mut queue[at];
        let end = (job.next + WINDOW_TOKENS).min(job.tokens.len());
        idx.resize((end - job.next) * nt, 0);
        if table
            .hasher()
            .fill_indices(&job.tokens, job.next..end, &mut idx)
            .is_ok()
        {
            let n = table.page_plan_into(&idx, &mut pages, &mut ranges);
            match advisor.advise(&ranges) {
                Ok(()) => PleMetrics::add(&metrics.pages_requested, n as u64),
                Err(e) => tracing::warn!("PLE prefetch: {e}"),
            }
        }
        PleMetrics::add(&metrics.windows_done, 1);
        job.next = end;
        if job.next >= job.tokens.len() {
            queue.remove(at);
        }
    }
}
