//! Hyper-connections on the device (spec §4): the pre-mix (and head collapse) and the gated residual
//! over the `[rows, S·H]` residual streams, the whole gated residual of a decode-sized sublayer in
//! two fused kernels (`ops::hc`), and for one row the gated residual with the next sublayer's
//! pre-mix and norm in one launch ([`Gpu::hc_step`](crate::Gpu::hc_step)); other steps run the
//! trait's op sequences ([`hc_residual_ops`](sanmai_model::backend::hc_residual_ops)).

use std::sync::atomic::Ordering;

use sanmai_model::backend::{HcNext, HcWeights};

use super::tensor::{CudaTensor, CudaWeight, PackedWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::ops::hc::{hc_fused_shape, HC_MAX_ROWS};
use crate::ops::{HcNextNorm, HcStepRows, HcStepWeights};

impl CudaBackend {
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
    /// caller then runs the op sequence, whose GEMMs serve prefill).
    pub(crate) fn hc_residual_fused(
        &self,
        streams: &mut CudaTensor,
        x: &CudaTensor,
        y: &CudaTensor,
        w: &HcWeights<CudaWeight>,
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
        self.gpu
            .hc_up_gate_mix(&up.mat(), &s.buf, &y.buf, &mut streams.buf, rows, h)?;
        Ok(true)
    }
}

impl CudaBackend {
    /// [`Backend::hc_residual_premix_norm`](sanmai_model::Backend::hc_residual_premix_norm) of one
    /// decoding row in one launch ([`Gpu::hc_step`](crate::Gpu::hc_step); with the fused decode
    /// launches on): `down` and `up` packed INT8 with one scale a row, `inject` bf16, the pre-mix
    /// logits f32 and the norm weight bf16, shapes the kernel takes. `None`, having done nothing,
    /// otherwise (the caller then runs the three ops).
    pub fn hc_step_fused(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
        next: &HcNext<'_, CudaWeight>,
    ) -> Result<Option<(CudaTensor, CudaTensor)>> {
        let (Some(down), Some(up), CudaWeight::Bf16(inject), Some(pre), CudaWeight::Bf16(norm)) = (
            w.down.packed(),
            w.up.packed(),
            &w.inject,
            next.pre.f32(),
            next.norm,
        ) else {
            return Ok(None);
        };
        let (h, rank) = (y.cols, down.out_features());
        let ns = next.pre.cols();
        let takes = self.switches.fused_decode.load(Ordering::Relaxed)
            && (x.rows, y.rows, streams.rows) == (1, 1, 1)
            && int8_per_row(down)
            && int8_per_row(up)
            && self.gpu.hc_step_fits(ns, h, rank)
            && down.in_features() == h
            && inject.shape == [rank, h]
            && up.shape == [ns * h, rank]
            && (x.cols, streams.cols, norm.shape.as_slice()) == (h, ns * h, &[h][..]);
        if !takes {
            return Ok(None);
        }
        let mut xn = self.alloc(1, h)?;
        let mut hn = self.alloc(1, h)?;
        let mut s = self.scratch(rank)?;
        let mut sync = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
        let weights = HcStepWeights {
            down: down.mat(),
            inject: &inject.data,
            up: up.mat(),
        };
        let norm = HcNextNorm {
            pre,
            w: &norm.data,
            eps: next.eps,
            offset: next.offset,
        };
        let rows = HcStepRows {
            x: &x.buf,
            y: &y.buf,
            streams: &mut streams.buf,
            xn: &mut xn.buf,
            hn: &mut hn.buf,
            s: &mut s,
            sync: &mut sync,
            trace: None,
        };
        self.gpu.hc_step(&weights, &norm, rows)?;
        Ok(Some((xn, hn)))
    }
}

/// Whether a packed weight is INT8 with one scale per output row (the fused gated residual's format).
fn int8_per_row(w: &PackedWeight) -> bool {
    w.bits == 8 && (w.group_size == 0 || w.group_size == w.in_features())
}
