//! Prefill GEMM through cuBLAS: `y = x · Wᵀ` in bf16 with f32 accumulation (`cublasGemmEx`).

use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::error::Result;
use crate::gpu::{check_len, int, Gpu};

/// The shape of `y[m, n] = x[m, k] · W[n, k]ᵀ`.
#[derive(Debug, Clone, Copy)]
struct GemmDims {
    m: usize,
    n: usize,
    k: usize,
}

/// One cuBLAS product `y = x · Wᵀ` ([`Gpu::blas_w_xt`]): W `[rows, k]` and x `[m, k]` row-major bf16
/// at device addresses `w` and `x`, y row-major `[m, ·]` of `y_type` at `y` with `ldy` elements
/// between rows (its first `rows` columns written).
pub(crate) struct WxT {
    pub rows: i32,
    pub m: i32,
    pub k: i32,
    pub w: u64,
    pub x: u64,
    pub y: u64,
    pub y_type: sys::cudaDataType,
    pub ldy: i32,
}

impl Gpu {
    /// `y[m, n] = x[m, k] · W[n, k]ᵀ` (PyTorch `Linear` layout), bf16 in and out, f32 accumulation.
    pub fn gemm_bf16(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let dims = GemmDims { m, n, k };
        self.gemm_ex("gemm_bf16", x, w, y, sys::cudaDataType::CUDA_R_16BF, dims)
    }

    /// As [`Gpu::gemm_bf16`] with an f32 output (router logits).
    pub fn gemm_bf16_f32(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let dims = GemmDims { m, n, k };
        self.gemm_ex(
            "gemm_bf16_f32",
            x,
            w,
            y,
            sys::cudaDataType::CUDA_R_32F,
            dims,
        )
    }

    fn gemm_ex<O>(
        &self,
        op: &'static str,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<O>,
        y_type: sys::cudaDataType,
        dims: GemmDims,
    ) -> Result<()> {
        let GemmDims { m, n, k } = dims;
        check_len(op, "x", x, m * k)?;
        check_len(op, "W", w, n * k)?;
        check_len(op, "y", y, m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ni, ki) = (int(op, "m", m)?, int(op, "n", n)?, int(op, "k", k)?);
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (wp, _gw) = w.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let p = WxT {
            rows: ni,
            m: mi,
            k: ki,
            w: wp,
            x: xp,
            y: yp,
            y_type,
            ldy: ni,
        };
        // SAFETY: W holds n·k, x m·k and y m·n elements (checked above), on this stream.
        unsafe { self.blas_w_xt(p) }
    }

    /// `y = x · Wᵀ` through cuBLAS (bf16 inputs, f32 accumulation), as `p` describes it. In
    /// cuBLAS's column-major view: yᵀ `[rows, m]` = W `[k, rows]`ᵀ · xᵀ `[k, m]`.
    ///
    /// # Safety
    /// The device pointers must hold those extents and be used on this `Gpu`'s stream.
    pub(crate) unsafe fn blas_w_xt(&self, p: WxT) -> Result<()> {
        let WxT {
            rows,
            m,
            k,
            w,
            x,
            y,
            y_type,
            ldy,
        } = p;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the handle is bound to this stream; the caller vouches for the extents; alpha and
        // beta are host f32 values as the default pointer mode and the 32F compute type expect.
        unsafe {
            blas::gemm_ex(
                *self.blas().handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                rows,
                m,
                k,
                (&alpha) as *const f32 as *const _,
                w as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k,
                x as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k,
                (&beta) as *const f32 as *const _,
                y as *mut _,
                y_type,
                ldy,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}
