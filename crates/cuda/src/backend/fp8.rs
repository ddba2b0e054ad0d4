//! Block-scaled FP8 weights in the backend: uploaded as their bytes and per-row block scales
//! ([`CudaWeight::Fp8`], no dequantised copy), multiplied by the FP8 GEMV for up to 8 rows (one byte a
//! weight) and beyond by the FP8 tensor-core GEMM (Hopper, 128×128 blocks: the activations quantised
//! per token group, `ops::fp8_lt`) or else the tiled dequantise + cuBLAS GEMM, through the packed
//! formats' persistent bf16 workspace (allocated with the first packed or FP8 weight). Routed FP8
//! experts take the grouped FP8 GEMV (`backend/moe.rs`).
//!
//! The FP8 tensor cores are off unless [`GpuOptions::fp8_tensor_cores`](crate::GpuOptions) turns
//! them on (on an H100 the bf16 tiles prefilled faster, `docs/gpu/fp8-2026-12-05.md`). When on, the
//! tensor-core GEMM is checked once, at its first product outside a graph capture, against the
//! bf16 tiles on the same input: within [`LT_CHECK_RMS`] it serves every later product (a shape
//! cuBLASLt refuses takes the tiles, said once); otherwise (a cuBLASLt that reads the scales
//! otherwise, an error) the bf16 tiles do, with a warning. The
//! routed experts' grouped GEMM of a prefill step takes the FP8 tensor cores the same way
//! (`mma.sync` e4m3 on sm_89 and later, the pairs' input rows quantised per row and 128 columns;
//! checked on its first gate|up product).
//!
//! A matrix whose shape the FP8 kernels do not take ([`fp8_fits`]: `k` or the block's columns not a
//! multiple of 16) is dequantised on the host and kept as bf16 instead.

use std::sync::atomic::Ordering;

use cudarc::driver::CudaSlice;
use half::bf16;
use sanmai_model::backend::{PackedTensor, PackedWords};

use super::tensor::{CudaTensor, CudaWeight, Fp8Weight};
use super::CudaBackend;
use crate::error::{ensure, CudaError, Result};
use crate::ops::{
    fp8_fits, lt_block_scales, Fp8Experts, Fp8Lt, LtCheck, MoeOut, PairGroups, PairRows, LT_BLOCK,
};
use sanmai_weights::quant::PACKED_WORKSPACE_BYTES;

/// Rows the FP8 GEMV takes per launch.
const GEMV_ROWS: usize = 8;

/// The largest relative RMS difference between the FP8 tensor-core GEMM (activations in e4m3, about
/// 2–3% apart from bf16 on their own) and the bf16 tiles at which the first check passes; a misread
/// scale layout is several times larger.
pub const LT_CHECK_RMS: f64 = 0.1;

/// Device bytes `p` (an FP8 tensor, `p.fp8`) occupies when the backend keeps it as FP8 (one byte a
/// weight plus the f32 scales), or `None` when it would be dequantised to bf16 instead.
pub fn fp8_device_bytes(p: &PackedTensor<'_>) -> Option<usize> {
    (p.fp8 && fp8_fits(p.group_size, p.in_features))
        .then(|| p.out_features * p.in_features + 4 * p.scales.len())
}

