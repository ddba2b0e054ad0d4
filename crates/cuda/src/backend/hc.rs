//! Hyper-connections on the device (spec §4): the pre-mix (and head collapse) and the gated residual
//! over the `[rows, S·H]` residual streams, and the whole gated residual of a decode-sized sublayer in
//! two fused kernels (`ops::hc`), the second of which can also pre-mix the streams for the next
//! sublayer; other steps run the trait's op sequences
//! ([`hc_residual_ops`](sanmai_model::backend::hc_residual_ops)).

use cudarc::driver::CudaSlice;
use sanmai_model::backend::{
    hc_residual_ops, hc_residual_premix_norm_ops, HcNext, HcWeights, OpResult,
};

use super::tensor::{CudaTensor, CudaWeight, PackedWeight};
use super::CudaBackend;
use crate::error::{At, CudaError, Result};
use crate::ops::hc::{hc_fused_shape, HC_MAX_ROWS};

impl CudaBackend {
    /// [`Backend::hc_residual`](sanmai_model::Backend::hc_residual): the two fused kernels where
    /// they take the step, else the op sequence.
    pub(super) fn hc_residual_impl(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
    ) -> OpResult<()> {
        if self
            .hc_residual_fused(streams, (x, y), w, None)
            .at("hc_residual")?
        {
            return Ok(());
        }
        hc_residual_ops(self, streams, x, y, w)
    }

    /// [`Backend::hc_residual_premix_norm`](sanmai_model::Backend::hc_residual_premix_norm): the
    /// pre-mix in the fused kernels where they take the step, else the three calls.
    pub(super) fn hc_residual_premix_norm_impl(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
        next: HcNext<'_, CudaWeight>,
    ) -> OpResult<(CudaTensor, CudaTensor)> {
        if let Some(out) = self
            .hc_residual_premixed(streams, (x, y), w, &next)
            .at("hc_residual_premix_norm")?
        {
            return Ok(out);
        }
        hc_residual_premix_norm_ops(self, streams, (x, y), w, next)
    }

    pub(crate) fn hc_premix_impl(
        &self,
        streams: &CudaTensor,
        pre: &CudaWeight,
    ) -> Result<CudaTensor> {
        let s = pre.cols();
        let p = pre.f32().ok_or_else(|| CudaError::Shape {
            op: "hc_premix",
            msg: "pre is not a vector".into(),
        })?;
        if s == 0 || !streams.cols.is_multiple_of(s) {
            return Err(CudaError::Shape {
                op: "hc_premix",
                msg: format!("{} columns are not {s} streams", streams.cols),
            });
        }
        let h = streams.cols / s;
        let mut y = self.alloc(streams.rows, h)?;
        self.gpu
            .hc_premix(&streams.buf, p, &mut y.buf, streams.rows, s, h)?;
        Ok(y)
    }

    pub(crate) fn hc_gated_residual_impl(
        &self,
        streams: &mut CudaTensor,
        u: &CudaTensor,
        y: &CudaTensor,
    ) -> Result<()> {
        let h = y.cols;
        if h == 0 || !streams.cols.is_multiple_of(h) || u.cols != streams.cols {
            return Err(CudaError::Shape {
                op: "hc_gated_residual",
                msg: format!(
                    "streams {} / u {} columns against y {h}",
                    streams.cols, u.cols
                ),
            });
        }
        let (rows, s) = (streams.rows, streams.cols / h);
        self.gpu
            .hc_gated_residual(&mut streams.buf, &u.buf, &y.buf, rows, s, h)
    }

    /// The gated residual ([`sanmai_model::Backend::hc_residual`]) in the two fused kernels of
    /// `kernels/hc.cu` (no `u` tensor: only `s` `[rows, rank]` is allocated), when they take the step:
    /// at most [`HC_MAX_ROWS`] rows (decode), `down` and `up` packed INT8 with one scale per row,
    /// `inject` bf16, H and rank multiples of 32. Returns `false`, having done nothing, otherwise (the
    /// caller then runs the op sequence, whose GEMMs serve prefill). With `premix = (pre, xn)` (the
    /// next sublayer's pre-mix logits, f32, and its `[rows, H]` output), the second kernel also
    /// pre-mixes the new streams into `xn`.
    pub(crate) fn hc_residual_fused(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
        premix: Option<(&CudaSlice<f32>, &mut CudaTensor)>,
    ) -> Result<bool> {
        let (Some(down), Some(up), CudaWeight::Bf16(inject)) =
            (w.down.packed(), w.up.packed(), &w.inject)
        else {
            return Ok(false);
        };
        let (rows, h, rank) = (y.rows, y.cols, down.out_features());
        if !(1..=HC_MAX_ROWS).contains(&rows)
            || !hc_fused_shape(h, rank)
            || !int8_per_row(down)
            || !int8_per_row(up)
        {
            return Ok(false);
        }
        let fits = down.in_features() == h
            && inject.shape == [rank, h]
            && up.in_features() == rank
            && up.out_features() == streams.cols
            && streams.cols.is_multiple_of(h)
            && (x.rows, x.cols, streams.rows) == (rows, h, rows);
        if !fits {
            return Err(CudaError::Shape {
                op: "hc_residual",
                msg: format!(
                    "streams [{}, {}], x [{}, {}], y [{rows}, {h}] against down {:?}, inject {:?}, up {:?}",
                    streams.rows, streams.cols, x.rows, x.cols, down.shape, inject.shape, up.shape
                ),
            });
        }
        let mut s = self.alloc(rows, rank)?;
        self.gpu.hc_down_inject_silu(
            &down.mat(),
            &inject.data,
            &x.buf,
            &y.buf,
            &mut s.buf,
            rows,
        )?;
        let premix = premix.map(|(pre, xn)| (pre, &mut xn.buf));
        self.gpu.hc_up_gate_mix(
            &up.mat(),
            (&s.buf, &y.buf),
            &mut streams.buf,
            premix,
            rows,
            h,
        )?;
        Ok(true)
    }

    /// [`Backend::hc_residual_premix_norm`](sanmai_model::Backend::hc_residual_premix_norm) with the
    /// next sublayer's pre-mix in the gated residual's second kernel ([`hc_residual_fused`](Self::hc_residual_fused)),
    /// then the norm: the pre-mixed input and its norm, or `None`, having done nothing, where the
    /// fused kernels do not take the step or `next.pre` is not an f32 vector of one logit a stream.
    pub fn hc_residual_premixed(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
        next: &HcNext<'_, CudaWeight>,
    ) -> Result<Option<(CudaTensor, CudaTensor)>> {
        let Some(pre) = next.pre.f32() else {
            return Ok(None);
        };
        let h = y.cols;
        if h == 0 || y.rows > HC_MAX_ROWS || next.pre.cols() * h != streams.cols {
            return Ok(None);
        }
        let mut xn = self.alloc(y.rows, h)?;
        if !self.hc_residual_fused(streams, (x, y), w, Some((pre, &mut xn)))? {
            return Ok(None);
        }
        let hn = self.rms_norm_impl(&xn, next.norm, next.eps, next.offset)?;
        Ok(Some((xn, hn)))
    }
}

/// Whether a packed weight is INT8 with one scale per output row (the fused gated residual's format).
fn int8_per_row(w: &PackedWeight) -> bool {
    w.bits == 8 && (w.group_size == 0 || w.group_size == w.in_features())
}
