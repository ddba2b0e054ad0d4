//! The backend's row and elementwise ops on activations: selected rows, rows overwritten, column
//! concatenation, the residual add (alone or with the next RMSNorm), RMSNorm, SwiGLU and SiLU.

use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::ops::NormRows;

/// The rows of `x` as a norm kernel takes them.
fn norm_rows(x: &CudaTensor, eps: f32) -> NormRows {
    NormRows {
        rows: x.rows,
        d: x.cols,
        eps,
    }
}

impl CudaBackend {
    pub(super) fn rows_impl(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        let mut out = self.alloc(rows.len(), x.cols)?;
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(CudaError::Shape {
                op: "rows",
                msg: format!("row {bad} of a {}-row tensor", x.rows),
            });
        }
        let contiguous = rows.windows(2).all(|w| w[1] == w[0] + 1);
        if rows.is_empty() {
            return Ok(out);
        }
        if contiguous {
            let c = x.cols;
            let src = x.buf.slice(rows[0] * c..(rows[0] + rows.len()) * c);
            self.gpu
                .stream()
                .memcpy_dtod(&src, &mut out.buf.slice_mut(..rows.len() * c))?;
        } else {
            let mut st = self.lock();
            let at = st.meta.out_rows(&self.gpu, rows)?;
            let view = st.meta.view(at, rows.len());
            self.gpu
                .gather_rows(&x.buf, &view, &mut out.buf, x.rows, rows.len(), x.cols)?;
        }
        Ok(out)
    }

    pub(super) fn rms_norm_impl(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        let mut y = self.alloc(x.rows, x.cols)?;
        self.gpu
            .rms_norm(&x.buf, w.bf16()?, &mut y.buf, norm_rows(x, eps), offset)?;
        Ok(y)
    }

    /// Row `rows[i]` of `x` becomes row `i` of `values`: one device copy per run of consecutive
    /// rows (an image's placeholder rows are one run).
    pub(super) fn set_rows_impl(
        &self,
        x: &mut CudaTensor,
        rows: &[usize],
        values: &CudaTensor,
    ) -> Result<()> {
        let bad = |msg: String| CudaError::Shape {
            op: "set_rows",
            msg,
        };
        if values.rows != rows.len() || values.cols != x.cols {
            return Err(bad(format!(
                "values [{}, {}] for {} rows {} wide",
                values.rows,
                values.cols,
                rows.len(),
                x.cols
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(bad(format!("row {r} of a {}-row tensor", x.rows)));
        }
        let c = x.cols;
        let mut i = 0;
        while i < rows.len() {
            let mut n = 1;
            while i + n < rows.len() && rows[i + n] == rows[i] + n {
                n += 1;
            }
            let src = values.buf.slice(i * c..(i + n) * c);
            let mut dst = x.buf.slice_mut(rows[i] * c..(rows[i] + n) * c);
            self.gpu.stream().memcpy_dtod(&src, &mut dst)?;
            i += n;
        }
        Ok(())
    }

    pub(super) fn concat_cols_impl(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        if a.rows != b.rows {
            return Err(CudaError::Shape {
                op: "concat_cols",
                msg: format!("{} rows against {}", a.rows, b.rows),
            });
        }
        let mut y = self.alloc(a.rows, a.cols + b.cols)?;
        self.gpu
            .concat_cols(&a.buf, &b.buf, &mut y.buf, a.rows, a.cols, b.cols)?;
        Ok(y)
    }

    pub(super) fn add_impl(&self, acc: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        let n = acc.len();
        if y.len() != n {
            return Err(CudaError::Shape {
                op: "add",
                msg: format!("{n} values plus {}", y.len()),
            });
        }
        self.gpu.add_bf16(&mut acc.buf, &y.buf, n)
    }

    pub(super) fn add_rms_norm_impl(
        &self,
        acc: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        if y.rows != acc.rows || y.cols != acc.cols {
            return Err(CudaError::Shape {
                op: "add_rms_norm",
                msg: format!("[{}, {}] plus [{}, {}]", acc.rows, acc.cols, y.rows, y.cols),
            });
        }
        let (r, c) = (acc.rows, acc.cols);
        let mut out = self.alloc(r, c)?;
        let shape = norm_rows(acc, eps);
        self.gpu
            .add_rms_norm(&mut acc.buf, &y.buf, w.bf16()?, &mut out.buf, shape, offset)?;
        Ok(out)
    }

    pub(super) fn swiglu_impl(&self, gate_up: &CudaTensor) -> Result<CudaTensor> {
        if !gate_up.cols.is_multiple_of(2) {
            return Err(CudaError::Shape {
                op: "swiglu",
                msg: format!("{} columns are not gate|up halves", gate_up.cols),
            });
        }
        let i = gate_up.cols / 2;
        let mut y = self.alloc(gate_up.rows, i)?;
        self.gpu.swiglu(&gate_up.buf, &mut y.buf, gate_up.rows, i)?;
        Ok(y)
    }

    pub(super) fn silu_impl(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let mut y = self.alloc(x.rows, x.cols)?;
        self.gpu.silu(&x.buf, &mut y.buf, x.len())?;
        Ok(y)
    }
}
