//! The gated delta rule on the GPU, state f32: the recurrent decode step (one token per sequence); the
//! chunked prefill is in `gdn_chunk.rs`.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, int, Gpu};

/// Head counts and sizes of a GDN layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl GdnDims {
    /// Width of the conv output row `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }

    /// f32 values of one sequence's recurrent state, `[hv, dk, dv]`.
    pub fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
}

/// The largest key head size the kernels take.
const MAX_DK: usize = 256;
/// Threads of a decode-step block (`GDN_STEP_THREADS` in `gdn.cu`).
const STEP_THREADS: u32 = 128;
/// Value columns of a decode-step block (`GDN_STEP_COLS` in `gdn.cu`).
const STEP_COLS: usize = 32;
/// The largest key head size of `gdn_recurrent_step`; larger ones take `gdn_recurrent_step_dk256`.
const STEP_SMALL_DK: usize = 128;

impl Gpu {
    /// One decode step of `batch` sequences (one block per sequence, value head and 32 value
    /// columns; the block's slice of the state is read once into registers and written once). `qkv`: `[batch, conv_dim]`, the conv+SiLU output
    /// `[q | k | v]` (q, k `[hk, dk]`, v `[hv, dv]`); `a`, `b`: `[batch, hv]` raw projections;
    /// `a_log`, `dt_bias`: `[hv]`; sequence `i` updates slot `slots[i]` of `state_pool`
    /// `[num_slots, hv, dk, dv]` (out of range: zero output, no state touched); `out`: `[batch, hv·dv]`.
    /// Matches the CPU's gates (`g = −exp(A_log)·softplus(a + dt_bias)`, `β = sigmoid(b)`) followed by
    /// `sanmai_cpu::ops::gdn_recurrent` with `t = 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_recurrent_step(
        &self,
        dims: GdnDims,
        qkv: &impl DevicePtr<bf16>,
        a: &impl DevicePtr<bf16>,
        b: &impl DevicePtr<bf16>,
        a_log: &impl DevicePtr<f32>,
        dt_bias: &impl DevicePtr<f32>,
        state_pool: &mut impl DevicePtrMut<f32>,
        slots: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<bf16>,
        batch: usize,
    ) -> Result<()> {
        const OP: &str = "gdn_recurrent_step";
        let GdnDims { hk, hv, dk, dv } = dims;
        ensure(hk > 0 && hv > 0 && hv % hk == 0, OP, || {
            format!("hv = {hv} must be a positive multiple of hk = {hk}")
        })?;
        ensure(dk > 0 && dk <= MAX_DK && dv > 0, OP, || {
            format!("dk = {dk} must be in 1..={MAX_DK}, dv = {dv} positive")
        })?;
        ensure(batch <= 65535, OP, || "batch exceeds 65535".into())?;
        let cd = dims.conv_dim();
        check_len(OP, "qkv", qkv, batch * cd)?;
        check_len(OP, "a", a, batch * hv)?;
        check_len(OP, "b", b, batch * hv)?;
        check_len(OP, "a_log", a_log, hv)?;
        check_len(OP, "dt_bias", dt_bias, hv)?;
        check_len(OP, "slots", slots, batch)?;
        check_len(OP, "out", out, batch * hv * dv)?;
        if batch == 0 {
            return Ok(());
        }
        let num_slots = u32::try_from(state_pool.len() / dims.state_len()).unwrap_or(u32::MAX);
        let q_scale = (dk as f64).powf(-0.5) as f32;
        let (hki, hvi, dki, dvi) = (
            int(OP, "hk", hk)?,
            int(OP, "hv", hv)?,
            dk as i32,
            int(OP, "dv", dv)?,
        );
        let (qkv_stride, ab_stride) = (cd as i64, hv as i64);
        let grid = (hvi as u32, dv.div_ceil(STEP_COLS) as u32, batch as u32);
        let kernel = if dk <= STEP_SMALL_DK {
            "gdn_recurrent_step"
        } else {
            "gdn_recurrent_step_dk256"
        };
        let s = self.stream();
        let (qp, _gq) = qkv.device_ptr(s);
        let kp = qp + (hk * dk * 2) as u64;
        let vp = qp + (2 * hk * dk * 2) as u64;
        let (ap, _ga) = a.device_ptr(s);
        let (bp, _gb) = b.device_ptr(s);
        let (lp, _gl) = a_log.device_ptr(s);
        let (dp, _gd) = dt_bias.device_ptr(s);
        let (sp, _gs) = state_pool.device_ptr_mut(s);
        let (slp, _gsl) = slots.device_ptr(s);
        let (op, _go) = out.device_ptr_mut(s);
        let mut l = self.launch(self.kernel(kernel)?);
        l.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&qkv_stride)
            .arg(&ap)
            .arg(&bp)
            .arg(&ab_stride)
            .arg(&lp)
            .arg(&dp)
            .arg(&sp)
            .arg(&slp)
            .arg(&op)
            .arg(&hki)
            .arg(&hvi)
            .arg(&dki)
            .arg(&dvi)
            .arg(&q_scale)
            .arg(&num_slots);
        // SAFETY: argument types match the kernel; lengths checked above (k and v lie inside each qkv
        // row); slot ids at or beyond `num_slots` are skipped by the kernel; the block size is the
        // GDN_STEP_THREADS it requires and dk is within the chosen kernel's limit.
        unsafe { l.launch(cfg(grid, STEP_THREADS, 0)) }?;
        Ok(())
    }
}
