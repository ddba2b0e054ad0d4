//! What the persistent layer launches (`moe_layer.rs`, `gdn_layer.rs`; `kernels/layer.cuh`) share on
//! the host: where a launch writes its output row (the row itself, or its add to the residual and the
//! norm of that), and its grid (as many blocks as the multiprocessors hold at once).

use cudarc::driver::CudaSlice;
use half::bf16;

use super::moe::CombineInto;
use crate::error::{ensure, Result};
use crate::gpu::{check_len, grid_u32, Gpu};
use crate::registry::Kernel;

/// Threads per block (`ML_THREADS` in layer.cuh).
pub(super) const THREADS: u32 = 256;
/// Most blocks a multiprocessor runs (the kernels' `__launch_bounds__`).
const MAX_BLOCKS_PER_SM: u32 = 2;
/// Output rows a warp takes at most (`ML_MAXROWS`).
const MAX_ROWS_PER_WARP: usize = 4;

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

    /// The most blocks a persistent layer launch's grid takes (two a multiprocessor): what its
    /// `partials` must hold.
    pub fn moe_layer_max_blocks(&self) -> usize {
        MAX_BLOCKS_PER_SM as usize * self.info().multiprocessors as usize
    }
}
