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
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view: yᵀ [n, m] = W [k, n]ᵀ · xᵀ [k, m].
        // SAFETY: the handle is bound to this stream; pointers cover the checked lengths; alpha and beta
        // are host f32 values as the default pointer mode and the 32F compute type expect.
        unsafe {
            blas::gemm_ex(
                *self.blas().handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                ki,
                xp as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                ki,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                y_type,
                ni,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}
