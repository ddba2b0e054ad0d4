//! Kernel times inside CUDA graphs. A profiler serialises and instruments each kernel, which inflates
//! the 3–10 µs kernels of a decode step; this measures them where they run. While a [`KernelTimer`]
//! is armed (a decode step being captured with timing on), a timed event is recorded after every
//! kernel [`Gpu`](crate::Gpu) launches, as an event-record node of the graph
//! (`CU_EVENT_RECORD_EXTERNAL`), after one at the start. Each replay of the graph re-records the
//! events, so after a replay the time between consecutive events is each kernel's share of the step.
//!
//! What an interval holds: the kernel it ends with and whatever ran since the event before it that is
//! not a kernel of [`Gpu::launch`](crate::Gpu) (copies, cuBLAS calls). Between two timed kernels the
//! event node stands in the way of programmatic dependent launch, so the kernels do not overlap their
//! prologues: the sum of the intervals is the step without that overlap, plus the events' own cost.
//!
//! With timing on, the persistent layer launches of a timed capture also get a trace slot each (16
//! words of a [`TraceArena`]: block 0's phase marks, kernels/layer.cuh's `ml_mark`), which every replay
//! writes again: each phase of each layer launch as the step runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream};

use crate::error::Result;

/// One timed event: the kernel launched just before it (or `start`).
pub struct Mark {
    pub kernel: Arc<str>,
    event: CudaEvent,
}

/// Words of one layer launch's trace slot.
pub const TRACE_WORDS: usize = 16;
/// Trace slots of a [`TraceArena`]: more than the layer launches of any decode step.
pub const TRACE_SLOTS: usize = 1024;

/// The trace slots of the layer launches of timed captures: one device buffer of [`TRACE_SLOTS`] ·
/// [`TRACE_WORDS`] words, allocated while timing is on (captures hand out addresses in it: nothing is
/// allocated while capturing).
pub struct TraceArena {
    buf: CudaSlice<u64>,
    base: u64,
}

impl TraceArena {
    /// An arena in `buf` ([`TRACE_SLOTS`] · [`TRACE_WORDS`] words) at device address `base`.
    pub fn new(buf: CudaSlice<u64>, base: u64) -> Self {
        Self { buf, base }
    }
}

/// Records a [`Mark`] after each launch while armed, and hands out trace slots; does nothing (one
/// atomic load a launch) otherwise.
#[derive(Default)]
pub struct KernelTimer {
    /// Timing on: captures arm the timer.
    on: AtomicBool,
    /// The marks of the capture in progress (`None`: not armed).
    marks: Mutex<Option<Vec<Mark>>>,
    traces: Mutex<Traces>,
}

/// The trace arena (while timing is on) and the kernels given its slots by the capture in progress,
/// in slot order (`None`: not armed).
#[derive(Default)]
struct Traces {
    arena: Option<TraceArena>,
    taken: Option<Vec<Arc<str>>>,
}

/// What a timed capture recorded: its marks, and the layer kernels given trace slots 0, 1, ...
#[derive(Default)]
pub struct Armed {
    pub marks: Vec<Mark>,
    pub traces: Vec<Arc<str>>,
}

impl KernelTimer {
    /// Turns timing on or off (for the captures made from now on).
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Gives the timer its trace arena (`None`: takes it back).
    pub fn set_traces(&self, arena: Option<TraceArena>) {
        let mut t = self.lock_traces();
        t.arena = arena;
        t.taken = None;
    }

    /// With timing on, starts collecting marks on `stream` (whose capture has begun) with a `start`
    /// mark, and handing out trace slots from the first; otherwise does nothing.
    pub fn arm(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if !self.is_on() {
            return Ok(());
        }
        let start = record(stream, "start".into())?;
        *self.lock() = Some(vec![start]);
        let mut t = self.lock_traces();
        if t.arena.is_some() {
            t.taken = Some(Vec::new());
        }
        Ok(())
    }

    /// The device address of the next trace slot for a launch of `kernel` when armed (and slots
    /// are left); 0 (no trace) otherwise.
    pub fn trace(&self, kernel: &str) -> u64 {
        if !self.is_on() {
            return 0;
        }
        let mut t = self.lock_traces();
        let Traces { arena, taken } = &mut *t;
        match (arena, taken) {
            (Some(a), Some(k)) if k.len() < TRACE_SLOTS => {
                let addr = a.base + (k.len() * TRACE_WORDS * 8) as u64;
                k.push(kernel.into());
                addr
            }
            _ => 0,
        }
    }

    /// The first `n` trace slots as the last replay wrote them (waits for the stream); empty
    /// without an arena.
    pub fn read_traces(
        &self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<Vec<[u64; TRACE_WORDS]>> {
        let t = self.lock_traces();
        let Some(a) = &t.arena else {
            return Ok(Vec::new());
        };
        let words = stream.clone_dtoh(&a.buf)?;
        Ok(words
            .chunks_exact(TRACE_WORDS)
            .take(n)
            .map(|c| c.try_into().expect("a chunk of TRACE_WORDS"))
            .collect())
    }

    /// Records a mark after `kernel` when armed.
    pub fn mark(&self, stream: &Arc<CudaStream>, kernel: &Arc<str>) -> Result<()> {
        if !self.is_on() {
            return Ok(());
        }
        let mut marks = self.lock();
        if let Some(m) = marks.as_mut() {
            m.push(record(stream, kernel.clone())?);
        }
        Ok(())
    }

    /// Stops collecting and hands over the marks and trace slots given out since
    /// [`KernelTimer::arm`].
    pub fn disarm(&self) -> Armed {
        Armed {
            marks: self.lock().take().unwrap_or_default(),
            traces: self.lock_traces().taken.take().unwrap_or_default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<Mark>>> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_traces(&self) -> std::sync::MutexGuard<'_, Traces> {
        self.traces.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A timed event recorded on `stream` (a graph node when the stream is capturing).
fn record(stream: &Arc<CudaStream>, kernel: Arc<str>) -> Result<Mark> {
    let event = stream
        .context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    // SAFETY: the event and the stream belong to the same context, which is current.
    unsafe {
        sys::cuEventRecordWithFlags(
            event.cu_event(),
            stream.cu_stream(),
            sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
        )
    }
    .result()?;
    Ok(Mark { kernel, event })
}

/// Each kernel of `marks` (in launch order) with the microseconds since the mark before it, as the
/// events were last recorded (waits for them).
pub fn intervals(marks: &[Mark]) -> Result<Vec<(String, f64)>> {
    marks
        .windows(2)
        .map(|w| {
            let ms = w[0].event.elapsed_ms(&w[1].event)?;
            Ok((w[1].kernel.to_string(), f64::from(ms) * 1e3))
        })
        .collect()
}
