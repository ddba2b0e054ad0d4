//! The hyper-connections' gated residual of a decode step as two fused kernels (`kernels/hc.cu`):
//! `s = silu(down·y + inject·x)` ([`Gpu::hc_down_inject_silu`]) and `R_c += sigmoid(up_c·s) ⊙ y`
//! ([`Gpu::hc_up_gate_mix`], which can also pre-mix the new streams for the next sublayer), with
//! `down` / `up` packed INT8 with one scale per row and `inject` bf16.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{PackedMat, PackedScheme};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Most rows (tokens) the fused kernels take: one entry point per row count 1..=8.
pub(crate) const HC_MAX_ROWS: usize = 8;
/// Threads of a `hc_down_inject_silu` block (`HC_DOWN_THREADS` in hc.cu).
const DOWN_THREADS: u32 = 128;
/// Threads of a `hc_up_gate_mix` block and outputs a block computes (`HC_UP_THREADS`,
/// `HC_UP_ROWS` in hc.cu): `UP_ROWS / S` columns of each of S streams.
const UP_THREADS: u32 = 256;
const UP_ROWS: usize = 32;

/// Whether the fused kernels take a hidden size `h` and a rank: both whole 32-value INT8 units.
pub(crate) fn hc_fused_shape(h: usize, rank: usize) -> bool {
    h > 0 && rank > 0 && h.is_multiple_of(32) && rank.is_multiple_of(32)
}

/// Checks the row count and shape the fused kernels take.
fn check_shape(op: &'static str, rows: usize, h: usize, rank: usize) -> Result<()> {
    ensure((1..=HC_MAX_ROWS).contains(&rows), op, || {
        format!("rows = {rows}, expected 1..={HC_MAX_ROWS}")
    })?;
    ensure(hc_fused_shape(h, rank), op, || {
        format!("h = {h} and rank = {rank} must be positive multiples of 32")
    })
}

/// The words of `w` when it is INT8 with one scale per row (the fused kernels' format), else why not.
fn int8_words<'a, W: DevicePtr<u32>>(
    op: &'static str,
    w: &PackedMat<'a, W, impl DevicePtr<f32>>,
) -> Result<&'a W> {
    let PackedScheme { bits, group_size } = w.scheme;
    ensure(
        bits == 8 && (group_size == 0 || group_size == w.k),
        op,
        || format!("INT{bits} weights with groups of {group_size}: expected INT8, one scale a row"),
    )?;
    Ok(w.words)
}

/// Checks a device address for the kernels' 16-byte vector loads.
fn aligned(op: &'static str, what: &str, p: u64) -> Result<()> {
    ensure(p.is_multiple_of(16), op, || {
        format!("{what} must be 16-byte aligned")
    })
}

impl Gpu {
    /// `s[m, r] = bf16(silu(scale[r]·(q_down[r]·y[m]) + inject[r]·x[m]))` for `rows` ≤ 8 rows:
    /// `down` packed INT8 `[rank, h]` (`rank · h/4` words) with one scale a row, `inject`
    /// `[rank, h]` bf16, `x`, `y` `[rows, h]`, `s` `[rows, rank]`. The sum is f32, rounded once.
    pub fn hc_down_inject_silu(
        &self,
        down: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        inject: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        y: &impl DevicePtr<bf16>,
        s: &mut impl DevicePtrMut<bf16>,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "hc_down_inject_silu";
        let (rank, h) = (down.n, down.k);
        let (down_scales, down) = (down.scales, int8_words(OP, down)?);
        check_shape(OP, rows, h, rank)?;
        check_len(OP, "down", down, rank * h / 4)?;
        check_len(OP, "down_scales", down_scales, rank)?;
        check_len(OP, "inject", inject, rank * h)?;
        check_len(OP, "x", x, rows * h)?;
        check_len(OP, "y", y, rows * h)?;
        check_len(OP, "s", s, rows * rank)?;
        for (what, p) in [
            ("down", self.addr(down)),
            ("inject", self.addr(inject)),
            ("x", self.addr(x)),
            ("y", self.addr(y)),
        ] {
            aligned(OP, what, p)?;
        }
        let (hi, ri) = (int(OP, "h", h)?, int(OP, "rank", rank)?);
        let mut b = self.launch(self.kernel(&format!("hc_down_inject_silu_m{rows}"))?);
        b.ptr(down)
            .ptr(down_scales)
            .ptr(inject)
            .ptr(x)
            .ptr(y)
            .ptr_mut(s)
            .arg(&hi)
            .arg(&ri);
        // SAFETY: argument types match the kernel; lengths, shape rules and alignment checked above;
        // one block of DOWN_THREADS per output r, as the kernel assumes.
        unsafe { b.launch(cfg((grid_u32(OP, rank)?, 1, 1), DOWN_THREADS, 0)) }?;
        Ok(())
    }

