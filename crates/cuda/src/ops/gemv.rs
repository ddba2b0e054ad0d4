//! The decode GEMV: `y[m, :] = W · x[m, :]` for up to [`GEMV_MAX_M`] rows of `x`, bf16 weights and
//! activations, f32 accumulation, bf16 or f32 output.

use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The most rows of `x` one GEMV call takes.
pub const GEMV_MAX_M: usize = 8;

/// Rows of `W` per block: 8 warps of 4 rows (`GEMV_ROWS` in gemv.cu).
const ROWS_PER_BLOCK: usize = 32;

impl Gpu {
    /// `y[m, :] = W · x[m, :]`, `W`: `[n, k]` row-major, `x`: `[m, k]`, `y`: `[m, n]` bf16.
    /// Needs `1 ≤ m ≤ 8`, `k % 8 == 0` and 16-byte aligned `W` and `x`.
    pub fn gemv_bf16(
        &self,
        w: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv("gemv_bf16", w, x, y, m, n, k)
    }

    /// As [`Gpu::gemv_bf16`] with an f32 output (logits, router scores).
    pub fn gemv_bf16_f32(
        &self,
        w: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv("gemv_bf16_f32", w, x, y, m, n, k)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv<O>(
        &self,
        base: &str,
        w: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<O>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "gemv";
        ensure((1..=GEMV_MAX_M).contains(&m), OP, || {
            format!("m = {m} rows, expected 1..={GEMV_MAX_M}")
        })?;
        ensure(k.is_multiple_of(8), OP, || {
            format!("k = {k} must be a multiple of 8")
        })?;
        check_len(OP, "W", w, n * k)?;
        check_len(OP, "x", x, m * k)?;
        check_len(OP, "y", y, m * n)?;
        if n == 0 {
            return Ok(());
        }
        let (ni, ki) = (int(OP, "n", n)?, int(OP, "k", k)?);
        let grid = grid_u32(OP, n.div_ceil(ROWS_PER_BLOCK))?;
        let s = self.stream();
        let (wp, _gw) = w.device_ptr(s);
        let (xp, _gx) = x.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        ensure(wp % 16 == 0 && xp % 16 == 0, OP, || {
            "W and x must be 16-byte aligned".into()
        })?;
        let mut b = s.launch_builder(self.kernel(&format!("{base}_m{m}"))?);
        b.arg(&wp).arg(&xp).arg(&yp).arg(&ni).arg(&ki);
        // SAFETY: argument types match the kernel; lengths, k % 8 and alignment checked above.
        unsafe { b.launch(cfg((grid, 1, 1), 256, 0)) }?;
        Ok(())
    }
}
