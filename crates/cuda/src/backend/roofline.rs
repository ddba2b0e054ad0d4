//! Measurements behind the roofline of `sanmai bench` (the backend's [`Probe`]): the device's copy
//! bandwidth, measured in the process, and the log of distinct routed experts per MoE call; and the
//! kernel times of recorded decode steps (`graph.rs`, [`crate::timer`]) and the phases of their
//! persistent layer launches.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use cudarc::driver::CudaSlice;
use sanmai_model::{OpResult, PhaseTable, Probe};

use super::CudaBackend;
use crate::error::{At, Result};
use crate::layer_phases;
use crate::timer::TRACE_WORDS;

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
    fn time_kernels(&self, on: bool) -> OpResult<bool> {
        CudaBackend::time_kernels(self, on).at("time_kernels")?;
        Ok(true)
    }

    fn kernel_times(&self) -> OpResult<Vec<(String, f64)>> {
        CudaBackend::kernel_times(self).at("kernel_times")
    }

    fn layer_phases(&self) -> OpResult<Vec<PhaseTable>> {
        let traces = CudaBackend::layer_traces(self).at("layer_phases")?;
        Ok(phase_tables(&traces))
    }
}

/// Each layer kernel's phases (`layer_phases`) over its launches in `traces` (launch order, each
/// with its trace words), medians in µs, with `from_last_exit` first: from the launch before's
/// exit (trace slot 9) to this launch's first mark (slot 0).
fn phase_tables(traces: &[(String, [u64; TRACE_WORDS])]) -> Vec<PhaseTable> {
    let mut tables: Vec<(String, Vec<Vec<f64>>)> = Vec::new();
    for (i, (kernel, t)) in traces.iter().enumerate() {
        let Some(phases) = layer_phases(kernel) else {
            continue;
        };
        let us = |a: u64, b: u64| (b as f64 - a as f64) / 1e3;
        let mut row = vec![i
            .checked_sub(1)
            .map_or(f64::NAN, |p| us(traces[p].1[9], t[0]))];
        row.extend(phases.iter().map(|&(_, a, b)| us(t[a], t[b])));
        match tables.iter_mut().find(|(k, _)| k == kernel) {
            Some((_, rows)) => rows.push(row),
            None => tables.push((kernel.clone(), vec![row])),
        }
    }
    tables
        .into_iter()
        .map(|(kernel, rows)| {
            let names = std::iter::once("from_last_exit")
                .chain(layer_phases(&kernel).unwrap_or(&[]).iter().map(|p| p.0));
            let spans = names
                .enumerate()
                .map(|(j, name)| {
                    let mut v: Vec<f64> = rows
                        .iter()
                        .map(|r| r[j])
                        .filter(|x| x.is_finite())
                        .collect();
                    v.sort_by(f64::total_cmp);
                    (
                        name.to_string(),
                        v.get(v.len() / 2).copied().unwrap_or(f64::NAN),
                    )
                })
                .collect();
            PhaseTable {
                kernel,
                launches: rows.len(),
                spans,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace whose slots hold `t0 + 1000 · slot` ns (every span of slots a..b is b - a µs).
    fn trace(t0: u64) -> [u64; TRACE_WORDS] {
        std::array::from_fn(|s| t0 + 1000 * s as u64)
    }

    #[test]
    fn phase_tables_take_medians_and_the_gap_after_the_launch_before() {
        // Two MoE launches and a GDN launch, each starting 2 µs after the one before exited
        // (slot 9 at t0 + 9 µs); an unknown kernel is left out.
        let traces = vec![
            ("moe_layer_m1_q4_s6_u2".to_string(), trace(0)),
            ("gdn_layer_m1_p8_u2_o4".to_string(), trace(11_000)),
            ("moe_layer_m1_q4_s6_u2".to_string(), trace(22_000)),
            ("rms_norm_bf16".to_string(), trace(33_000)),
        ];
        let t = phase_tables(&traces);
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t[0].kernel.as_str(), t[0].launches),
            ("moe_layer_m1_q4_s6_u2", 2)
        );
        assert_eq!(
            (t[1].kernel.as_str(), t[1].launches),
            ("gdn_layer_m1_p8_u2_o4", 1)
        );
        let moe: std::collections::HashMap<_, _> = t[0].spans.iter().cloned().collect();
        // The first launch has no launch before it: its gap is left out of the median.
        assert_eq!(moe["from_last_exit"], 2.0);
        assert_eq!(moe["router_shared_gu"], 1.0);
        assert_eq!(moe["b1_skew"], 9.0);
        // Block 0's entry (slot 14) to the latest block's (slot 15).
        assert_eq!(moe["entry_skew"], 1.0);
        assert_eq!(t[0].spans[0].0, "from_last_exit");
        assert_eq!(
            t[0].spans.len(),
            1 + layer_phases("moe_layer").unwrap().len()
        );
        let gdn: std::collections::HashMap<_, _> = t[1].spans.iter().cloned().collect();
        assert_eq!(gdn["from_last_exit"], 2.0);
        assert_eq!(gdn["exit"], 2.0);
    }
}
