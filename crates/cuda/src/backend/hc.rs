//! Hyper-connections on the device (spec §4): the pre-mix (and head collapse) and the gated residual
//! over the `[rows, S·H]` residual streams, and the whole gated residual of a decode-sized sublayer in
//! one launch (`ops::hc`), which can also pre-mix the streams for the next sublayer and norm them;
//! other steps run the trait's op sequences
//! ([`hc_residual_ops`](sanmai_model::backend::hc_residual_ops)).

use sanmai_model::backend::{
    hc_residual_ops, hc_residual_premix_norm_ops, HcNext, HcWeights, OpResult,
};

use super::tensor::{CudaTensor, CudaWeight, PackedWeight};
use super::CudaBackend;
use crate::error::{At, CudaError, Result};
use crate::ops::hc::{hc_fused_shape, HcFusedWeights, HcPremixNorm, HcRows, HC_MAX_ROWS};

impl CudaBackend {
    /// [`Backend::hc_residual`](sanmai_model::Backend::hc_residual): the fused launch where it
    /// takes the step, else the op sequence.
    pub(super) fn hc_residual_impl(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
    ) -> OpResult<()> {
        if self
            .hc_residual_fused(streams, (x, y), w, None)
            .at("hc_residual")?
            .is_some()
        {
            return Ok(());
        }
        hc_residual_ops(self, streams, x, y, w)
    }

    /// [`Backend::hc_residual_premix_norm`](sanmai_model::Backend::hc_residual_premix_norm): the
    /// pre-mix and norm in the fused launch where it takes the step, else the three calls.
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

    /// [`Backend::hc_residual_premix_norm`](sanmai_model::Backend::hc_residual_premix_norm) in the
    /// fused launch: the pre-mixed input and its norm, or `None`, having done nothing, where the
    /// launch does not take the step.
    pub fn hc_residual_premixed(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
        next: &HcNext<'_, CudaWeight>,
    ) -> Result<Option<(CudaTensor, CudaTensor)>> {
        Ok(self
            .hc_residual_fused(streams, (x, y), w, Some(next))?
            .flatten())
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

    /// The gated residual ([`sanmai_model::Backend::hc_residual`]) in the one launch of
    /// `kernels/hc.cu` (no `u` tensor: only `s` `[rows, rank]` is allocated), with the next
    /// sublayer's pre-mix and norm when `next` is given, where it takes the step: at most
    /// [`HC_MAX_ROWS`] rows (decode), `down` and `up` packed INT8 with one scale per row, `inject`
    /// bf16, H and rank multiples of 32; with `next`, its logits an f32 vector of one a stream and
    /// its norm a bf16 vector the norm kernels' vector form takes. Returns `None`, having done
    /// nothing, otherwise (the caller then runs the op sequence, whose GEMMs serve prefill); else
    /// the pre-mixed rows and their norm when `next` was given.
    fn hc_residual_fused(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
        next: Option<&HcNext<'_, CudaWeight>>,
    ) -> Result<Option<Option<(CudaTensor, CudaTensor)>>> {
        let (Some(down), Some(up), CudaWeight::Bf16(inject)) =
            (w.down.packed(), w.up.packed(), &w.inject)
        else {
            return Ok(None);
        };
        let (rows, h, rank) = (y.rows, y.cols, down.out_features());
        if !(1..=HC_MAX_ROWS).contains(&rows)
            || !hc_fused_shape(h, rank)
            || !int8_per_row(down)
            || !int8_per_row(up)
        {
            return Ok(None);
        }
        let norm = match next {
            None => None,
            Some(nx) => match (nx.pre.f32(), nx.norm) {
                (Some(pre), CudaWeight::Bf16(nw))
                    if nx.pre.cols() * h == streams.cols
                        && nw.shape == [h]
                        && self.gpu.hc_norm_fits(h, &nw.data) =>
                {
                    Some((pre, &nw.data, nx.eps, nx.offset))
                }
                _ => return Ok(None),
            },
        };
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
        let weights = HcFusedWeights {
            down: down.mat(),
            inject: &inject.data,
            up: up.mat(),
        };
        let mut s = self.alloc(rows, rank)?;
        let mut out = match norm {
            Some(_) => Some((self.alloc(rows, h)?, self.alloc(rows, h)?)),
            None => None,
        };
        let next = match (norm, out.as_mut()) {
            (Some((pre, w, eps, offset)), Some((xn, hn))) => Some(HcPremixNorm {
                pre,
                w,
                eps,
                offset,
                xn: &mut xn.buf,
                hn: &mut hn.buf,
            }),
            _ => None,
        };
        let mut sync = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
        let hc_rows = HcRows {
            rows,
            x: &x.buf,
            y: &y.buf,
            streams: &mut streams.buf,
            s: &mut s.buf,
            sync: &mut sync,
        };
        self.gpu.hc_residual(&weights, next, hc_rows)?;
        Ok(Some(out))
    }
}

/// Whether a packed weight is INT8 with one scale per output row (the fused gated residual's format).
fn int8_per_row(w: &PackedWeight) -> bool {
    w.bits == 8 && (w.group_size == 0 || w.group_size == w.in_features())
}
