//! What the persistent layer launches (`moe_layer.rs`, `gdn_layer.rs`; `kernels/layer.cuh`) share on
//! the host: where a launch writes its output row (the row itself, or its add to the residual and the
//! norm of that), and its grid (as many blocks as the multiprocessors hold at once).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, DeviceRepr};
use half::bf16;

use super::moe::CombineInto;
use super::quant::{PackedMat, PackedScheme};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, Gpu};
use crate::registry::Kernel;

/// Threads per block (`ML_THREADS` in layer.cuh).
pub(super) const THREADS: u32 = 256;
/// Most blocks a multiprocessor runs (the kernels' `__launch_bounds__`).
const MAX_BLOCKS_PER_SM: u32 = 2;
/// Output rows a warp takes at most (`ML_MAXROWS`).
const MAX_ROWS_PER_WARP: usize = 4;

/// A phase of a layer launch's trace: its name, the slot it starts at and the slot it ends at.
pub type Phase = (&'static str, usize, usize);

// A kernel's phases, then the entry phases every layer kernel records.
macro_rules! phases {
    ($($p:expr),* $(,)?) => {
        &[$($p,)* ("pdl_wait", 14, 0), ("entry_skew", 14, 15)]
    };
}

/// The phases of each persistent layer kernel's trace (block 0's `ml_mark` slots, kernels/layer.cuh),
/// by the kernel name's prefix: (name, from slot, to slot). Slot 9 is the last block's exit and slot
/// 10 + p the last block's arrival at barrier p: from block 0's arrival to it is the blocks'
/// imbalance (`skew`), from it to block 0's leaving the barrier itself (`release`). Slot 14 is block
/// 0's entry before its PDL wait (`ml_entered`), slot 15 the latest block's: `pdl_wait` is from block
/// 0's entry to its first mark, `entry_skew` from it to the last block's entry.
const LAYER_PHASES: [(&str, &[Phase]); 3] = [
    (
        "moe_layer",
        phases![
            ("router_shared_gu", 0, 1),
            ("barrier1", 1, 2),
            ("topk_shared_down", 2, 3),
            ("experts_gu", 3, 4),
            ("barrier2", 4, 5),
            ("stage_swiglu", 5, 6),
            ("down_combine", 6, 7),
            ("norm", 7, 8),
            ("exit", 8, 9),
            ("b1_skew", 1, 10),
            ("b1_release", 10, 2),
            ("b2_skew", 4, 11),
            ("b2_release", 11, 5),
        ],
    ),
    (
        "gdn_layer",
        phases![
            ("projections", 0, 1),
            ("barrier1", 1, 2),
            ("gdn_step", 2, 3),
            ("barrier2", 3, 4),
            ("stage_o", 4, 5),
            ("out_proj_add", 5, 6),
            ("norm", 6, 7),
            ("exit", 7, 9),
            ("b1_skew", 1, 10),
            ("b1_release", 10, 2),
            ("b2_skew", 3, 11),
            ("b2_release", 11, 4),
        ],
    ),
    (
        "attn_layer",
        phases![
            ("projections", 0, 1),
            ("barrier1", 1, 2),
            ("attention", 2, 3),
            ("barrier2", 3, 4),
            ("merge", 4, 5),
            ("barrier3", 5, 6),
            ("stage", 6, 7),
            ("o_proj_add", 7, 8),
            ("norm_exit", 8, 9),
            ("b1_skew", 1, 10),
            ("b2_skew", 3, 11),
            ("b2_release", 11, 4),
            ("b3_skew", 5, 12),
        ],
    ),
];

/// The phases of the trace of layer kernel `kernel` (an entry point's name, e.g.
/// `moe_layer_m1_q4_s6_u2`): (name, from slot, to slot); `None` for a kernel without a trace.
pub fn layer_phases(kernel: &str) -> Option<&'static [Phase]> {
    LAYER_PHASES
        .iter()
        .find(|(prefix, _)| kernel.starts_with(prefix))
        .map(|(_, p)| *p)
}

/// Whether a packed scheme of `bits` over `k` inputs suits the layer launches' unit dots (`ml_dot`):
/// `k % 32 == 0`, per-row scales or groups of a multiple of 32.
pub(super) fn unit_scheme(s: PackedScheme, bits: u32, k: usize) -> bool {
    s.bits == bits && k > 0 && k.is_multiple_of(32) && s.group(k).is_multiple_of(32)
}

/// Checks that a packed weight's buffers hold its `[n, k]` words and scales (`what`: its name in the
/// error).
pub(super) fn check_packed(
    op: &'static str,
    what: &str,
    m: &PackedMat<'_, CudaSlice<u32>, CudaSlice<f32>>,
) -> Result<()> {
    let words = m.n * m.k / 32 * m.scheme.bits as usize;
    check_len(op, &format!("{what} words"), m.words, words)?;
    check_len(
        op,
        &format!("{what} scales"),
        m.scales,
        m.n * m.k.div_ceil(m.scheme.group(m.k)),
    )
}

