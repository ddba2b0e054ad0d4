//! Measurements behind the roofline of `sanmai bench` (the backend's [`sanmai_model::Probe`]): the
//! device's copy bandwidth, measured in the process, and the log of distinct routed experts per MoE
//! call.

use std::sync::Mutex;

use cudarc::driver::CudaSlice;

use super::CudaBackend;
use crate::error::Result;

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
