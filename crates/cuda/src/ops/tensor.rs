//! Elementwise and row-shuffling ops on bf16 activations: residual add, the sigmoid-gated add, row
//! gather and column concatenation.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::{row_threads, NormRows};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Blocks of 256 threads for `n` elements of a grid-stride loop.
fn stride_blocks(op: &'static str, n: usize) -> Result<u32> {
    grid_u32(op, n.div_ceil(256).clamp(1, 1 << 16))
}

impl Gpu {
    /// `acc[i] += y[i]` for `i < n`.
    pub fn add_bf16(
        &self,
        acc: &mut impl DevicePtrMut<bf16>,
        y: &impl DevicePtr<bf16>,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "add";
        check_len(OP, "acc", acc, n)?;
        check_len(OP, "y", y, n)?;
        if n == 0 {
            return Ok(());
        }
        let nn = n as i64;
        let mut b = self.launch(self.kernel("add_bf16")?);
        b.ptr_mut(acc).ptr(y).arg(&nn);
        // SAFETY: argument types match the kernel; both buffers hold n elements.
        unsafe { b.launch(cfg((stride_blocks(OP, n)?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `acc += y`, then `out = rms_norm(acc)` row-wise (`[rows, d]`, `w`: `[d]`, `offset` as
    /// [`Gpu::rms_norm`]): one launch, the same values as [`Gpu::add_bf16`] then [`Gpu::rms_norm`].
    pub fn add_rms_norm(
        &self,
        acc: &mut impl DevicePtrMut<bf16>,
        y: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        shape: NormRows,
        offset: f32,
    ) -> Result<()> {
        const OP: &str = "add_rms_norm";
        let NormRows { rows, d, eps } = shape;
        ensure(d > 0, OP, || "d must be positive".into())?;
        check_len(OP, "acc", acc, rows * d)?;
        check_len(OP, "y", y, rows * d)?;
        check_len(OP, "w", w, d)?;
        check_len(OP, "out", out, rows * d)?;
        if rows == 0 {
            return Ok(());
        }
        let (grid, di) = (grid_u32(OP, rows)?, int(OP, "d", d)?);
        let mut b = self.launch(self.kernel("add_rms_norm_bf16")?);
        b.ptr_mut(acc)
            .ptr(y)
            .ptr(w)
            .ptr_mut(out)
            .arg(&di)
            .arg(&eps)
            .arg(&offset);
        // SAFETY: argument types match the kernel; acc, y and out hold rows·d elements, w d.
        unsafe { b.launch(cfg((grid, 1, 1), row_threads(d), 0)) }?;
        Ok(())
    }

    /// `out[r, :] = x[idx[r], :]` (zeros for an index at or beyond `x_rows`); `x`: `[x_rows, cols]`,
    /// `idx`: `[rows]`, `out`: `[rows, cols]`.
    pub fn gather_rows(
        &self,
        x: &impl DevicePtr<bf16>,
        idx: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<bf16>,
        x_rows: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "gather_rows";
        check_len(OP, "x", x, x_rows * cols)?;
        check_len(OP, "idx", idx, rows)?;
        check_len(OP, "out", out, rows * cols)?;
        if rows * cols == 0 {
            return Ok(());
        }
        let (c, xr) = (
            int(OP, "cols", cols)?,
            u32::try_from(x_rows).unwrap_or(u32::MAX),
        );
        let mut b = self.launch(self.kernel("gather_rows_bf16")?);
        b.ptr(x).ptr(idx).ptr_mut(out).arg(&c).arg(&xr);
        // SAFETY: argument types match the kernel; the kernel reads x only below x_rows.
        unsafe { b.launch(cfg((grid_u32(OP, rows)?, 1, 1), row_threads(cols), 0)) }?;
        Ok(())
    }

    /// `out[r, :] = [a[r, :] | b[r, :]]`; `a`: `[rows, ca]`, `b`: `[rows, cb]`.
    pub fn concat_cols(
        &self,
        a: &impl DevicePtr<bf16>,
        b: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        ca: usize,
        cb: usize,
    ) -> Result<()> {
        const OP: &str = "concat_cols";
        ensure(ca + cb > 0 || rows == 0, OP, || "no columns".into())?;
        check_len(OP, "a", a, rows * ca)?;
        check_len(OP, "b", b, rows * cb)?;
        check_len(OP, "out", out, rows * (ca + cb))?;
        if rows == 0 {
            return Ok(());
        }
        let (cai, cbi) = (int(OP, "ca", ca)?, int(OP, "cb", cb)?);
        let mut l = self.launch(self.kernel("concat_cols_bf16")?);
        l.ptr(a).ptr(b).ptr_mut(out).arg(&cai).arg(&cbi);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { l.launch(cfg((grid_u32(OP, rows)?, 1, 1), row_threads(ca + cb), 0)) }?;
        Ok(())
    }
}

impl Gpu {
    /// `out[i] = silu(x[i])` for `i < n`.
    pub fn silu(
        &self,
        x: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "silu";
        check_len(OP, "x", x, n)?;
        check_len(OP, "out", out, n)?;
        if n == 0 {
            return Ok(());
        }
        let nn = n as i64;
        let mut b = self.launch(self.kernel("silu_bf16")?);
        b.ptr(x).ptr_mut(out).arg(&nn);
        // SAFETY: argument types match the kernel; both buffers hold n elements.
        unsafe { b.launch(cfg((stride_blocks(OP, n)?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Hyper-connections pre-mix: `out[r, :] = Σ_c softmax(pre)_c · streams[r, c·h ..]`; `streams`:
    /// `[rows, s·h]`, `pre`: `[s]` f32, `out`: `[rows, h]`.
    pub fn hc_premix(
        &self,
        streams: &impl DevicePtr<bf16>,
        pre: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        s: usize,
        h: usize,
    ) -> Result<()> {
        const OP: &str = "hc_premix";
        ensure(s > 0, OP, || "no streams".into())?;
        check_len(OP, "streams", streams, rows * s * h)?;
        check_len(OP, "pre", pre, s)?;
        check_len(OP, "out", out, rows * h)?;
        if rows * h == 0 {
            return Ok(());
        }
        let (r, si, hi) = (rows as i64, int(OP, "s", s)?, int(OP, "h", h)?);
        let mut b = self.launch(self.kernel("hc_premix_bf16")?);
        b.ptr(streams)
            .ptr(pre)
            .ptr_mut(out)
            .arg(&r)
            .arg(&si)
            .arg(&hi);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { b.launch(cfg((stride_blocks(OP, rows * h)?, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Hyper-connections gated residual: `streams[r, c·h + j] += sigmoid(u[r, c·h + j]) · y[r, j]`.
    pub fn hc_gated_residual(
        &self,
        streams: &mut impl DevicePtrMut<bf16>,
        u: &impl DevicePtr<bf16>,
        y: &impl DevicePtr<bf16>,
        rows: usize,
        s: usize,
        h: usize,
    ) -> Result<()> {
        const OP: &str = "hc_gated_residual";
        check_len(OP, "streams", streams, rows * s * h)?;
        check_len(OP, "u", u, rows * s * h)?;
        check_len(OP, "y", y, rows * h)?;
        if rows * s * h == 0 {
            return Ok(());
        }
        let (r, si, hi) = (rows as i64, int(OP, "s", s)?, int(OP, "h", h)?);
        let mut b = self.launch(self.kernel("hc_gated_residual_bf16")?);
        b.ptr_mut(streams).ptr(u).ptr(y).arg(&r).arg(&si).arg(&hi);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { b.launch(cfg((stride_blocks(OP, rows * s * h)?, 1, 1), 256, 0)) }?;
        Ok(())
    }
}