/// The output fields of a launch's argument struct: `y` (the row), or `acc`, `norm_w`, `normed`, `eps`
/// and `offset` (its add to the residual and the norm); the others 0.
#[derive(Default)]
pub(super) struct RowOut {
    pub y: u64,
    pub acc: u64,
    pub norm_w: u64,
    pub normed: u64,
    pub eps: f32,
    pub offset: f32,
}

impl Gpu {
    /// [`RowOut`] of `into` for a row of `h` values, its buffers' lengths checked.
    pub(super) fn layer_row_out(
        &self,
        op: &'static str,
        into: CombineInto<'_, CudaSlice<bf16>>,
        h: usize,
    ) -> Result<RowOut> {
        let mut r = RowOut::default();
        match into {
            CombineInto::Rows(out) => {
                check_len(op, "out", &*out, h)?;
                r.y = self.addr_mut(out);
            }
            CombineInto::AddNorm {
                acc,
                w,
                normed,
                eps,
                offset,
            } => {
                check_len(op, "acc", &*acc, h)?;
                check_len(op, "normed", &*normed, h)?;
                check_len(op, "norm weight", w, h)?;
                r.acc = self.addr_mut(acc);
                r.norm_w = self.addr(w);
                r.normed = self.addr_mut(normed);
                r.eps = eps;
                r.offset = offset;
            }
        }
        Ok(r)
    }

    /// The grid of a persistent launch of `kernel` with `smem` bytes of dynamic shared memory: the
    /// blocks the multiprocessors hold at once (at most two each, from the occupancy API), checked
    /// against `partials` (one f32 a block) and an output of `h` rows (at most four a warp).
    pub(super) fn layer_grid(
        &self,
        op: &'static str,
        kernel: &Kernel,
        smem: usize,
        partials: &CudaSlice<f32>,
        h: usize,
    ) -> Result<u32> {
        let per_sm = kernel
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)?
            .min(MAX_BLOCKS_PER_SM);
        ensure(per_sm > 0, op, || {
            format!("{smem} bytes of shared memory leave no block resident")
        })?;
        let blocks = per_sm as usize * self.info().multiprocessors as usize;
        check_len(op, "partials", partials, blocks)?;
        ensure(h <= MAX_ROWS_PER_WARP * 8 * blocks, op, || {
            format!("h = {h} exceeds {MAX_ROWS_PER_WARP} rows a warp of {blocks} blocks")
        })?;
        grid_u32(op, blocks)
    }

    /// Launches the persistent layer `kernel` cooperatively over [`Gpu::layer_grid`]'s grid with
    /// `smem` bytes of dynamic shared memory (opting in above 48 KiB) and the argument struct
    /// `args(partials)` (given the address of `partials`, one f32 a block).
    ///
    /// # Safety
    /// `args` must build the kernel's argument struct with buffers and shapes it may read and write,
    /// as the caller checked.
    pub(super) unsafe fn launch_layer<A: DeviceRepr>(
        &self,
        op: &'static str,
        (kernel, smem, h): (&Kernel, usize, usize),
        partials: &mut CudaSlice<f32>,
        args: impl FnOnce(u64) -> A,
    ) -> Result<()> {
        if smem > 48 << 10 {
            kernel.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let grid = self.layer_grid(op, kernel, smem, partials, h)?;
        let a = args(self.addr_mut(partials));
        let mut b = self.launch(kernel);
        b.arg(&a).cooperative();
        // SAFETY: the caller vouches for the arguments; the grid is what the multiprocessors hold
        // at once (the occupancy API for this block size and shared memory), launched
        // cooperatively, as the kernels' grid barriers need.
        unsafe { b.launch(cfg((grid, 1, 1), THREADS, smem as u32)) }?;
        Ok(())
    }

    /// A layer launch's trace address: `given` (the caller's buffer, or 0), else under a timed capture
    /// a slot of the kernel timer's trace arena ([`crate::timer`]), else 0 (no trace).
    pub(super) fn layer_trace(&self, given: u64, kernel: &Kernel) -> u64 {
        if given != 0 {
            given
        } else {
            self.timer().trace(&kernel.name)
        }
    }

    /// The most blocks a persistent layer launch's grid takes (two a multiprocessor): what its
    /// `partials` must hold.
    pub fn moe_layer_max_blocks(&self) -> usize {
        MAX_BLOCKS_PER_SM as usize * self.info().multiprocessors as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_schemes_are_one_width_per_row_or_groups_of_32() {
        let s = |bits, group_size| PackedScheme { bits, group_size };
        assert!(unit_scheme(s(8, 0), 8, 2048));
        assert!(unit_scheme(s(4, 128), 4, 4096));
        assert!(!unit_scheme(s(4, 128), 8, 4096));
        assert!(!unit_scheme(s(8, 16), 8, 2048));
        assert!(!unit_scheme(s(8, 0), 8, 2040));
    }
}
