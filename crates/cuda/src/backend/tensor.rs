//! The backend's activation and weight types: device bf16 tensors, and weights in bf16, in packed
//! integer form (compressed-tensors INT4/INT8, INT6 gapless; see `ops::quant`) or as block-scaled FP8
//! bytes (see `ops::fp8`).

use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{Fp8Mat, PackedMat, PackedScheme};

/// Activations `[rows, cols]`, row-major bf16 on the device (from the stream-ordered allocator).
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    pub(crate) buf: CudaSlice<bf16>,
}

impl CudaTensor {
    /// The device buffer (`rows·cols` values, possibly one more when the tensor is empty).
    pub fn buf(&self) -> &CudaSlice<bf16> {
        &self.buf
    }

    pub(crate) fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// A bf16 weight on the device with its shape (`[out, in]` for matrices). Vectors (1-D weights: norms,
/// `A_log`, `dt_bias`) also keep an f32 copy for the kernels that read f32 parameters.
pub struct DenseBf16 {
    pub shape: Vec<usize>,
    pub(crate) data: CudaSlice<bf16>,
    pub(crate) f32: Option<CudaSlice<f32>>,
}

/// A quantized `[out, in]` matrix kept packed on the device: `out · words_per_row(bits, in)` u32
/// words and `out · scale_cols(group_size, in)` f32 scales, exactly as `PackedTensor` holds them. No
/// dequantised copy is kept; `linear` decodes it in the GEMV or tile by tile in the GEMM.
pub struct PackedWeight {
    /// `[out, in]`.
    pub shape: Vec<usize>,
    /// 4, 6 (gapless) or 8.
    pub bits: u32,
    /// Inputs per scale; 0 = one scale per row.
    pub group_size: usize,
    pub(crate) words: CudaSlice<u32>,
    pub(crate) scales: CudaSlice<f32>,
}

impl PackedWeight {
    pub fn out_features(&self) -> usize {
        self.shape[0]
    }

    pub fn in_features(&self) -> usize {
        self.shape[1]
    }

    /// The scheme as the packed kernels take it.
    pub(crate) fn scheme(&self) -> PackedScheme {
        PackedScheme {
            bits: self.bits,
            group_size: self.group_size,
        }
    }

    /// The weight as the packed kernels read it.
    pub(crate) fn mat(&self) -> PackedMat<'_, CudaSlice<u32>, CudaSlice<f32>> {
        PackedMat {
            words: &self.words,
            scales: &self.scales,
            scheme: self.scheme(),
            n: self.out_features(),
            k: self.in_features(),
        }
    }
}

/// A block-scaled FP8 `[out, in]` matrix kept as its bytes on the device: `out · in` float8_e4m3fn
/// bytes and `out · ceil(in / group)` f32 scales (the checkpoint's block scales repeated per row), as
/// `sanmai_weights::fp8::packed` lays them out. No dequantised copy is kept: `linear` reads one byte a
/// weight in the GEMV and dequantises tile by tile in the GEMM.
pub struct Fp8Weight {
    /// `[out, in]`.
    pub shape: Vec<usize>,
    /// Inputs per scale (the block's columns).
    pub group: usize,
    pub(crate) bytes: CudaSlice<u8>,
    pub(crate) scales: CudaSlice<f32>,
    /// The 128×128 block scales in cuBLASLt's layout, for the FP8 tensor-core prefill GEMM: on a
    /// Hopper, for a weight of 128×128 blocks (`ops::lt_block_scales`); a few KB, not counted in
    /// [`CudaWeight::bytes`] (the plan made without a GPU counts the same bytes).
    pub(crate) blk: Option<CudaSlice<f32>>,
}

impl Fp8Weight {
    pub fn out_features(&self) -> usize {
        self.shape[0]
    }

    pub fn in_features(&self) -> usize {
        self.shape[1]
    }

    /// The weight as the FP8 kernels read it.
    pub(crate) fn mat(&self) -> Fp8Mat<'_, CudaSlice<u8>, CudaSlice<f32>> {
        Fp8Mat {
            bytes: &self.bytes,
            scales: &self.scales,
            group: self.group,
            n: self.out_features(),
            k: self.in_features(),
        }
    }
}

