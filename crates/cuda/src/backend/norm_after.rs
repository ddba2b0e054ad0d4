//! The residual add and the next norm that a decode step's last launch also does ([`NormAfter`]):
//! the MoE combine and the one-launch MoE layer, GDN mixer and attention mixer take it. A one-launch
//! layer may leave the norm to the next launch ([`LeftNorm`]): the row it returns is written by the
//! next one-launch layer that reads it, or by [`CudaBackend::settle`] before any other op.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use cudarc::driver::CudaSlice;
use half::bf16;

use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{CombineInto, NormIn, NormLink};

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

    /// The norm's residual, weight, eps and offset as a [`NormIn`] (no partial sums yet).
    pub(super) fn norm_in(&self, gpu: &Gpu) -> NormIn {
        NormIn {
            acc: gpu.addr(&self.acc.buf),
            w: gpu.addr(self.w),
            eps: self.eps,
            offset: self.offset,
            ..NormIn::default()
        }
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

/// A norm a one-launch layer or the fused gated residual left to the next launch ([`NormLink`]): the
/// row tensor it stands for (its buffer's address, and a weak hold on the tensor's token: the row is
/// written out only while the tensor lives), the norm's [`NormIn`] and the launch's partial sums it
/// reads (held here until then; none for a whole row).
pub(super) struct LeftNorm {
    row: u64,
    h: usize,
    alive: Weak<()>,
    pub input: NormIn,
    _partials: Option<CudaSlice<f32>>,
}

impl CudaBackend {
    /// Whether a one-launch layer whose output is added and normed (`after`) leaves the norm to the
    /// next launch: the switch ([`super::CudaOptions::left_norm`]) and the fused decode launches on.
    pub(super) fn leaves_norm(&self, after: bool) -> bool {
        after
            && self.switches.left_norm.load(Ordering::Relaxed)
            && self.switches.fused_decode.load(Ordering::Relaxed)
    }

    /// The launch link of a one-launch layer reading `x`, leaving its norm or not: the norm left for
    /// `x`, which the caller holds until its launch is queued, or none (any other left norm written
    /// out first: [`CudaBackend::settle`]).
    pub(super) fn norm_link(
        &self,
        x: &CudaTensor,
        leave: bool,
    ) -> Result<(NormLink, Option<LeftNorm>)> {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        let mine = match (left.as_ref(), x.token.as_ref()) {
            (Some(l), Some(t)) => std::ptr::eq(Arc::as_ptr(t), l.alive.as_ptr()),
            _ => false,
        };
        let taken = if mine { left.take() } else { None };
        self.write_out(&mut left)?;
        let link = NormLink {
            input: taken.as_ref().map(|l| l.input),
            leave,
        };
        Ok((link, taken))
    }

    /// Records that the launch just queued left the norm of `row` (`[1, h]`, unwritten) to the next
    /// launch: `input` (the residual, weight, eps and offset: [`NormAfter::norm_in`]) with its
    /// `blocks` blocks' sums in `partials`.
    pub(super) fn left_norm(
        &self,
        row: &mut CudaTensor,
        input: NormIn,
        partials: CudaSlice<f32>,
        blocks: u32,
    ) {
        let input = NormIn {
            partials: self.gpu.addr(&partials),
            blocks: blocks as i32,
            ..input
        };
        self.leave(row, input, Some(partials));
    }

    /// The RMSNorm of the whole row `x` (`[1, h]`, weight `w`) as a row left to the next launch:
    /// `Some` (the normed row's tensor, unwritten until then) where [`CudaBackend::leaves_norm`] and
    /// the vector RMSNorm kernel takes the row ([`crate::Gpu::rms_norm_row_threads`]: the next launch
    /// sums it as that kernel does, the same bits), else `None`. `x` and `w` must stay alive and
    /// unchanged until the next launch (the model holds them).
    pub(super) fn left_row_norm(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<bf16>,
        eps: f32,
        offset: f32,
    ) -> Result<Option<CudaTensor>> {
        if x.rows != 1 || !self.leaves_norm(true) {
            return Ok(None);
        }
        let (acc, wa) = (self.gpu.addr(&x.buf), self.gpu.addr(w));
        let mut row = self.alloc(1, x.cols)?;
        let ptrs = [acc, wa, self.gpu.addr(&row.buf)];
        let Some(tpr) = self.gpu.rms_norm_row_threads(x.cols, &ptrs) else {
            return Ok(None);
        };
        let input = NormIn {
            acc,
            partials: 0,
            w: wa,
            blocks: tpr,
            eps,
            offset,
        };
        self.leave(&mut row, input, None);
        Ok(Some(row))
    }

    /// Records the norm `input` of `row` (unwritten) as left to the next launch.
    fn leave(&self, row: &mut CudaTensor, input: NormIn, partials: Option<CudaSlice<f32>>) {
        let token = Arc::new(());
        let l = LeftNorm {
            row: self.gpu.addr(&row.buf),
            h: row.len(),
            alive: Arc::downgrade(&token),
            input,
            _partials: partials,
        };
        row.token = Some(token);
        *self.left.lock().unwrap_or_else(|p| p.into_inner()) = Some(l);
    }

    /// Writes out the norm a one-launch layer left, if any: what every op but the one-launch layers
    /// does first, so no other op reads the row unwritten or changes the residual before.
    pub(super) fn settle(&self) -> Result<()> {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        self.write_out(&mut left)
    }

    /// [`CudaBackend::settle`] under the lock (held until the launch is queued, so that a launch of
    /// another thread that finds no left norm comes after it).
    fn write_out(&self, left: &mut Option<LeftNorm>) -> Result<()> {
        let Some(l) = left.take() else {
            return Ok(());
        };
        // A row nobody holds any more is not written (its buffer may be another's by now).
        let Some(_token) = l.alive.upgrade() else {
            return Ok(());
        };
        // SAFETY: the residual and the weight outlive the step that left the norm (the model holds
        // them), the partial sums are held by `l` until after this launch is queued, and the row's
        // tensor is alive (its token) with h values.
        unsafe { self.gpu.norm_in(&l.input, l.row, l.h) }
    }
}
