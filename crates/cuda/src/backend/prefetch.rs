//! The model's prefetch hints ([`Backend::prefetch_hint`](sanmai_model::Backend::prefetch_hint)):
//! the spans of the next sublayer's first weights, kept until the next persistent layer launch takes
//! them into its arguments, which ask L2 for them once the launch's own weight loads are out.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use super::{CudaBackend, CudaWeight};
use crate::ops::L2Spans;

/// The spans of the last hint not yet taken by a layer launch.
#[derive(Default)]
pub(super) struct Hint(Mutex<L2Spans>);

impl CudaBackend {
    /// Keeps the values of `weights` (not their scales: a few KB) for the next layer launch, while
    /// the switch is on.
    pub(super) fn hint_prefetch(&self, weights: &[&CudaWeight]) {
        if !self.switches.l2_prefetch.load(Ordering::Relaxed) {
            return;
        }
        let g = &self.gpu;
        let spans = L2Spans::of(weights.iter().map(|w| match w {
            CudaWeight::Bf16(d) => (g.addr(&d.data), d.data.len() * 2),
            CudaWeight::Packed(p) => (g.addr(&p.words), p.words.len() * 4),
            CudaWeight::Fp8(f) => (g.addr(&f.bytes), f.bytes.len()),
        }));
        *self.hint.0.lock().unwrap_or_else(|e| e.into_inner()) = spans;
    }

    /// The spans of the last hint, once (none after).
    pub(super) fn take_prefetch(&self) -> L2Spans {
        std::mem::take(&mut *self.hint.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
