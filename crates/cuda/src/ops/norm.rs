//! RMSNorm (zero-centred or plain) and the gated RMSNorm of the GDN output.
//!
//! Rows with `d % 8 == 0` and `d ≤ NORM_MAX_D` go to the vector kernels: each row is read once into
//! registers by a slot of threads sized so each thread holds at most two 16-byte chunks (four past
//! d = 4096), several rows per block when d is small. Other widths take the `_any` kernels (one block
//! per row).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::row_threads;
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// 16-byte chunks one thread of the vector kernels holds (`NORM_CHUNKS` in norm.cu).
const NORM_CHUNKS: usize = 4;
/// Threads per block of the vector kernels, at most.
const NORM_THREADS: usize = 256;
/// Widest row of the vector kernels.
const NORM_MAX_D: usize = 8 * NORM_CHUNKS * NORM_THREADS;

/// The vector kernels' launch for `rows` rows of `d` (`d % 8 == 0`, `d ≤ NORM_MAX_D`):
/// (log2 threads per row, threads per block, blocks).
fn norm_plan(rows: usize, d: usize) -> (u32, u32, usize) {
    let chunks = d / 8;
    // Two chunks per thread where 256 threads allow, else up to four.
    let tpr = chunks
        .div_ceil(2)
        .next_power_of_two()
        .clamp(1, NORM_THREADS);
    let per_block = (NORM_THREADS / tpr).min(rows.max(1));
    let block = (tpr * per_block).next_multiple_of(32);
    let per_block = block / tpr;
    (tpr.trailing_zeros(), block as u32, rows.div_ceil(per_block))
}

/// Whether the vector kernels take rows of `d` at these addresses.
fn vector_ok(d: usize, ptrs: &[u64]) -> bool {
    d.is_multiple_of(8) && d <= NORM_MAX_D && ptrs.iter().all(|p| p % 16 == 0)
}

/// The rows a norm kernel normalises: `rows` rows of `d` values, with `eps` under the root.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormRows {
    pub rows: usize,
    pub d: usize,
    pub eps: f32,
}

impl Gpu {
    /// `y = x · rsqrt(mean(x²) + eps) · (offset + w)` per row: `offset` 1.0 is the zero-centred
    /// RMSNorm, 0.0 the plain one. `x`, `y`: `[rows, d]`; `w`: `[d]`.
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        shape: NormRows,
        offset: f32,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        let NormRows { rows, d, eps } = shape;
        ensure(d > 0, OP, || "d must be positive".into())?;
        check_len(OP, "x", x, rows * d)?;
        check_len(OP, "w", w, d)?;
        check_len(OP, "y", y, rows * d)?;
        if rows == 0 {
            return Ok(());
        }
        let (ri, di) = (int(OP, "rows", rows)?, int(OP, "d", d)?);
        if vector_ok(d, &[self.addr(x), self.addr(w), self.addr_mut(y)]) {
            let (tpr_log2, block, blocks) = norm_plan(rows, d);
            let tl = tpr_log2 as i32;
            let mut b = self.launch(self.kernel("rms_norm_bf16")?);
            b.ptr(x)
                .ptr(w)
                .ptr_mut(y)
                .arg(&ri)
                .arg(&di)
                .arg(&eps)
                .arg(&offset)
                .arg(&tl);
            // SAFETY: argument types match the kernel; every buffer holds rows·d (w: d) elements,
            // 16-byte aligned, d % 8 == 0 and d ≤ NORM_MAX_D; rows past `rows` are not touched.
            unsafe { b.launch(cfg((grid_u32(OP, blocks)?, 1, 1), block, 0)) }?;
        } else {
            let mut b = self.launch(self.kernel("rms_norm_bf16_any")?);
            b.ptr(x).ptr(w).ptr_mut(y).arg(&di).arg(&eps).arg(&offset);
            // SAFETY: argument types match the kernel; every buffer holds rows·d (w: d) elements.
            unsafe { b.launch(cfg((grid_u32(OP, rows)?, 1, 1), row_threads(d), 0)) }?;
        }
        Ok(())
    }

    /// The GDN output norm: `y = w · (x · rsqrt(mean(x²) + eps)) · silu(z)` per row (plain weight).
    /// `x`, `z`, `y`: `[rows, d]`; `w`: `[d]`.
    pub fn gated_rms_norm(
        &self,
        x: &impl DevicePtr<bf16>,
        z: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        shape: NormRows,
    ) -> Result<()> {
        const OP: &str = "gated_rms_norm";
        let NormRows { rows, d, eps } = shape;
        ensure(d > 0, OP, || "d must be positive".into())?;
        check_len(OP, "x", x, rows * d)?;
        check_len(OP, "z", z, rows * d)?;
        check_len(OP, "w", w, d)?;
        check_len(OP, "y", y, rows * d)?;
        if rows == 0 {
            return Ok(());
        }
        let (ri, di) = (int(OP, "rows", rows)?, int(OP, "d", d)?);
        let ptrs = [self.addr(x), self.addr(z), self.addr(w), self.addr_mut(y)];
        if vector_ok(d, &ptrs) {
            let (tpr_log2, block, blocks) = norm_plan(rows, d);
            let tl = tpr_log2 as i32;
            let mut b = self.launch(self.kernel("gated_rms_norm_bf16")?);
            b.ptr(x)
                .ptr(z)
                .ptr(w)
                .ptr_mut(y)
                .arg(&ri)
                .arg(&di)
                .arg(&eps)
                .arg(&tl);
            // SAFETY: argument types match the kernel; buffer lengths checked above, 16-byte aligned,
            // d % 8 == 0 and d ≤ NORM_MAX_D; rows past `rows` are not touched.
            unsafe { b.launch(cfg((grid_u32(OP, blocks)?, 1, 1), block, 0)) }?;
        } else {
            let mut b = self.launch(self.kernel("gated_rms_norm_bf16_any")?);
            b.ptr(x).ptr(z).ptr(w).ptr_mut(y).arg(&di).arg(&eps);
            // SAFETY: argument types match the kernel; buffer lengths checked above.
            unsafe { b.launch(cfg((grid_u32(OP, rows)?, 1, 1), row_threads(d), 0)) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_plan_fits_the_kernel() {
        // One decode row of 2048: a 128-thread slot, two chunks each.
        assert_eq!(norm_plan(1, 2048), (7, 128, 1));
        // Prefill rows of 2048: two rows per 256-thread block.
        assert_eq!(norm_plan(4096, 2048), (7, 256, 2048));
        // GDN heads of 128: slots of 8 threads, 32 rows a block.
        assert_eq!(norm_plan(32, 128), (3, 256, 1));
        // The widest row: 256 threads of four chunks.
        assert_eq!(norm_plan(3, NORM_MAX_D), (8, 256, 3));
        for rows in [1usize, 2, 3, 7, 33, 1000] {
            for d in (8..=NORM_MAX_D).step_by(8) {
                let (l, block, blocks) = norm_plan(rows, d);
                let tpr = 1usize << l;
                assert!(block % 32 == 0 && block as usize <= NORM_THREADS);
                assert!(tpr * NORM_CHUNKS * 8 >= d, "d {d}: tpr {tpr}");
                assert!(blocks * (block as usize / tpr) >= rows);
            }
        }
    }
}
