//! The hyper-connections' ops ([`Backend::hc_premix`](sanmai_model::Backend::hc_premix),
//! [`Backend::hc_gated_residual`](sanmai_model::Backend::hc_gated_residual)) on the `[rows, S·H]`
//! residual streams; the gated residual of a sublayer is the trait's plain-op default.

use sanmai_model::backend::OpResult;

use super::{ensure, CpuBackend, CpuTensor, CpuWeight};
use crate::ops;

impl CpuBackend {
    pub(super) fn hc_premix_impl(
        &self,
        streams: &CpuTensor,
        pre: &CpuWeight,
    ) -> OpResult<CpuTensor> {
        let ns = pre.data.len();
        ensure(
            ns > 0 && streams.cols.is_multiple_of(ns),
            "hc_premix",
            || {
                format!(
                    "streams {} wide for {ns} pre-mix logits: must be [rows, S*H]",
                    streams.cols
                )
            },
        )?;
        let h = streams.cols / ns;
        let wts = ops::hc_weights(&pre.data);
        let mut out = CpuTensor::zeros(streams.rows, h);
        if h == 0 {
            return Ok(out);
        }
        for (o, r) in out
            .data
            .chunks_exact_mut(h)
            .zip(streams.data.chunks_exact(streams.cols))
        {
            for (c, wc) in wts.iter().enumerate() {
                o.iter_mut()
                    .zip(&r[c * h..(c + 1) * h])
                    .for_each(|(o, x)| *o += wc * x);
            }
        }
        Ok(out)
    }

    pub(super) fn hc_gated_residual_impl(
        &self,
        streams: &mut CpuTensor,
        u: &CpuTensor,
        y: &CpuTensor,
    ) -> OpResult<()> {
        let (sc, h) = (streams.cols, y.cols);
        ensure(
            u.cols == sc
                && h > 0
                && sc.is_multiple_of(h)
                && u.rows == streams.rows
                && y.rows == streams.rows,
            "hc_gated_residual",
            || {
                format!(
                    "streams [{}, {sc}], u [{}, {}], y [{}, {h}]: streams and u must be \
                     [rows, S*H], y [rows, H]",
                    streams.rows, u.rows, u.cols, y.rows
                )
            },
        )?;
        for ((r, ur), yr) in streams
            .data
            .chunks_exact_mut(sc)
            .zip(u.data.chunks_exact(sc))
            .zip(y.data.chunks_exact(h))
        {
            for (rc, uc) in r.chunks_exact_mut(h).zip(ur.chunks_exact(h)) {
                for ((x, g), y) in rc.iter_mut().zip(uc).zip(yr) {
                    *x += ops::sigmoid(*g) * y;
                }
            }
        }
        Ok(())
    }
}
