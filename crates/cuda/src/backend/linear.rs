//! `x · wᵀ` on the device: bf16 weights through the decode GEMV (up to [`GEMV_MAX_M`] rows) or
//! cuBLAS, packed weights through `packed.rs`, FP8 weights through `fp8.rs`, and several projections of one input sharing decode
//! GEMV launches ([`CudaBackend::linear_many_impl`]).

use cudarc::driver::CudaSlice;

use super::{CudaBackend, CudaTensor, CudaWeight, DenseBf16, Fp8Weight, PackedWeight};
use crate::error::{CudaError, Result};
use crate::ops::{GEMV_MAX_M, GEMV_SEGS};

impl CudaBackend {
    pub(super) fn linear_impl(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor> {
        let (m, n, k) = (x.rows, w.rows(), w.cols());
        if x.cols != k {
            return Err(CudaError::Shape {
                op: "linear",
                msg: format!("input width {} does not match the weight's {k}", x.cols),
            });
        }
        let mut y = self.alloc(m, n)?;
        match w {
            CudaWeight::Bf16(d) => {
                if (1..=GEMV_MAX_M).contains(&m) && k.is_multiple_of(8) {
                    self.gpu.gemv_bf16(&d.data, &x.buf, &mut y.buf, m, n, k)?;
                } else {
                    self.gpu.gemm_bf16(&x.buf, &d.data, &mut y.buf, m, n, k)?;
                }
            }
            CudaWeight::Packed(p) => self.linear_packed(x, p, &mut y.buf)?,
            CudaWeight::Fp8(f) => self.linear_fp8(x, f, &mut y.buf)?,
        }
        Ok(y)
    }

    /// `x · wᵀ` for each of `ws`, in the order of `ws`: the weights that take the decode GEMV share
    /// launches by kind ([`GemvKind`]), up to [`GEMV_SEGS`] a launch; the rest run one
    /// [`CudaBackend::linear_impl`] each. Every result is the one its own `linear` gives.
    pub(super) fn linear_many_impl(
        &self,
        x: &CudaTensor,
        ws: &[&CudaWeight],
    ) -> Result<Vec<CudaTensor>> {
        let mut out: Vec<Option<CudaTensor>> = Vec::with_capacity(ws.len());
        let mut groups: Vec<(GemvKind, Vec<usize>)> = Vec::new();
        for (i, w) in ws.iter().enumerate() {
            let Some(kind) = GemvKind::of(x, w) else {
                out.push(Some(self.linear_impl(x, w)?));
                continue;
            };
            out.push(None);
            match groups
                .iter_mut()
                .find(|(k, g)| *k == kind && g.len() < GEMV_SEGS)
            {
                Some((_, g)) => g.push(i),
                None => groups.push((kind, vec![i])),
            }
        }
        for (kind, idx) in &groups {
            let group: Vec<&CudaWeight> = idx.iter().map(|&i| ws[i]).collect();
            let ys = self.linear_gemv_group(x, *kind, &group)?;
            for (&i, y) in idx.iter().zip(ys) {
                out[i] = Some(y);
            }
        }
        // Every slot is filled: by its own linear or by its group's launch.
        Ok(out.into_iter().flatten().collect())
    }

    /// One decode GEMV launch for `ws`: weights of `kind` that `x` (1..=8 rows) multiplies, at most
    /// [`GEMV_SEGS`] of them.
    fn linear_gemv_group(
        &self,
        x: &CudaTensor,
        kind: GemvKind,
        ws: &[&CudaWeight],
    ) -> Result<Vec<CudaTensor>> {
        let m = x.rows;
        let mut ys = ws
            .iter()
            .map(|w| self.alloc(m, w.rows()))
            .collect::<Result<Vec<_>>>()?;
        match kind {
            GemvKind::Bf16 => {
                let dense: Vec<&DenseBf16> = ws
                    .iter()
                    .filter_map(|w| match w {
                        CudaWeight::Bf16(d) => Some(d),
                        CudaWeight::Packed(_) | CudaWeight::Fp8(_) => None,
                    })
                    .collect();
                ensure_one_kind(dense.len(), ws.len())?;
                let mut parts: Vec<_> = dense
                    .iter()
                    .zip(ys.iter_mut())
                    .map(|(d, y)| (&d.data, &mut y.buf, y.cols))
                    .collect();
                self.gpu.gemv_bf16_many(&x.buf, &mut parts, m, x.cols)?;
            }
            GemvKind::Packed { .. } => {
                let packed: Vec<&PackedWeight> = ws.iter().filter_map(|w| w.packed()).collect();
                ensure_one_kind(packed.len(), ws.len())?;
                self.linear_packed_many(x, &packed, &mut ys)?;
            }
            GemvKind::Fp8 { .. } => {
                let fp8: Vec<&Fp8Weight> = ws.iter().filter_map(|w| w.fp8()).collect();
                ensure_one_kind(fp8.len(), ws.len())?;
                self.linear_fp8_many(x, &fp8, &mut ys)?;
            }
        }
        Ok(ys)
    }

    /// `x · wᵀ` with an f32 result (router logits).
    pub(crate) fn linear_f32(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaSlice<f32>> {
        let (m, n, k) = (x.rows, w.rows(), w.cols());
        if x.cols != k {
            return Err(CudaError::Shape {
                op: "linear",
                msg: format!("input width {} does not match the weight's {k}", x.cols),
            });
        }
        let mut y = self.scratch::<f32>(m * n)?;
        match w {
            CudaWeight::Bf16(d) => {
                if (1..=GEMV_MAX_M).contains(&m) && k.is_multiple_of(8) {
                    self.gpu.gemv_bf16_f32(&d.data, &x.buf, &mut y, m, n, k)?;
                } else {
                    self.gpu.gemm_bf16_f32(&x.buf, &d.data, &mut y, m, n, k)?;
                }
            }
            CudaWeight::Packed(p) => self.linear_packed_f32(x, p, &mut y)?,
            CudaWeight::Fp8(f) => self.linear_fp8_f32(x, f, &mut y)?,
        }
        Ok(y)
    }
}

/// Weights whose decode GEMVs can share a launch ([`CudaBackend::linear_many_impl`]): bf16, packed
/// of one format, or FP8 of one block size. With one input (so one `k` and `m`) that fixes the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemvKind {
    Bf16,
    Packed { bits: u32, group_size: usize },
    Fp8 { group: usize },
}

impl GemvKind {
    /// The kind of `x · wᵀ` when it runs on the decode GEMV (`x` of 1..=8 rows and `w`'s width; bf16
    /// needs `k % 8 == 0`), else `None`.
    fn of(x: &CudaTensor, w: &CudaWeight) -> Option<Self> {
        if !(1..=GEMV_MAX_M).contains(&x.rows) || x.cols != w.cols() {
            return None;
        }
        match w {
            CudaWeight::Bf16(_) => x.cols.is_multiple_of(8).then_some(Self::Bf16),
            CudaWeight::Packed(p) => Some(Self::Packed {
                bits: p.bits,
                group_size: p.group_size,
            }),
            CudaWeight::Fp8(f) => Some(Self::Fp8 { group: f.group }),
        }
    }
}

/// Errors unless all `total` weights of a GEMV launch are of its kind (`matched` of them are).
fn ensure_one_kind(matched: usize, total: usize) -> Result<()> {
    if matched == total {
        Ok(())
    } else {
        Err(CudaError::Shape {
            op: "linear",
            msg: "weights of different formats in one GEMV launch".into(),
        })
    }
}
