//! What `sanmai bench` measures through the CPU backend ([`Probe`]): the host's copy bandwidth and
//! the routed-expert record of its MoE calls.

use rayon::prelude::*;
use sanmai_model::{OpResult, Probe};

use super::CpuBackend;

impl Probe for CpuBackend {
    /// The best of five parallel copies of 256 MiB (one chunk per thread).
    fn copy_bandwidth(&self) -> OpResult<f64> {
        const BYTES: usize = 256 << 20;
        let src = vec![1u8; BYTES];
        let mut dst = vec![0u8; BYTES];
        let chunk = BYTES.div_ceil(rayon::current_num_threads().max(1));
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t0 = std::time::Instant::now();
            dst.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| d.copy_from_slice(s));
            best = best.min(t0.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        Ok(2.0 * BYTES as f64 / best)
    }

    fn record_routing(&self, on: bool) {
        *self.routing.lock().unwrap() = on.then(Vec::new);
    }

    fn take_routing(&self) -> Vec<usize> {
        self.routing
            .lock()
            .unwrap()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
}
