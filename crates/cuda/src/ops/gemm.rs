//! Prefill GEMM through cuBLAS: `y = x · Wᵀ` in bf16 with f32 accumulation (`cublasGemmEx`).

use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::error::Result;
use crate::gpu::{check_len, int, Gpu};

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
        self.gemm_ex(
            "gemm_bf16",
            x,
            w,
            y,
            sys::cudaDataType::CUDA_R_16BF,
            m,
            n,
            k,
        )
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
        self.gemm_ex(
            "gemm_bf16_f32",
            x,
            w,
            y,
            sys::cudaDataType::CUDA_R_32F,
            m,
            n,
            k,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm_ex<O>(
        &self,
        op: &'static str,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<O>,
        y_type: sys::cudaDataType,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
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
        // SAFETY: W holds n·k, x m·k and y m·n elements (checked above), on this stream.
        unsafe { self.blas_w_xt(ni, mi, ki, wp, xp, yp, y_type, ni) }
    }

    /// `y = x · Wᵀ` through cuBLAS (bf16 inputs, f32 accumulation): W `[rows, k]` and x `[m, k]`
    /// row-major bf16, y row-major `[m, ·]` of `y_type` with `ldy` elements between rows (its first
    /// `rows` columns written). In cuBLAS's column-major view: yᵀ `[rows, m]` = W `[k, rows]`ᵀ · xᵀ
    /// `[k, m]`.
    ///
    /// # Safety
    /// The device pointers must hold those extents and be used on this `Gpu`'s stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn blas_w_xt(
        &self,
        rows: i32,
        m: i32,
        k: i32,
        w: u64,
        x: u64,
        y: u64,
        y_type: sys::cudaDataType,
        ldy: i32,
    ) -> Result<()> {
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
