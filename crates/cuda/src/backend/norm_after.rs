//! The residual add and the next norm that a decode step's last launch also does ([`NormAfter`]):
//! the MoE combine, the one-launch MoE layer and the one-launch GDN mixer take it.

use cudarc::driver::CudaSlice;
use half::bf16;

use super::tensor::{CudaTensor, CudaWeight};
use crate::error::{CudaError, Result};
use crate::ops::CombineInto;

/// The residual add and the next norm that a call's last launch also does
/// ([`CombineInto::AddNorm`]): the residual `[rows, H]`, the norm's weight `[H]`, eps and offset.
pub(super) struct NormAfter<'a> {
    pub acc: &'a mut CudaTensor,
    pub w: &'a CudaSlice<bf16>,
    pub eps: f32,
    pub offset: f32,
}

impl<'a> NormAfter<'a> {
    /// The add to the residual `acc` and its norm (weight `w`) of rows shaped as `x`, which `acc`
    /// must be.
    pub(super) fn for_rows(
        acc: &'a mut CudaTensor,
        x: &CudaTensor,
        w: &'a CudaWeight,
        eps: f32,
        offset: f32,
    ) -> Result<Self> {
        if (acc.rows, acc.cols) != (x.rows, x.cols) {
            return Err(CudaError::Shape {
                op: "add_rms_norm",
                msg: format!("[{}, {}] plus [{}, {}]", acc.rows, acc.cols, x.rows, x.cols),
            });
        }
        Ok(NormAfter {
            acc,
            w: w.bf16()?,
            eps,
            offset,
        })
    }

    /// Where a combine puts its rows: `out`, or (`after`) their add to the residual, the norm into
    /// `out`.
    pub(super) fn combine_into(
        after: Option<Self>,
        out: &'a mut CudaTensor,
    ) -> CombineInto<'a, CudaSlice<bf16>> {
        match after {
            None => CombineInto::Rows(&mut out.buf),
            Some(n) => CombineInto::AddNorm {
                acc: &mut n.acc.buf,
                w: n.w,
                normed: &mut out.buf,
                eps: n.eps,
                offset: n.offset,
            },
        }
    }
}
