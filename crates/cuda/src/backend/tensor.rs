//! The backend's activation and weight types: device bf16 tensors and weights.

use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;

use crate::gpu::Gpu;

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

/// A weight in the backend's storage. `linear` dispatches on the variant; packed integer formats are
/// further variants.
pub enum CudaWeight {
    Bf16(DenseBf16),
}

impl CudaWeight {
    pub fn shape(&self) -> &[usize] {
        match self {
            CudaWeight::Bf16(w) => &w.shape,
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
        }
    }

    /// The dense bf16 values (every variant today).
    pub(crate) fn bf16(&self) -> &CudaSlice<bf16> {
        match self {
            CudaWeight::Bf16(w) => &w.data,
        }
    }

    /// The f32 copy of a vector weight.
    pub(crate) fn f32(&self) -> Option<&CudaSlice<f32>> {
        match self {
            CudaWeight::Bf16(w) => w.f32.as_ref(),
        }
    }

    /// The device address of the bf16 values (for the expert pointer tables).
    pub(crate) fn address(&self, gpu: &Gpu) -> u64 {
        self.bf16().device_ptr(gpu.stream()).0
    }
}
