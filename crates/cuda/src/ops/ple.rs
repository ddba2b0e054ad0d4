//! The PLE mix after its projections (`kernels/ple.cu`): the per-stream gate and its normed copy, and
//! the dilated causal depthwise conv + SiLU with its per-sequence state and the residual update.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::row_threads;
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The shape of one PLE mix: `streams` S, `hidden` H, and the conv's `kernel` and `dilation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PleDims {
    pub streams: usize,
    pub hidden: usize,
    pub kernel: usize,
    pub dilation: usize,
}

impl PleDims {
    /// Past rows of the conv state, `(kernel − 1)·dilation`.
    pub fn past(&self) -> usize {
        (self.kernel - 1) * self.dilation
    }
}

/// The per-stream weights of [`Gpu::ple_gate`]: biases and norm weights, `[H]` bf16 each.
pub struct PleGateWeights<'a, W: DevicePtr<bf16>> {
    pub value_bias: &'a W,
    pub key_bias: &'a W,
    pub key_norm: &'a W,
    pub query_norm: &'a W,
    pub conv_norm: &'a W,
}

/// The PLE mix's gated values `u` and normed conv inputs `z` of `rows` tokens, `[rows, S·H]` f32
/// each: `PleGated<&CudaSlice<f32>>` where the conv reads them, `PleGated<&mut CudaSlice<f32>>` where
/// [`Gpu::ple_gate`] writes them.
pub struct PleGated<T> {
    pub u: T,
    pub z: T,
    pub rows: usize,
}

/// One stream's value and key projections of the tokens, `[rows, H]` f32 each.
pub struct PleLin<'a, F: DevicePtr<f32>> {
    pub value: &'a F,
    pub key: &'a F,
}

impl Gpu {
    /// Stream `c` of `rows` tokens: `v = v_lin + value_bias`, `key = rmsnorm(k_lin + key_bias;
    /// key_norm)`, `q = rmsnorm(R_c; query_norm)`, `σ = signed_sqrt(⟨key, q⟩/sqrt(H))`, `u_c =
    /// sigmoid(σ)·v`, `z_c = rmsnorm(u_c; conv_norm)` (plain-weight rmsnorms, eps 1e-6), with
    /// `v_lin`, `k_lin` the stream's projections `lin`; `streams`: `[rows, S·H]` bf16; `out.u`,
    /// `out.z`: `[rows, S·H]` f32 (`rows = out.rows`), stream `c`'s columns written. Matches
    /// `sanmai_cpu::ops::ple_gate` then `rms_norm`.
    pub fn ple_gate(
        &self,
        dims: PleDims,
        c: usize,
        lin: &PleLin<'_, impl DevicePtr<f32>>,
        w: &PleGateWeights<'_, impl DevicePtr<bf16>>,
        streams: &impl DevicePtr<bf16>,
        out: PleGated<&mut impl DevicePtrMut<f32>>,
    ) -> Result<()> {
        const OP: &str = "ple_gate";
        let PleLin {
            value: v_lin,
            key: k_lin,
        } = *lin;
        let PleGated { u, z, rows } = out;
        let (s, h) = (dims.streams, dims.hidden);
        ensure(c < s && h > 0, OP, || {
            format!("stream {c} of {s}, hidden {h}")
        })?;
        check_len(OP, "v_lin", v_lin, rows * h)?;
        check_len(OP, "k_lin", k_lin, rows * h)?;
        for (what, x) in [
            ("value_bias", w.value_bias),
            ("key_bias", w.key_bias),
            ("key_norm", w.key_norm),
            ("query_norm", w.query_norm),
            ("conv_norm", w.conv_norm),
        ] {
            check_len(OP, what, x, h)?;
        }
        check_len(OP, "streams", streams, rows * s * h)?;
        check_len(OP, "u", u, rows * s * h)?;
        check_len(OP, "z", z, rows * s * h)?;
        if rows == 0 {
            return Ok(());
        }
        let (hi, si, ci) = (int(OP, "H", h)?, int(OP, "S", s)?, int(OP, "c", c)?);
        let mut l = self.launch(self.kernel("ple_gate")?);
        l.ptr(v_lin)
            .ptr(w.value_bias)
            .ptr(k_lin)
            .ptr(w.key_bias)
            .ptr(w.key_norm)
            .ptr(streams)
            .ptr(w.query_norm)
            .ptr(w.conv_norm)
            .ptr_mut(u)
            .ptr_mut(z)
            .arg(&hi)
            .arg(&si)
            .arg(&ci);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { l.launch(cfg((grid_u32(OP, rows)?, 1, 1), row_threads(h), 0)) }?;
        Ok(())
    }

