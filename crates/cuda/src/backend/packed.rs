//! Packed integer weights in the backend (compressed-tensors INT4/INT8, INT6 gapless): uploaded as
//! their words and scales ([`CudaWeight::Packed`], no dequantised copy), multiplied by the packed
//! GEMV for up to 8 rows and by the tiled dequantise + cuBLAS GEMM beyond, through one persistent
//! bf16 workspace of [`PACKED_WORKSPACE_BYTES`] allocated with the first packed weight (counted in
//! `memory().workspace`).
//!
//! A packed embedding table stays packed too: [`CudaBackend::embed_packed`] decodes the rows of the
//! step's ids (`kernels/embed_packed.cu`), and a tied lm_head multiplies by it like any packed matrix.
//!
//! A matrix whose shape the packed kernels do not take (`k` not a multiple of 32 for INT4/INT8 or of
//! 8 for INT6, a group size not a multiple of 8) is dequantised on the host and kept as bf16 instead.

use std::sync::atomic::Ordering;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use sanmai_model::backend::PackedTensor;

use super::tensor::{CudaTensor, CudaWeight, PackedWeight};
use super::CudaBackend;
use crate::error::{ensure, CudaError, Result};
use crate::gpu::{cfg, check_len, grid_u32, int};
use crate::ops::RowAddNorm;

/// Bytes of the bf16 workspace the prefill GEMM dequantises weight tiles into.
pub use sanmai_weights::quant::PACKED_WORKSPACE_BYTES;

/// Rows the packed GEMV takes per launch.
const GEMV_ROWS: usize = 8;

/// Whether the packed kernels take a `[_, k]` matrix of `bits` with `group_size` (0 = per row);
/// the rule lives with the packed format so a plan made without a GPU counts the same bytes.
pub use sanmai_weights::quant::packed_fits;

/// Device bytes `p` occupies when the backend keeps it packed (words and f32 scales), or `None`
/// when it would be dequantised to bf16 instead (see [`packed_fits`]).
pub fn packed_device_bytes(p: &PackedTensor<'_>) -> Option<usize> {
    packed_fits(p.bits, p.group_size, p.in_features)
        .then(|| 4 * (p.out_features * p.words_per_row() + p.scales.len()))
}

impl CudaBackend {
    pub(crate) fn packed_weight_impl(&self, p: &PackedTensor<'_>) -> Result<CudaWeight> {
        if p.fp8 {
            return self.fp8_weight_impl(p);
        }
        let shape = [p.out_features, p.in_features];
        if !packed_fits(p.bits, p.group_size, p.in_features) || p.out_features == 0 {
            return self.weight_impl(p.dequantize(), &shape);
        }
        let words = self.gpu.upload(&p.words())?;
        let scales = self.gpu.upload(&p.scales)?;
        {
            let mut st = self.lock();
            if st.packed_ws.is_none() {
                st.packed_ws = Some(self.gpu.zeros::<bf16>(PACKED_WORKSPACE_BYTES / 2)?);
            }
        }
        let w = CudaWeight::Packed(PackedWeight {
            shape: shape.to_vec(),
            bits: p.bits,
            group_size: p.group_size,
            words,
            scales,
        });
        self.weight_bytes.fetch_add(w.bytes(), Ordering::Relaxed);
        self.epoch.fetch_add(1, Ordering::Relaxed);
        Ok(w)
    }

    /// `y = x · dequant(w)ᵀ` into `y` (`[m, n]` bf16).
    pub(crate) fn linear_packed(
        &self,
        x: &CudaTensor,
        w: &PackedWeight,
        y: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let m = x.rows;
        let g = &self.gpu;
        if (1..=GEMV_ROWS).contains(&m) {
            return g.gemv_packed(&w.mat(), &x.buf, y, m);
        }
        let mut st = self.lock();
        let ws = st.packed_ws.as_mut().ok_or_else(|| CudaError::Shape {
            op: "linear",
            msg: "packed weight without the packed workspace".into(),
        })?;
        g.gemm_packed(&x.buf, &w.mat(), y, ws, m)
    }

