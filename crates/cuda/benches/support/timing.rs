//! Launch timing for the GEMV benches: CUDA events around back-to-back launches on the GPU's stream.

use cudarc::driver::sys::CUevent_flags;
use sanmai_cuda::Gpu;

/// Events that record time.
const TIMED: Option<CUevent_flags> = Some(CUevent_flags::CU_EVENT_DEFAULT);

/// Seconds per launch of `launch(i)` over `launches` back-to-back launches, after 8 untimed ones.
pub fn seconds_per_launch(g: &Gpu, launches: usize, mut launch: impl FnMut(usize)) -> f64 {
    for i in 0..8 {
        launch(i);
    }
    let s = g.stream().clone();
    let a = s.record_event(TIMED).expect("event");
    for i in 0..launches {
        launch(i);
    }
    let b = s.record_event(TIMED).expect("event");
    b.synchronize().expect("sync");
    a.elapsed_ms(&b).expect("elapsed") as f64 * 1e-3 / launches as f64
}