impl CudaBackend {
    /// Uploads an FP8 tensor (`p.fp8`): its code bytes row by row (padding of rows to whole words
    /// dropped) and its per-row scales.
    pub(crate) fn fp8_weight_impl(&self, p: &PackedTensor<'_>) -> Result<CudaWeight> {
        let (n, k) = (p.out_features, p.in_features);
        if !fp8_fits(p.group_size, k) || n == 0 {
            return self.weight_impl(p.dequantize(), &[n, k]);
        }
        // k % 16 == 0, so rows hold no padding and the words' bytes are the codes in order.
        let raw: &[u8] = match &p.packed {
            PackedWords::Bytes(b) => b,
            // SAFETY: the bytes of an initialised [u32] (any bit pattern is a valid u8, u8 has
            // alignment 1), in memory order: on a little-endian host the words' codes in order.
            PackedWords::Owned(w) => unsafe {
                std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), 4 * w.len())
            },
        };
        ensure(
            cfg!(target_endian = "little") && raw.len() >= n * k,
            "fp8_weight",
            || format!("{} FP8 bytes for [{n}, {k}]", raw.len()),
        )?;
        let bytes = self.gpu.upload(&raw[..n * k])?;
        let scales = self.gpu.upload(&p.scales)?;
        let blk = match self.gpu.info().compute_capability.0 {
            9 => lt_block_scales(&p.scales, n, k, p.group_size)
                .map(|b| self.gpu.upload(&b))
                .transpose()?,
            _ => None,
        };
        {
            let mut st = self.lock();
            if st.packed_ws.is_none() {
                st.packed_ws = Some(self.gpu.zeros::<bf16>(PACKED_WORKSPACE_BYTES / 2)?);
            }
        }
        let w = CudaWeight::Fp8(Fp8Weight {
            shape: vec![n, k],
            group: p.group_size,
            bytes,
            scales,
            blk,
        });
        self.weight_bytes.fetch_add(w.bytes(), Ordering::Relaxed);
        self.epoch.fetch_add(1, Ordering::Relaxed);
        Ok(w)
    }

    /// `y = x · wᵀ` into `y` (`[m, n]` bf16): the FP8 GEMV up to 8 rows, the tiled GEMM beyond.
    pub(crate) fn linear_fp8(
        &self,
        x: &CudaTensor,
        w: &Fp8Weight,
        y: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let m = x.rows;
        let g = &self.gpu;
        if (1..=GEMV_ROWS).contains(&m) {
            return g.gemv_fp8(&w.mat(), &x.buf, y, m);
        }
        if let (Some(blk), Some(lt)) = (&w.blk, g.fp8_lt()) {
            let tc = TcWeight { w, blk, lt };
            match lt.check.get() {
                LtCheck::Passed => match self.gemm_fp8_tc(x, &tc, y) {
                    Ok(()) => return Ok(()),
                    // A shape cuBLASLt takes no algorithm for: this product on the tiles.
                    Err(e) => {
                        if !lt.refused.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                "FP8 prefill GEMM [{}, {}] × [{}, {}]ᵀ on the bf16 tiles (and any \
                                 other shape cuBLASLt refuses): {e}",
                                m,
                                x.cols,
                                w.out_features(),
                                w.in_features()
                            );
                        }
                    }
                },
                LtCheck::Unchecked => {
                    // Not under a graph capture (the check reads both products back).
                    if let Ok(_free) = self.capture.try_lock() {
                        return self.check_fp8_tc(x, &tc, y);
                    }
                }
                LtCheck::Failed => {}
            }
        }
        self.gemm_fp8_tiles(x, w, y)
    }

    /// `y = x · wᵀ` by the tiled dequantise + cuBLAS GEMM.
    fn gemm_fp8_tiles(&self, x: &CudaTensor, w: &Fp8Weight, y: &mut CudaSlice<bf16>) -> Result<()> {
        let mut st = self.lock();
        let ws = st.packed_ws.as_mut().ok_or_else(|| CudaError::Shape {
            op: "linear",
            msg: "FP8 weight without the packed workspace".into(),
        })?;
        self.gpu.gemm_fp8(&x.buf, &w.mat(), y, ws, x.rows)
    }

    /// `y = x · wᵀ` on the FP8 tensor cores: x quantised per token group into step-local buffers,
    /// then cuBLASLt.
    fn gemm_fp8_tc(
        &self,
        x: &CudaTensor,
        tc: &TcWeight<'_>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (m, k) = (x.rows, tc.w.in_features());
        let s = self.gpu.stream();
        // SAFETY: quant_f8_tokens writes every element of both before the GEMM reads them.
        let (mut xq, mut xs) = unsafe {
            (
                s.alloc::<u8>((m * k).max(1))?,
                s.alloc::<f32>((m * k / LT_BLOCK).max(1))?,
            )
        };
        self.gpu.quant_f8_tokens(&x.buf, &mut xq, &mut xs, m, k)?;
        let mat = tc.w.mat();
        self.gpu.gemm_fp8_lt(tc.lt, &xq, &xs, &mat, tc.blk, y, m)
    }

    /// The first tensor-core product: computed both ways, compared, the verdict kept in `lt`; `y`
    /// gets the bf16 tiles' product.
    fn check_fp8_tc(
        &self,
        x: &CudaTensor,
        tc: &TcWeight<'_>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let (w, lt) = (tc.w, tc.lt);
        self.gemm_fp8_tiles(x, w, y)?;
        // SAFETY: gemm_fp8_tc writes every element.
        let mut out = unsafe { self.gpu.stream().alloc::<bf16>(y.len()) }?;
        let verdict = match self.gemm_fp8_tc(x, tc, &mut out) {
            Ok(()) => {
                let what = format!(
                    "FP8 prefill GEMMs (the first product: [{}, {}] × [{}, {}]ᵀ)",
                    x.rows,
                    x.cols,
                    w.out_features(),
                    w.in_features()
                );
                verdict(
                    &what,
                    rel_rms(&self.gpu.download(&out)?, &self.gpu.download(&*y)?),
                )
            }
            Err(e) => {
                tracing::warn!("FP8 prefill GEMMs dequantise to bf16 tiles: {e}");
                LtCheck::Failed
            }
        };
        lt.check.set(verdict);
        Ok(())
    }

    /// The routed FP8 experts' gate|up grouped GEMM of a prefill step: on the FP8 tensor cores
    /// ([`Gpu::moe_gemm_fp8_mma`](crate::Gpu::moe_gemm_fp8_mma)) once their first product, outside a
    /// graph capture, is within [`LT_CHECK_RMS`] of the bf16 tiles' ([`Gpu::moe_gemm_fp8`](crate::Gpu::moe_gemm_fp8)),
    /// which serve otherwise (and that first time).
    pub(crate) fn moe_gemm_fp8_gate_up(
        &self,
        experts: &Fp8Experts<'_, CudaSlice<u64>>,
        input: &PairRows<'_, CudaSlice<bf16>>,
        groups: &PairGroups<'_, CudaSlice<u32>>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let g = &self.gpu;
        if !g.moe_gemm_fp8_mma_supports(experts.group, experts.k) {
            return g.moe_gemm_fp8(experts, input, groups, y);
        }
        match g.fp8_mma_check.get() {
            LtCheck::Passed => return self.moe_gemm_fp8_quantised(experts, input, groups, y),
            LtCheck::Failed => return g.moe_gemm_fp8(experts, input, groups, y),
            LtCheck::Unchecked => {}
        }
        g.moe_gemm_fp8(experts, input, groups, y)?;
        // Not under a graph capture (the check reads both products back).
        let Ok(_free) = self.capture.try_lock() else {
            return Ok(());
        };
        let mut out = self.scratch::<bf16>(y.len())?;
        let verdict = match self.moe_gemm_fp8_quantised(experts, input, groups, &mut out) {
            Ok(()) => {
                let what = format!(
                    "FP8 expert prefill GEMMs (the first gate|up product: {} pairs)",
                    groups.n_pairs
                );
                verdict(&what, rel_rms(&g.download(&out)?, &g.download(&*y)?))
            }
            Err(e) => {
                tracing::warn!("FP8 expert prefill GEMMs decode to bf16 tiles: {e}");
                LtCheck::Failed
            }
        };
        g.fp8_mma_check.set(verdict);
        Ok(())
    }

    /// The routed FP8 experts' down grouped GEMM of a prefill step (f32 out): on the FP8 tensor cores
    /// once the gate|up check passed, the bf16 tiles otherwise.
    pub(crate) fn moe_gemm_fp8_down(
        &self,
        experts: &Fp8Experts<'_, CudaSlice<u64>>,
        input: &PairRows<'_, CudaSlice<bf16>>,
        groups: &PairGroups<'_, CudaSlice<u32>>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let g = &self.gpu;
        if g.moe_gemm_fp8_mma_supports(experts.group, experts.k)
            && g.fp8_mma_check.get() == LtCheck::Passed
        {
            return self.moe_gemm_fp8_quantised(experts, input, groups, y);
        }
        g.moe_gemm_fp8(experts, input, groups, y)
    }

    /// The pairs' input rows quantised per row and 128 columns into step-local buffers, then the FP8
    /// tensor-core grouped GEMM.
    fn moe_gemm_fp8_quantised<O: MoeOut>(
        &self,
        experts: &Fp8Experts<'_, CudaSlice<u64>>,
        input: &PairRows<'_, CudaSlice<bf16>>,
        groups: &PairGroups<'_, CudaSlice<u32>>,
        y: &mut CudaSlice<O>,
    ) -> Result<()> {
        let (rows, k) = (input.rows, experts.k);
        let mut xq = self.scratch::<u8>(rows * k)?;
        let mut xs = self.scratch::<f32>(rows * k / LT_BLOCK)?;
        self.gpu
            .quant_f8_tokens(input.x, &mut xq, &mut xs, rows, k)?;
        let q = PairRows {
            x: &xq,
            rows,
            div: input.div,
            tail: input.tail,
        };
        self.gpu.moe_gemm_fp8_mma(experts, (&q, &xs), groups, y)
    }

    /// `ys[i] = x · ws[i]ᵀ` in one FP8 GEMV launch: FP8 weights of one group, at most `GEMV_SEGS`,
    /// `x` of 1..=8 rows, `ys[i]` `[m, n_i]`.
    pub(crate) fn linear_fp8_many(
        &self,
        x: &CudaTensor,
        ws: &[&Fp8Weight],
        ys: &mut [CudaTensor],
    ) -> Result<()> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        let group = first.group;
        ensure(ws.iter().all(|w| w.group == group), "linear", || {
            "FP8 weights of different block sizes in one GEMV launch".into()
        })?;
        let mut parts: Vec<_> = ws
            .iter()
            .zip(ys.iter_mut())
            .map(|(w, y)| (&w.bytes, &w.scales, &mut y.buf, y.cols))
            .collect();
        self.gpu
            .gemv_fp8_many(group, &x.buf, &mut parts, x.rows, x.cols)
    }

    /// `y = x · wᵀ` with an f32 result (`[m, n]`): the FP8 GEMV over chunks of 8 rows, so every output
    /// is one f32 accumulation with no bf16 rounding.
    pub(crate) fn linear_fp8_f32(
        &self,
        x: &CudaTensor,
        w: &Fp8Weight,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (m, n, k) = (x.rows, w.out_features(), w.in_features());
        let mat = w.mat();
        let mut r0 = 0;
        while r0 < m {
            let rows = GEMV_ROWS.min(m - r0);
            let xs = x.buf.slice(r0 * k..(r0 + rows) * k);
            let mut ys = y.slice_mut(r0 * n..(r0 + rows) * n);
            self.gpu.gemv_fp8_f32(&mat, &xs, &mut ys, rows)?;
            r0 += rows;
        }
        Ok(())
    }
}