    /// One chunk of `t = gated.rows` rows of one sequence: `y = silu(Σ_j w[ch, j]·xx[s + j·dil,
    /// ch])` with `xx = state ++ z`, `streams[s, ch] += u[s, ch] + y`, then `state ←` the last
    /// `(K−1)·dil` rows of `xx`. `z`, `u`: `[t, C]` f32; `streams`: `[t, C]` bf16; `w`: `[C, K]`;
    /// `state`: `[(K−1)·dil, C]` f32. Matches `sanmai_cpu::ops::dilated_conv_silu` and the residual
    /// update of the PLE mix.
    pub fn ple_conv(
        &self,
        dims: PleDims,
        gated: &PleGated<&impl DevicePtr<f32>>,
        w: &impl DevicePtr<bf16>,
        state: &mut impl DevicePtrMut<f32>,
        streams: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "ple_conv";
        let PleGated { u, z, rows: t } = *gated;
        ensure(dims.kernel >= 1 && dims.dilation >= 1, OP, || {
            "kernel and dilation must be positive".into()
        })?;
        let c = dims.streams * dims.hidden;
        let past = dims.past();
        check_len(OP, "z", z, t * c)?;
        check_len(OP, "u", u, t * c)?;
        check_len(OP, "w", w, c * dims.kernel)?;
        check_len(OP, "state", state, past * c)?;
        check_len(OP, "streams", streams, t * c)?;
        if t == 0 || c == 0 {
            return Ok(());
        }
        let (ti, ci, ki, di, pi) = (
            int(OP, "t", t)?,
            int(OP, "C", c)?,
            int(OP, "kernel", dims.kernel)?,
            int(OP, "dilation", dims.dilation)?,
            int(OP, "past", past)?,
        );
        let mut l = self.launch(self.kernel("ple_conv")?);
        l.ptr(z)
            .ptr(w)
            .ptr_mut(state)
            .ptr(u)
            .ptr_mut(streams)
            .arg(&ti)
            .arg(&ci)
            .arg(&ki)
            .arg(&di);
        let blocks = grid_u32(OP, (t * c).div_ceil(256).min(1 << 20))?;
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { l.launch(cfg((blocks, 1, 1), 256, 0)) }?;
        drop(l);
        if past > 0 {
            let mut l = self.launch(self.kernel("ple_conv_state")?);
            l.ptr(z).ptr_mut(state).arg(&ti).arg(&ci).arg(&pi);
            // SAFETY: as above; queued after the convolution on the same stream.
            unsafe { l.launch(cfg((grid_u32(OP, c.div_ceil(256))?, 1, 1), 256, 0)) }?;
        }
        Ok(())
    }

    /// The decode form of [`Gpu::ple_conv`] for `gated.rows` sequences of one token each: row `r`'s
    /// conv state is slot `slots[r]` (read on the device) of `state_pool` (`[n_slots, (K−1)·dil, C]`
    /// f32, a slot beyond it skipped). `y = silu(Σ_j w[ch, j]·xx[j·dil, ch])` with `xx = state ++
    /// z[r]`, `streams[r, ch] += u[r, ch] + y`, then the state rolls by one row. `z`, `u`: `[rows, C]`
    /// f32; `streams`: `[rows, C]` bf16. Equals `ple_conv` with `t = 1` on each row's slot, bit for
    /// bit.
    pub fn ple_conv_decode(
        &self,
        dims: PleDims,
        gated: &PleGated<&impl DevicePtr<f32>>,
        w: &impl DevicePtr<bf16>,
        state_pool: &mut impl DevicePtrMut<f32>,
        slots: &impl DevicePtr<u32>,
        streams: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "ple_conv_decode";
        let PleGated { u, z, rows } = *gated;
        ensure(dims.kernel >= 1 && dims.dilation >= 1, OP, || {
            "kernel and dilation must be positive".into()
        })?;
        let c = dims.streams * dims.hidden;
        let per_slot = dims.past() * c;
        check_len(OP, "z", z, rows * c)?;
        check_len(OP, "u", u, rows * c)?;
        check_len(OP, "w", w, c * dims.kernel)?;
        check_len(OP, "slots", slots, rows)?;
        check_len(OP, "streams", streams, rows * c)?;
        if rows == 0 || c == 0 {
            return Ok(());
        }
        // Without past rows no state is read or written: every slot is in range.
        let n_slots = state_pool
            .len()
            .checked_div(per_slot)
            .map_or(u32::MAX, |n| u32::try_from(n).unwrap_or(u32::MAX));
        let (ri, ci, ki, di) = (
            int(OP, "rows", rows)?,
            int(OP, "C", c)?,
            int(OP, "kernel", dims.kernel)?,
            int(OP, "dilation", dims.dilation)?,
        );
        let mut l = self.launch(self.kernel("ple_conv_decode")?);
        l.ptr(z)
            .ptr(w)
            .ptr_mut(state_pool)
            .ptr(slots)
            .arg(&n_slots)
            .ptr(u)
            .ptr_mut(streams)
            .arg(&ri)
            .arg(&ci)
            .arg(&ki)
            .arg(&di);
        let blocks = grid_u32(OP, (rows * c).div_ceil(256).min(1 << 20))?;
        // SAFETY: argument types match the kernel; lengths checked above; slots at or beyond n_slots
        // are skipped by the kernel.
        unsafe { l.launch(cfg((blocks, 1, 1), 256, 0)) }?;
        Ok(())
    }
}
