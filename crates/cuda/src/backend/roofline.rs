//! Measurements behind the roofline of `sanmai bench` (the backend's [`Probe`]): the device's copy
//! bandwidth, measured in the process, and the log of distinct routed experts per MoE call; and the
//! kernel times of recorded decode steps (`graph.rs`, [`crate::timer`]).

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use cudarc::driver::CudaSlice;
use sanmai_model::{OpResult, Probe};

use super::CudaBackend;
use crate::error::{At, Result};

/// Distinct experts per MoE call while recording is on.
#[derive(Default)]
pub(crate) struct RoutingLog(Mutex<Option<Vec<usize>>>);

impl RoutingLog {
    pub fn set(&self, on: bool) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = on.then(Vec::new);
    }

    pub fn take(&self) -> Vec<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
}

impl CudaBackend {
    /// Records how many distinct experts the `n` routed ids in `ids` name, when recording is on
    /// (waits for the device to download them).
    pub(crate) fn log_routing(&self, ids: &CudaSlice<u32>, n: usize, experts: usize) -> Result<()> {
        let mut log = self.routing.0.lock().unwrap_or_else(|p| p.into_inner());
        let Some(log) = log.as_mut() else {
            return Ok(());
        };
        let host = self.gpu.download(ids)?;
        let mut seen = vec![false; experts];
        for &i in &host[..n] {
            if let Some(s) = seen.get_mut(i as usize) {
                *s = true;
            }
        }
        log.push(seen.iter().filter(|&&s| s).count());
        Ok(())
    }

    /// Device-to-device copy bandwidth ([`crate::Gpu::copy_bandwidth`]).
    pub(crate) fn copy_bandwidth_impl(&self) -> Result<f64> {
        self.gpu.copy_bandwidth()
    }
}

impl Probe for CudaBackend {
    fn copy_bandwidth(&self) -> OpResult<f64> {
        self.copy_bandwidth_impl().at("copy_bandwidth")
    }

    fn record_routing(&self, on: bool) {
        self.routing.set(on);
        self.routing_on.store(on, Ordering::Relaxed);
    }

    fn take_routing(&self) -> Vec<usize> {
        self.routing.take()
    }

    /// Times the kernels of decode steps recorded as CUDA graphs (steps run eagerly are not timed).
    fn time_kernels(&self, on: bool) -> bool {
        CudaBackend::time_kernels(self, on);
        true
    }

    fn kernel_times(&self) -> OpResult<Vec<(String, f64)>> {
        CudaBackend::kernel_times(self).at("kernel_times")
    }
}
