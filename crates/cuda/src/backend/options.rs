//! How a [`CudaBackend`] opens ([`CudaOptions`]) and the switches of its decode launches that A/B
//! runs turn in one build.

use std::sync::atomic::{AtomicBool, Ordering};

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
    /// An attention mixer's one-token decode step in one persistent launch (`attn_layer.rs`; with
    /// `fused_decode`); off: its seven launches, for A/B runs.
    pub attn_layer: bool,
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
            attn_layer: true,
        }
    }
}

/// Which decode launches a backend's steps take ([`CudaOptions`]' switches; all on at first).
pub(super) struct Switches {
    pub fused_decode: AtomicBool,
    pub moe_layer: AtomicBool,
    pub gdn_layer: AtomicBool,
    pub attn_layer: AtomicBool,
}

impl Default for Switches {
    fn default() -> Self {
        Switches {
            fused_decode: AtomicBool::new(true),
            moe_layer: AtomicBool::new(true),
            gdn_layer: AtomicBool::new(true),
            attn_layer: AtomicBool::new(true),
        }
    }
}

impl CudaBackend {
    /// Sets every switch as `options` give them.
    pub(super) fn set_switches(&self, options: &CudaOptions) {
        self.set_fused_decode(options.fused_decode);
        self.set_moe_layer(options.moe_layer);
        self.set_gdn_layer(options.gdn_layer);
        self.set_attn_layer(options.attn_layer);
    }

    /// Turns switch `s` to `on`; recorded steps of the other kind are dropped.
    fn set(&self, s: &AtomicBool, on: bool) {
        if s.swap(on, Ordering::Relaxed) != on {
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Turns the fused decode launches on or off ([`CudaOptions::fused_decode`]); recorded steps
    /// of the other kind are dropped.
    pub fn set_fused_decode(&self, on: bool) {
        self.set(&self.switches.fused_decode, on);
    }

    /// Turns the one-launch MoE layer on or off ([`CudaOptions::moe_layer`]); recorded steps of
    /// the other kind are dropped.
    pub fn set_moe_layer(&self, on: bool) {
        self.set(&self.switches.moe_layer, on);
    }

    /// Turns the one-launch GDN mixer on or off ([`CudaOptions::gdn_layer`]); recorded steps of
    /// the other kind are dropped.
    pub fn set_gdn_layer(&self, on: bool) {
        self.set(&self.switches.gdn_layer, on);
    }

    /// Turns the one-launch attention mixer on or off ([`CudaOptions::attn_layer`]); recorded
    /// steps of the other kind are dropped.
    pub fn set_attn_layer(&self, on: bool) {
        self.set(&self.switches.attn_layer, on);
    }
}
