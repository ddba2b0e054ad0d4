//! RMSNorm (zero-centred or plain) and the gated RMSNorm of the GDN output.

use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::row_threads;
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

impl Gpu {
    /// `y = x · rsqrt(mean(x²) + eps) · (offset + w)` per row: `offset` 1.0 is the zero-centred
    /// RMSNorm, 0.0 the plain one. `x`, `y`: `[rows, d]`; `w`: `[d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        d: usize,
        eps: f32,
        offset: f32,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        ensure(d > 0, OP, || "d must be positive".into())?;
        check_len(OP, "x", x, rows * d)?;
        check_len(OP, "w", w, d)?;
        check_len(OP, "y", y, rows * d)?;
        if rows == 0 {
            return Ok(());
        }
        let (grid, d) = (grid_u32(OP, rows)?, int(OP, "d", d)?);
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (wp, _gw) = w.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let mut b = s.launch_builder(self.kernel("rms_norm_bf16")?);
        b.arg(&xp).arg(&wp).arg(&yp).arg(&d).arg(&eps).arg(&offset);
        // SAFETY: argument types match the kernel; every buffer holds rows·d (w: d) elements.
        unsafe { b.launch(cfg((grid, 1, 1), row_threads(d as usize), 0)) }?;
        Ok(())
    }

    /// The GDN output norm: `y = w · (x · rsqrt(mean(x²) + eps)) · silu(z)` per row (plain weight).
    /// `x`, `z`, `y`: `[rows, d]`; `w`: `[d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_rms_norm(
        &self,
        x: &impl DevicePtr<bf16>,
        z: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "gated_rms_norm";
        ensure(d > 0, OP, || "d must be positive".into())?;
        check_len(OP, "x", x, rows * d)?;
        check_len(OP, "z", z, rows * d)?;
        check_len(OP, "w", w, d)?;
        check_len(OP, "y", y, rows * d)?;
        if rows == 0 {
            return Ok(());
        }
        let (grid, d) = (grid_u32(OP, rows)?, int(OP, "d", d)?);
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (zp, _gz) = z.device_ptr(s);
        let (wp, _gw) = w.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let mut b = s.launch_builder(self.kernel("gated_rms_norm_bf16")?);
        b.arg(&xp).arg(&zp).arg(&wp).arg(&yp).arg(&d).arg(&eps);
        // SAFETY: argument types match the kernel; buffer lengths checked above.
        unsafe { b.launch(cfg((grid, 1, 1), row_threads(d as usize), 0)) }?;
        Ok(())
    }
}
