//! Depthwise causal conv1d + SiLU with its rolling state: prefill of one sequence and the batched
//! one-token update.

use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The largest conv kernel the update kernel takes.
const MAX_KERNEL: usize = 8;

impl Gpu {
    /// Prefill: `out[s, ch] = silu(Σ_j w[ch, j] · xx[s + j, ch])` with `xx = state ++ x`, then
    /// `state ← last kernel−1 rows of xx`. `x`, `out`: `[t, c]`; `w`: `[c, kernel]`; `state`:
    /// `[kernel−1, c]`. Matches `sanmai_cpu::ops::causal_conv1d_silu`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_prefill(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        state: &mut impl DevicePtrMut<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        t: usize,
        c: usize,
        kernel: usize,
    ) -> Result<()> {
        const OP: &str = "conv1d_prefill";
        ensure(kernel >= 1, OP, || "kernel size must be at least 1".into())?;
        check_len(OP, "x", x, t * c)?;
        check_len(OP, "w", w, c * kernel)?;
        check_len(OP, "state", state, (kernel - 1) * c)?;
        check_len(OP, "out", out, t * c)?;
        if t == 0 || c == 0 {
            return Ok(());
        }
        let (ti, ci, ki) = (
            int(OP, "t", t)?,
            int(OP, "c", c)?,
            int(OP, "kernel", kernel)?,
        );
        let blocks = grid_u32(OP, (t * c).div_ceil(256).min(1 << 20))?;
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (wp, _gw) = w.device_ptr(s);
        let (sp, _gs) = state.device_ptr_mut(s);
        let (op, _go) = out.device_ptr_mut(s);
        let mut b = s.launch_builder(self.kernel("conv1d_prefill_bf16")?);
        b.arg(&xp)
            .arg(&wp)
            .arg(&sp)
            .arg(&op)
            .arg(&ti)
            .arg(&ci)
            .arg(&ki);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { b.launch(cfg((blocks, 1, 1), 256, 0)) }?;
        if kernel > 1 {
            let mut b = s.launch_builder(self.kernel("conv1d_state_bf16")?);
            b.arg(&xp).arg(&sp).arg(&ti).arg(&ci).arg(&ki);
            // SAFETY: as above; queued after the convolution on the same stream.
            unsafe { b.launch(cfg((grid_u32(OP, c.div_ceil(256))?, 1, 1), 256, 0)) }?;
        }
        Ok(())
    }

    /// One-token update of `batch` sequences: token `b` (row `b` of `x` `[batch, c]`) convolves with
    /// and rolls slot `slots[b]` of `state_pool` `[num_slots, kernel−1, c]`; `out`: `[batch, c]`.
    /// A slot id out of range gives a zero output row and touches no state. `kernel ≤ 8`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_update(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        state_pool: &mut impl DevicePtrMut<bf16>,
        slots: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<bf16>,
        batch: usize,
        c: usize,
        kernel: usize,
    ) -> Result<()> {
        const OP: &str = "conv1d_update";
        ensure((2..=MAX_KERNEL).contains(&kernel), OP, || {
            format!("kernel size {kernel} must be in 2..={MAX_KERNEL}")
        })?;
        check_len(OP, "x", x, batch * c)?;
        check_len(OP, "w", w, c * kernel)?;
        check_len(OP, "slots", slots, batch)?;
        check_len(OP, "out", out, batch * c)?;
        if batch == 0 || c == 0 {
            return Ok(());
        }
        let num_slots = u32::try_from(state_pool.len() / ((kernel - 1) * c)).unwrap_or(u32::MAX);
        let (bi, ci, ki) = (int(OP, "batch", batch)?, int(OP, "c", c)?, kernel as i32);
        let grid = (
            grid_u32(OP, c.div_ceil(128))?,
            u32::try_from(batch.min(65535)).unwrap_or(65535),
            1,
        );
        ensure(batch <= 65535, OP, || "batch exceeds 65535".into())?;
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (wp, _gw) = w.device_ptr(s);
        let (sp, _gs) = state_pool.device_ptr_mut(s);
        let (lp, _gl) = slots.device_ptr(s);
        let (op, _go) = out.device_ptr_mut(s);
        let mut b = s.launch_builder(self.kernel("conv1d_update_bf16")?);
        b.arg(&xp)
            .arg(&wp)
            .arg(&sp)
            .arg(&lp)
            .arg(&op)
            .arg(&bi)
            .arg(&ci)
            .arg(&ki)
            .arg(&num_slots);
        // SAFETY: argument types match the kernel; lengths checked above; the kernel skips slot ids
        // at or beyond `num_slots`.
        unsafe { b.launch(cfg(grid, 128, 0)) }?;
        Ok(())
    }
}
