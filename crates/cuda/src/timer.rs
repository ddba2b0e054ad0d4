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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaEvent, CudaStream};

use crate::error::Result;

/// One timed event: the kernel launched just before it (or `start`).
pub struct Mark {
    pub kernel: Arc<str>,
    event: CudaEvent,
}

/// Records a [`Mark`] after each launch while armed; does nothing (one atomic load a launch)
/// otherwise.
#[derive(Default)]
pub struct KernelTimer {
    /// Timing on: captures arm the timer.
    on: AtomicBool,
    /// The marks of the capture in progress (`None`: not armed).
    marks: Mutex<Option<Vec<Mark>>>,
}

impl KernelTimer {
    /// Turns timing on or off (for the captures made from now on).
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// With timing on, starts collecting marks on `stream` (whose capture has begun) with a `start`
    /// mark; otherwise does nothing.
    pub fn arm(&self, stream: &Arc<CudaStream>) -> Result<()> {
        if !self.is_on() {
            return Ok(());
        }
        let start = record(stream, "start".into())?;
        *self.lock() = Some(vec![start]);
        Ok(())
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

    /// Stops collecting and hands over the marks collected since [`KernelTimer::arm`].
    pub fn disarm(&self) -> Vec<Mark> {
        self.lock().take().unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<Mark>>> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
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