/// A weight in the backend's storage. `linear` dispatches on the variant.
pub enum CudaWeight {
    Bf16(DenseBf16),
    Packed(PackedWeight),
    Fp8(Fp8Weight),
}

impl CudaWeight {
    pub fn shape(&self) -> &[usize] {
        match self {
            CudaWeight::Bf16(w) => &w.shape,
            CudaWeight::Packed(w) => &w.shape,
            CudaWeight::Fp8(w) => &w.shape,
        }
    }

    /// Columns of a matrix (its input width); the length of a vector.
    pub fn cols(&self) -> usize {
        *self.shape().last().unwrap_or(&1)
    }

    /// Rows of a matrix (its output width); 1 for a vector.
    pub fn rows(&self) -> usize {
        self.shape().iter().product::<usize>() / self.cols().max(1)
    }

    /// Device bytes this weight occupies.
    pub fn bytes(&self) -> usize {
        match self {
            CudaWeight::Bf16(w) => 2 * w.data.len() + 4 * w.f32.as_ref().map_or(0, |f| f.len()),
            CudaWeight::Packed(w) => 4 * (w.words.len() + w.scales.len()),
            CudaWeight::Fp8(w) => w.bytes.len() + 4 * w.scales.len(),
        }
    }

    /// The dense bf16 values. Only matrices are loaded packed, never the vectors and tables the ops
    /// that call this read (norms, convs, the embedding), so a packed weight here breaks the
    /// loader's contract: a shape error naming the weight's shape.
    pub(crate) fn bf16(&self) -> Result<&CudaSlice<bf16>> {
        match self {
            CudaWeight::Bf16(w) => Ok(&w.data),
            CudaWeight::Packed(w) => Err(CudaError::Shape {
                op: "weight",
                msg: format!(
                    "a packed INT{} {:?} weight where dense bf16 values are needed",
                    w.bits, w.shape
                ),
            }),
            CudaWeight::Fp8(w) => Err(CudaError::Shape {
                op: "weight",
                msg: format!(
                    "an FP8 {:?} weight where dense bf16 values are needed",
                    w.shape
                ),
            }),
        }
    }

    /// The packed form, if this weight is packed.
    pub(crate) fn packed(&self) -> Option<&PackedWeight> {
        match self {
            CudaWeight::Packed(w) => Some(w),
            CudaWeight::Bf16(_) | CudaWeight::Fp8(_) => None,
        }
    }

    /// The FP8 form, if this weight is FP8.
    pub(crate) fn fp8(&self) -> Option<&Fp8Weight> {
        match self {
            CudaWeight::Fp8(w) => Some(w),
            CudaWeight::Bf16(_) | CudaWeight::Packed(_) => None,
        }
    }

    /// The f32 copy of a vector weight.
    pub(crate) fn f32(&self) -> Option<&CudaSlice<f32>> {
        match self {
            CudaWeight::Bf16(w) => w.f32.as_ref(),
            CudaWeight::Packed(_) | CudaWeight::Fp8(_) => None,
        }
    }

    /// The device address of the bf16 values, of the packed words or of the FP8 bytes (for the expert
    /// pointer tables).
    pub(crate) fn address(&self, gpu: &Gpu) -> u64 {
        match self {
            CudaWeight::Bf16(w) => w.data.device_ptr(gpu.stream()).0,
            CudaWeight::Packed(w) => w.words.device_ptr(gpu.stream()).0,
            CudaWeight::Fp8(w) => w.bytes.device_ptr(gpu.stream()).0,
        }
    }

    /// The device address of the packed or FP8 scales (0 for a bf16 weight).
    pub(crate) fn scales_address(&self, gpu: &Gpu) -> u64 {
        match self {
            CudaWeight::Bf16(_) => 0,
            CudaWeight::Packed(w) => w.scales.device_ptr(gpu.stream()).0,
            CudaWeight::Fp8(w) => w.scales.device_ptr(gpu.stream()).0,
        }
    }
}
