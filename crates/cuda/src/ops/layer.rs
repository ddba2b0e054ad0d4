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

/// A persistent launch's argument struct whose grid-wide buffers are set at launch: `partials` (one
/// f32 a block) and `sync` (two u32 counters, 0 before and after every launch).
pub(super) trait LayerArgs {
    fn set_sync(&mut self, partials: u64, sync: u64);
}

/// A persistent launch built but not queued: its kernel's name, argument struct, dynamic shared
/// memory and output rows (`h`).
pub(super) struct LayerLaunch<A> {
    pub kernel: String,
    pub args: A,
    pub smem: usize,
    pub h: usize,
}

/// The grid-wide buffers of a persistent launch: `partials` (f32, one a block of the grid:
/// [`Gpu::moe_layer_max_blocks`]) and `sync`: two `u32` that are 0 before the launch and are left 0
/// (allocate them zeroed once and pass the same buffer to every launch of the stream).
pub struct LayerSync<'a> {
    pub partials: &'a mut CudaSlice<f32>,
    pub sync: &'a mut CudaSlice<u32>,
}

/// The output fields of a launch's argument struct: `y` (the row), or `acc`, `norm_w`, `normed`, `eps`
/// and `offset` (its add to the residual and the norm); the others 0.
#[derive(Default, Clone, Copy)]
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

    /// Launches `l` cooperatively over [`Gpu::layer_grid`]'s grid (opting in to its dynamic shared
    /// memory above 48 KiB), its argument struct given the addresses of `s`'s buffers.
    ///
    /// # Safety
    /// `l` must hold the kernel's argument struct with buffers and shapes it may read and write, as
    /// the builder of `l` checked.
    pub(super) unsafe fn launch_layer<A: DeviceRepr + LayerArgs>(
        &self,
        op: &'static str,
        l: LayerLaunch<A>,
        s: LayerSync<'_>,
    ) -> Result<()> {
        let kernel = self.kernel(&l.kernel)?;
        if l.smem > 48 << 10 {
            kernel.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                l.smem as i32,
            )?;
        }
        check_len(op, "sync", &*s.sync, 2)?;
        let grid = self.layer_grid(op, kernel, l.smem, s.partials, l.h)?;
        let mut a = l.args;
        a.set_sync(self.addr_mut(s.partials), self.addr_mut(s.sync));
        let mut b = self.launch(kernel);
        b.arg(&a).cooperative();
        // SAFETY: the caller vouches for the arguments; the grid is what the multiprocessors hold
        // at once (the occupancy API for this block size and shared memory), launched
        // cooperatively, as the kernels' grid barriers need.
        unsafe { b.launch(cfg((grid, 1, 1), THREADS, l.smem as u32)) }?;
        Ok(())
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