    /// [`Backend::linear_add_rms_norm`](sanmai_model::Backend::linear_add_rms_norm): at one row with
    /// fused decode launches on, a packed `w` that
    /// [`Gpu::gemv_packed_norm_fits`](crate::Gpu::gemv_packed_norm_fits) takes its GEMV
    /// with the add and the norm in the same launch
    /// ([`Gpu::gemv_packed_add_rms_norm`](crate::Gpu::gemv_packed_add_rms_norm): the same values);
    /// otherwise [`CudaBackend::linear_impl`] then [`CudaBackend::add_rms_norm_impl`].
    pub(crate) fn linear_add_rms_norm_impl(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        let n = w.rows();
        let fused = self.switches.fused_decode.load(Ordering::Relaxed)
            && x.rows == 1
            && x.cols == w.cols()
            && (acc.rows, acc.cols) == (1, n);
        match (w, norm) {
            (CudaWeight::Packed(p), CudaWeight::Bf16(nw))
                if fused && self.gpu.gemv_packed_norm_fits(p.scheme(), n, x.cols) =>
            {
                // The GEMV's own output row is scratch here: the add and the norm read it.
                let mut y = self.scratch::<bf16>(n)?;
                let mut normed = self.alloc(1, n)?;
                let mut ticket = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
                let then = RowAddNorm {
                    acc: &mut acc.buf,
                    w: &nw.data,
                    normed: &mut normed.buf,
                    eps,
                    offset,
                    ticket: &mut ticket,
                };
                self.gpu
                    .gemv_packed_add_rms_norm(&p.mat(), &x.buf, &mut y, then)?;
                Ok(normed)
            }
            _ => {
                let y = self.linear_impl(x, w)?;
                self.add_rms_norm_impl(acc, &y, norm, eps, offset)
            }
        }
    }

    /// [`Backend::swiglu_linear`](sanmai_model::Backend::swiglu_linear): at one row with fused
    /// decode launches on, a packed `w` takes the GEMV that stages the SwiGLU
    /// ([`Gpu::gemv_packed_swiglu`](crate::Gpu::gemv_packed_swiglu): the same values, one launch
    /// less); otherwise [`CudaBackend::swiglu_impl`] then [`CudaBackend::linear_impl`].
    pub(crate) fn swiglu_linear_impl(
        &self,
        gate_up: &CudaTensor,
        w: &CudaWeight,
    ) -> Result<CudaTensor> {
        let staged = self.switches.fused_decode.load(Ordering::Relaxed)
            && gate_up.rows == 1
            && gate_up.cols == 2 * w.cols();
        match w {
            CudaWeight::Packed(p) if staged => {
                let mut y = self.alloc(1, w.rows())?;
                self.gpu
                    .gemv_packed_swiglu(&p.mat(), &gate_up.buf, &mut y.buf)?;
                Ok(y)
            }
            _ => self.linear_impl(&self.swiglu_impl(gate_up)?, w),
        }
    }

