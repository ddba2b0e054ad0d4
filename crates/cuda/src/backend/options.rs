//! How a [`CudaBackend`] opens ([`CudaOptions`]) and the switches of its decode launches that A/B
//! runs turn in one build.

use std::sync::atomic::Ordering;

use super::CudaBackend;
use crate::gpu::GpuOptions;

/// How a [`CudaBackend`] opens (the `sanmai` binary fills it from its flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    pub gpu: GpuOptions,
    /// Record decode steps of batch sizes [`DEFAULT_GRAPH_BATCH_SIZES`](super::DEFAULT_GRAPH_BATCH_SIZES) as CUDA graphs; off: every
    /// step eager.
    pub cuda_graphs: bool,
    /// Fused decode launches (a MoE layer's shared expert in its routed experts' grouped GEMVs,
    /// `moe.rs`; the residual add and norm in the launch before them, `moe.rs` and `packed.rs`);
    /// off: one launch per op, for A/B runs.
    pub fused_decode: bool,
    /// A MoE layer's one-token decode step in one persistent launch (`moe_layer.rs`; with
    /// `fused_decode`); off: its six launches, for A/B runs.
    pub moe_layer: bool,
    /// A GDN mixer's one-token decode step in one persistent launch (`gdn_layer.rs`; with
    /// `fused_decode`); off: its three launches, for A/B runs.
    pub gdn_layer: bool,
}

impl Default for CudaOptions {
    /// Graphs, PDL and fused decode launches on, no kernel cache, the standard CUDA header folders.
    fn default() -> Self {
        CudaOptions {
            gpu: GpuOptions::default(),
            cuda_graphs: true,
            fused_decode: true,
            moe_layer: true,
            gdn_layer: true,
        }
    }
}

impl CudaBackend {
    /// Turns the fused decode launches on or off ([`CudaOptions::fused_decode`]); recorded steps
    /// of the other kind are dropped.
    pub fn set_fused_decode(&self, on: bool) {
        if self.fused_decode.swap(on, Ordering::Relaxed) != on {
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Turns the one-launch MoE layer on or off ([`CudaOptions::moe_layer`]); recorded steps of
    /// the other kind are dropped.
    pub fn set_moe_layer(&self, on: bool) {
        if self.moe_layer.swap(on, Ordering::Relaxed) != on {
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Turns the one-launch GDN mixer on or off ([`CudaOptions::gdn_layer`]); recorded steps of
    /// the other kind are dropped.
    pub fn set_gdn_layer(&self, on: bool) {
        if self.gdn_layer.swap(on, Ordering::Relaxed) != on {
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
    }
}
