//! Measurements behind the roofline of `sanmai bench` (the backend's [`sanmai_model::Probe`]): the
//! device's copy bandwidth, measured in the process, and the log of distinct routed experts per MoE
//! call.

use std::sync::Mutex;
use std::time::Instant;

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

/// Bytes of each buffer of the copy measurement.
const COPY_BYTES: usize = 1 << 30;

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

    /// The best of five device-to-device copies of 1 GiB, in bytes moved (read + written) per second.
    pub(crate) fn copy_bandwidth_impl(&self) -> Result<f64> {
        let g = &self.gpu;
        let src = g.zeros::<u8>(COPY_BYTES)?;
        let mut dst = g.zeros::<u8>(COPY_BYTES)?;
        g.stream().memcpy_dtod(&src, &mut dst)?;
        g.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t0 = Instant::now();
            g.stream().memcpy_dtod(&src, &mut dst)?;
            g.synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(2.0 * COPY_BYTES as f64 / best)
    }
}