/// An FP8 weight on the tensor-core path: its cuBLASLt block scales and the library.
struct TcWeight<'a> {
    w: &'a Fp8Weight,
    blk: &'a CudaSlice<f32>,
    lt: &'a Fp8Lt,
}

/// The first-use check's verdict on a tensor-core product `rms` (relative RMS) from the bf16 tiles'
/// product, said in the log with `what` it was.
fn verdict(what: &str, rms: f64) -> LtCheck {
    if rms <= LT_CHECK_RMS {
        tracing::info!(
            "{what} on the FP8 tensor cores: {:.2}% RMS from the bf16 tiles",
            100.0 * rms
        );
        LtCheck::Passed
    } else {
        tracing::warn!(
            "{what} on the bf16 tiles: the tensor-core product is {:.1}% RMS from them (above {:.0}%)",
            100.0 * rms,
            100.0 * LT_CHECK_RMS
        );
        LtCheck::Failed
    }
}

/// `‖a − b‖ / ‖b‖` over bf16 values (0 for an all-zero `b` equal to `a`).
fn rel_rms(a: &[bf16], b: &[bf16]) -> f64 {
    let (mut d, mut r) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x.to_f32()), f64::from(y.to_f32()));
        d += (x - y) * (x - y);
        r += y * y;
    }
    if d == 0.0 {
        0.0
    } else if r == 0.0 {
        f64::INFINITY
    } else {
        (d / r).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_rms_of_bf16_rows() {
        let b: Vec<bf16> = [3.0f32, 4.0].map(bf16::from_f32).to_vec();
        let a: Vec<bf16> = [3.0f32, 4.5].map(bf16::from_f32).to_vec();
        assert_eq!(rel_rms(&b, &b), 0.0);
        assert!((rel_rms(&a, &b) - 0.1).abs() < 1e-12);
        assert_eq!(rel_rms(&a, &[bf16::ZERO; 2]), f64::INFINITY);
    }

    #[test]
    fn device_bytes_are_one_a_weight_plus_scales() {
        let p = PackedTensor {
            name: "w".into(),
            bits: 8,
            group_size: 128,
            out_features: 3,
            in_features: 160,
            packed: PackedWords::Owned(vec![0; 3 * 40]),
            scales: vec![1.0; 3 * 2],
            fp8: true,
        };
        assert_eq!(fp8_device_bytes(&p), Some(3 * 160 + 4 * 6));
        let odd = PackedTensor {
            in_features: 40,
            packed: PackedWords::Owned(vec![0; 3 * 10]),
            scales: vec![1.0; 3],
            ..p.clone()
        };
        assert_eq!(fp8_device_bytes(&odd), None);
        let int8 = PackedTensor { fp8: false, ..p };
        assert_eq!(fp8_device_bytes(&int8), None);
    }
}
