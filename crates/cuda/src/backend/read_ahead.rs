//! The next launch's first weights that a persistent layer launch asks L2 for
//! ([`Backend::read_ahead`](sanmai_model::Backend::read_ahead)): the model names them before each
//! mixer and MoE call; the layer launch that runs the call takes them ([`take_next`]), the first
//! [`READ_AHEAD_BYTES`] of them, and each of its blocks asks for its share once its last rows are
//! done, so that they arrive while DRAM would idle (the launch's norm phase and the gap to the next
//! launch). The hint changes no result.

use std::sync::atomic::Ordering;

use super::tensor::CudaWeight;
use super::{CudaBackend, State};
use crate::ops::LayerNext;
use crate::Gpu;

/// The most bytes a layer launch asks L2 for: about what DRAM moves between a launch's last rows and
/// the next launch's first loads (its norm phase and the launch gap).
const READ_AHEAD_BYTES: usize = 8 << 20;

/// A weight's device bytes that a launch reads first: a packed weight's words, a bf16 weight's
/// values (FP8 weights: none, the layer launches do not follow them).
fn span(gpu: &Gpu, w: &CudaWeight) -> Option<(u64, usize)> {
    match w {
        CudaWeight::Packed(p) => Some((gpu.addr(&p.words), 4 * p.words.len())),
        CudaWeight::Bf16(d) => Some((gpu.addr(&d.data), 2 * d.data.len())),
        CudaWeight::Fp8(_) => None,
    }
}

impl CudaBackend {
    /// [`Backend::read_ahead`](sanmai_model::Backend::read_ahead): `next`'s spans for the coming
    /// layer launch (none with the switch off), replacing any earlier hint.
    pub(super) fn read_ahead_impl(&self, next: &[&CudaWeight]) {
        let hint = if self.switches.read_ahead.load(Ordering::Relaxed) {
            let mut left = READ_AHEAD_BYTES;
            LayerNext::new(
                next.iter()
                    .filter_map(|w| span(&self.gpu, w))
                    .map(|(p, b)| {
                        let b = b.min(left);
                        left -= b;
                        (p, b)
                    }),
            )
        } else {
            LayerNext::default()
        };
        self.lock().next = hint;
    }
}

/// The hint for the layer launch about to run, cleared: one launch takes it.
pub(super) fn take_next(st: &mut State) -> LayerNext {
    std::mem::take(&mut st.next)
}