    /// `streams[m, c·h + j] = bf16(streams[m, c·h + j] + sigmoid(u) · y[m, j])` with
    /// `u = scale[c·h + j] · (q_up[c·h + j] · s[m])` kept in f32, for `rows` ≤ 8 rows and `nstreams`
    /// streams of `h`: `up` packed INT8 `[nstreams·h, rank]` (`nstreams·h · rank/4` words) with one
    /// scale a row, `s` `[rows, rank]`, `y` `[rows, h]`, `streams` `[rows, nstreams·h]`. With
    /// `premix = (pre, xn)`, also the next sublayer's pre-mix of the new streams, `xn[m] = Σ_c
    /// softmax(pre)_c · streams[m, c]` (`pre` `[nstreams]` f32, `xn` `[rows, h]`), as `hc_premix`
    /// computes it.
    pub fn hc_up_gate_mix(
        &self,
        up: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        (s, y): (&impl DevicePtr<bf16>, &impl DevicePtr<bf16>),
        streams: &mut impl DevicePtrMut<bf16>,
        premix: Option<(&CudaSlice<f32>, &mut CudaSlice<bf16>)>,
        rows: usize,
        h: usize,
    ) -> Result<()> {
        const OP: &str = "hc_up_gate_mix";
        let rank = up.k;
        let (up_scales, up_rows) = (up.scales, up.n);
        let up = int8_words(OP, up)?;
        check_shape(OP, rows, h, rank)?;
        ensure(up_rows > 0 && up_rows.is_multiple_of(h), OP, || {
            format!("{up_rows} rows of up are not streams of {h}")
        })?;
        let nstreams = up_rows / h;
        ensure(nstreams <= UP_ROWS, OP, || {
            format!("{nstreams} streams: at most {UP_ROWS}")
        })?;
        let n = nstreams * h;
        check_len(OP, "up", up, n * rank / 4)?;
        check_len(OP, "up_scales", up_scales, n)?;
        check_len(OP, "s", s, rows * rank)?;
        check_len(OP, "y", y, rows * h)?;
        check_len(OP, "streams", streams, rows * n)?;
        for (what, p) in [("up", self.addr(up)), ("s", self.addr(s))] {
            aligned(OP, what, p)?;
        }
        let (ni, hi, ri) = (int(OP, "n", n)?, int(OP, "h", h)?, int(OP, "rank", rank)?);
        // A block takes UP_ROWS / nstreams columns of every stream.
        let blocks = grid_u32(OP, h.div_ceil(UP_ROWS / nstreams))?;
        let (pre, xn) = match premix {
            Some((pre, xn)) => {
                check_len(OP, "pre", pre, nstreams)?;
                check_len(OP, "xn", &*xn, rows * h)?;
                (self.addr(pre), self.addr_mut(xn))
            }
            None => (0, 0),
        };
        let mut b = self.launch(self.kernel(&format!("hc_up_gate_mix_m{rows}"))?);
        b.ptr(up)
            .ptr(up_scales)
            .ptr(s)
            .ptr(y)
            .ptr_mut(streams)
            .arg(&ni)
            .arg(&hi)
            .arg(&ri)
            .arg(&pre)
            .arg(&xn);
        // SAFETY: argument types match the kernel; lengths, shape rules and alignment checked above;
        // blocks of UP_THREADS, UP_ROWS / nstreams columns of every stream each, cover the n outputs
        // as the kernel assumes; `pre` and `xn` are both null or both hold what the kernel reads and
        // writes.
        unsafe { b.launch(cfg((blocks, 1, 1), UP_THREADS, 0)) }?;
        Ok(())
    }
}
