//! The qwen4_exp extension ops of the trait on the device: tensors from the host, SiLU and the
//! hyper-connections' pre-mix and gated residual (two fused kernels for decode, `ops::hc`) here; QSA
//! attention (`qsa.rs`, over the fp8 index-key pool next to the K/V) and the PLE mix (`ple.rs`, its
//! conv state in the state slots).

use half::bf16;

use sanmai_model::backend::HcWeights;

use super::tensor::{CudaTensor, CudaWeight, PackedWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::ops::hc::{hc_fused_shape, HC_MAX_ROWS};

impl CudaBackend {
    /// A `[rows, cols]` tensor from host values (rounded to bf16).
    pub fn tensor_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaTensor> {
        if data.len() != rows * cols {
            return Err(CudaError::Shape {
                op: "from_host",
                msg: format!("{} values for [{rows}, {cols}]", data.len()),
            });
        }
        let b: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
        let buf = if b.is_empty() {
            self.gpu.zeros(1)?
        } else {
            self.gpu.upload(&b)?
        };
        Ok(CudaTensor { rows, cols, buf })
    }

    pub(crate) fn silu_impl(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let mut y = self.alloc(x.rows, x.cols)?;
        self.gpu.silu(&x.buf, &mut y.buf, x.len())?;
        Ok(y)
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
            &down.words,
            &down.scales,
            &inject.data,
            &x.buf,
            &y.buf,
            &mut s.buf,
            rows,
            h,
            rank,
        )?;
        self.gpu.hc_up_gate_mix(
            &up.words,
            &up.scales,
            &s.buf,
            &y.buf,
            &mut streams.buf,
            rows,
            streams.cols / h,
            h,
            rank,
        )?;
        Ok(true)
    }
}

/// Whether a packed weight is INT8 with one scale per output row (the fused gated residual's format).
fn int8_per_row(w: &PackedWeight) -> bool {
    w.bits == 8 && (w.group_size == 0 || w.group_size == w.in_features())
}

/// The extension methods of the `Backend` impl (expanded inside it in `mod.rs`).
macro_rules! ext_methods {
    () => {
        fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> CudaTensor {
            ok("upload", self.tensor_from_host(rows, cols, &data))
        }

        fn silu(&self, x: &CudaTensor) -> CudaTensor {
            ok("silu", self.silu_impl(x))
        }

        fn hc_premix(&self, streams: &CudaTensor, pre: &CudaWeight) -> CudaTensor {
            ok("hc_premix", self.hc_premix_impl(streams, pre))
        }

        fn hc_gated_residual(&self, streams: &mut CudaTensor, u: &CudaTensor, y: &CudaTensor) {
            ok(
                "hc_gated_residual",
                self.hc_gated_residual_impl(streams, u, y),
            )
        }

        fn hc_residual(
            &self,
            streams: &mut CudaTensor,
            x: &CudaTensor,
            y: &CudaTensor,
            w: &sanmai_model::backend::HcWeights<CudaWeight>,
        ) {
            if !ok("hc_residual", self.hc_residual_fused(streams, x, y, w)) {
                sanmai_model::backend::hc_residual_ops(self, streams, x, y, w);
            }
        }

        fn qsa_attention(
            &self,
            layer: usize,
            shape: &AttnShape,
            rope: &Rope,
            qsa: &sanmai_model::backend::QsaShape,
            q_gate: &CudaTensor,
            k: &CudaTensor,
            v: &CudaTensor,
            w: &AttnWeights<CudaWeight>,
            iq: &CudaTensor,
            ik: &CudaTensor,
            iw: &CudaTensor,
            iw_: &sanmai_model::backend::IndexerWeights<CudaWeight>,
            seqs: &[SeqChunk<'_>],
        ) -> CudaTensor {
            ok(
                "qsa_attention",
                self.qsa_impl(
                    layer, shape, rope, qsa, q_gate, k, v, w, iq, ik, iw, iw_, seqs,
                ),
            )
        }

        fn ple_mix(
            &self,
            layer: usize,
            shape: &sanmai_model::backend::PleShape,
            streams: &mut CudaTensor,
            rows: &CudaTensor,
            w: &sanmai_model::backend::PleWeights<CudaWeight>,
            seqs: &[SeqChunk<'_>],
        ) {
            ok(
                "ple_mix",
                self.ple_impl(layer, shape, streams, rows, w, seqs),
            )
        }
    };
}
pub(crate) use ext_methods;