    /// `ys[i] = x · dequant(ws[i])ᵀ` in one packed GEMV launch: weights of one format (bits and
    /// group size), at most `GEMV_SEGS`, `x` of 1..=8 rows, `ys[i]` `[m, n_i]`.
    pub(crate) fn linear_packed_many(
        &self,
        x: &CudaTensor,
        ws: &[&PackedWeight],
        ys: &mut [CudaTensor],
    ) -> Result<()> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        let scheme = first.scheme();
        ensure(ws.iter().all(|w| w.scheme() == scheme), "linear", || {
            "packed weights of different formats in one GEMV launch".into()
        })?;
        let mut parts: Vec<_> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| (&w.words, &w.scales, &mut y.buf, y.cols))
            .collect();
        self.gpu
            .gemv_packed_many(scheme, &x.buf, &mut parts, x.rows, x.cols)
    }

    /// `out[s, :] = bf16(dequant(w)[ids[s], :])` for `t` ids (device `u32`), zeros for an id outside
    /// the table: the embedding lookup on a packed table.
    pub(crate) fn embed_packed(
        &self,
        w: &PackedWeight,
        ids: &impl DevicePtr<u32>,
        out: &mut CudaSlice<bf16>,
        t: usize,
    ) -> Result<()> {
        const OP: &str = "embed_packed";
        let (vocab, k) = (w.out_features(), w.in_features());
        ensure(packed_fits(w.bits, w.group_size, k), OP, || {
            format!(
                "INT{} table of width {k} outside the packed kernels' shapes",
                w.bits
            )
        })?;
        check_len(OP, "ids", ids, t)?;
        check_len(OP, "out", out, t * k)?;
        if t == 0 {
            return Ok(());
        }
        let group = if w.group_size == 0 { k } else { w.group_size };
        let v = u32::try_from(vocab).unwrap_or(u32::MAX);
        let (ki, gi) = (int(OP, "k", k)?, int(OP, "group", group)?);
        let threads = (k.div_ceil(32).div_ceil(32).clamp(1, 8) * 32) as u32;
        let g = &self.gpu;
        let s = g.stream();
        let (wp, _gw) = w.words.device_ptr(s);
        let (sp, _gs) = w.scales.device_ptr(s);
        let (ip, _gi) = ids.device_ptr(s);
        let (op, _go) = out.device_ptr_mut(s);
        ensure(wp % 16 == 0 && op % 16 == 0, OP, || {
            "table and out must be 16-byte aligned".into()
        })?;
        let mut b = g.launch(g.kernel(&format!("embed_q{}", w.bits))?);
        b.arg(&wp)
            .arg(&sp)
            .arg(&ip)
            .arg(&op)
            .arg(&v)
            .arg(&ki)
            .arg(&gi);
        // SAFETY: argument types match the kernel; the words and scales are the weight's own
        // (vocab rows of its shape), ids and out lengths checked above; rows are read only for ids
        // below vocab.
        unsafe { b.launch(cfg((grid_u32(OP, t)?, 1, 1), threads, 0)) }?;
        Ok(())
    }

    /// `y = x · dequant(w)ᵀ` with an f32 result (`[m, n]`): the packed GEMV over chunks of 8 rows, so
    /// every output is one f32 accumulation with no bf16 rounding.
    pub(crate) fn linear_packed_f32(
        &self,
        x: &CudaTensor,
        w: &PackedWeight,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (m, n, k) = (x.rows, w.out_features(), w.in_features());
        let mat = w.mat();
        let mut r0 = 0;
        while r0 < m {
            let rows = GEMV_ROWS.min(m - r0);
            let xs = x.buf.slice(r0 * k..(r0 + rows) * k);
            let mut ys = y.slice_mut(r0 * n..(r0 + rows) * n);
            self.gpu.gemv_packed_f32(&mat, &xs, &mut ys, rows)?;
            r0 += rows;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sanmai_model::backend::PackedWords;

    #[test]
    fn fits_follows_the_kernel_shape_rules() {
        assert!(packed_fits(4, 128, 2048));
        assert!(packed_fits(8, 0, 512));
        assert!(packed_fits(6, 0, 48));
        assert!(!packed_fits(4, 0, 48));
        assert!(!packed_fits(8, 12, 64));
        assert!(!packed_fits(5, 0, 64));
        assert!(!packed_fits(6, 0, 0));
    }

    #[test]
    fn device_bytes_are_words_plus_scales() {
        let p = PackedTensor {
            name: "w".into(),
            bits: 4,
            group_size: 128,
            out_features: 3,
            in_features: 256,
            packed: PackedWords::Owned(vec![0; 3 * 32]),
            scales: vec![1.0; 3 * 2],
            fp8: false,
        };
        assert_eq!(packed_device_bytes(&p), Some(4 * (96 + 6)));
        assert_eq!(packed_device_bytes(&p), Some(p.nbytes()));
        let odd = PackedTensor {
            in_features: 40,
            packed: PackedWords::Owned(vec![0; 3 * 5]),
            scales: vec![1.0; 3],
            group_size: 0,
            ..p
        };
        assert_eq!(packed_device_bytes(&odd), None);
    }
}
