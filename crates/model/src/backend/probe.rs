//! Measurements `sanmai bench` takes through a backend, kept off the [`Backend`] trait the forward
//! pass uses: the device's copy bandwidth (the roofline's ceiling), the routed-expert record (the
//! roofline's expert bytes) and, where a backend launches kernels, their times in a decode step and
//! the phases of its persistent layer kernels there.

use super::{Backend, OpResult};

/// What a benchmark reads from a backend besides its ops.
pub trait Probe: Backend {
    /// The device's memory bandwidth in bytes/s (bytes read plus bytes written), measured now with a
    /// large copy: the ceiling a memory-bound decode step runs against.
    fn copy_bandwidth(&self) -> OpResult<f64>;

    /// Starts (`true`) or stops recording routed experts: while on, every
    /// [`Backend::moe_experts`] call records how many distinct experts its rows were routed to (which
    /// may cost a device synchronisation per call: for measurements, not for serving).
    fn record_routing(&self, on: bool);

    /// The distinct-expert counts recorded so far, one per `moe_experts` call in call order; clears
    /// them.
    fn take_routing(&self) -> Vec<usize>;

    /// Turns timing of each kernel of the decode steps on or off; `false` where the backend has
    /// no kernels to time (the CPU). Drops what was recorded for decode steps so far.
    fn time_kernels(&self, on: bool) -> OpResult<bool> {
        let _ = on;
        Ok(false)
    }

    /// With timing on: each kernel of the last timed decode step in launch order, with its
    /// microseconds (the time since the kernel before it ended); empty when no step was timed.
    fn kernel_times(&self) -> OpResult<Vec<(String, f64)>> {
        Ok(Vec::new())
    }

    /// With timing on: the phases of each persistent layer kernel in the last timed decode step, in
    /// the order the kernels first ran; empty when none ran.
    fn layer_phases(&self) -> OpResult<Vec<PhaseTable>> {
        Ok(Vec::new())
    }
}

/// One persistent layer kernel's phases in a timed decode step: its launches and each phase's
/// median over them (µs), beginning with `from_last_exit`, the time from the layer launch before it
/// ending (its last block's exit) to this one's first phase beginning.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseTable {
    pub kernel: String,
    pub launches: usize,
    pub spans: Vec<(String, f64)>,
}
