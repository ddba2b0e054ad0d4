//! Prefill GEMMs of block-scaled FP8 weights on the FP8 tensor cores (Hopper, cuBLASLt 12.9 or later),
//! the format's dynamic scheme: the activations are quantised per token and 128-column group
//! ([`Gpu::quant_f8_tokens`], `kernels/fp8.cu`: `s = max|x| / 448`, `q = e4m3(x / s)`), the weight keeps
//! its bytes and its 128×128 block scales, and cuBLASLt multiplies the e4m3 operands with both scales
//! applied in f32 (`VEC128_32F` scales for the activations, `BLK128x128_32F` for the weight).
//!
//! In cuBLAS's column-major terms `yᵀ (n × m) = W (n × k) · xᵀ (k × m)`: A is W read transposed (row
//! major `[n, k]` is column-major `k × n`), B the quantised x (`k × m`), D y (`n × m`, ld n). The scale
//! layouts are those cuBLASLt takes for this pair: x's `[k / 128][m]` (tokens contiguous), W's
//! `[ceil(n / 128)][kp]` with `kp` the k-blocks rounded up to 4 (k-blocks contiguous, see
//! [`lt_block_scales`]).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::fp8::Fp8Mat;
use crate::device::guarded;
use crate::error::{ensure, CudaError, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Columns (and rows) of a scale block of the tensor-core path.
pub const LT_BLOCK: usize = 128;
/// The cuBLASLt version the block-scaled FP8 modes need.
const LT_MIN_VERSION: usize = 120_900;
/// cuBLASLt's workspace on Hopper (its recommendation).
const LT_WORKSPACE: usize = 32 << 20;

/// Whether a tensor-core GEMM (cuBLASLt's, or the routed experts' FP8 MMA) has been checked against the
/// bf16 tiles (`backend/fp8.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LtCheck {
    Unchecked,
    Passed,
    Failed,
}

/// The check's verdict, shared by the backend's calls.
#[derive(Debug, Default)]
pub struct LtVerdict(AtomicU8);

impl LtVerdict {
    pub fn get(&self) -> LtCheck {
        match self.0.load(Ordering::Relaxed) {
            1 => LtCheck::Passed,
            2 => LtCheck::Failed,
            _ => LtCheck::Unchecked,
        }
    }

    pub fn set(&self, v: LtCheck) {
        let code = match v {
            LtCheck::Unchecked => 0,
            LtCheck::Passed => 1,
            LtCheck::Failed => 2,
        };
        self.0.store(code, Ordering::Relaxed);
    }
}

/// A cuBLASLt handle and its workspace on a [`Gpu`]'s stream, whether its product was checked, and
/// whether it has refused a shape yet (said once in the log).
pub struct Fp8Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    pub check: LtVerdict,
    pub refused: AtomicBool,
}

// SAFETY: the handle is used on the Gpu's one stream, under the backend's calls that own the step.
unsafe impl Send for Fp8Lt {}
unsafe impl Sync for Fp8Lt {}

impl Drop for Fp8Lt {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `create_handle` and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Fp8Lt {
    /// Opens cuBLASLt on `stream` when the device is a Hopper (sm_90) and the library is 12.9 or
    /// later; `Err` says why not.
    pub fn open(
        stream: &Arc<CudaStream>,
        compute: (u32, u32),
    ) -> std::result::Result<Self, String> {
        if compute.0 != 9 {
            return Err(format!(
                "sm_{}{}: the block-scaled FP8 GEMM of cuBLASLt runs on sm_90",
                compute.0, compute.1
            ));
        }
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { sys::cublasLtGetVersion() };
        if version < LT_MIN_VERSION {
            return Err(format!(
                "cuBLASLt {version} (block-scaled FP8 needs 120900)"
            ));
        }
        let handle = lt::create_handle().map_err(|e| format!("cuBLASLt: {e}"))?;
        // SAFETY: the workspace is only handed to cuBLASLt, which writes it before reading.
        let workspace = unsafe { stream.alloc::<u8>(LT_WORKSPACE) }
            .map_err(|e| format!("cuBLASLt workspace: {e}"))?;
        Ok(Self {
            handle,
            workspace,
            check: LtVerdict(AtomicU8::new(0)),
            refused: AtomicBool::new(false),
        })
    }
}

/// The 128×128 block scales of an FP8 weight `[n, k]` as cuBLASLt reads them (`[ceil(n / 128)][kp]`,
/// `kp = round_up(ceil(k / 128), 4)`, the padding 1.0), from its per-row scales (`[n][ceil(k / group)]`,
/// what the backend keeps); `None` unless the group is 128 and the rows of every 128-row block share
/// their scales (a checkpoint of `weight_block_size: [128, 128]`).
pub fn lt_block_scales(row_scales: &[f32], n: usize, k: usize, group: usize) -> Option<Vec<f32>> {
    let kb = k.div_ceil(LT_BLOCK);
    if group != LT_BLOCK || n == 0 || row_scales.len() != n * kb {
        return None;
    }
    let kp = kb.next_multiple_of(4);
    let mut out = vec![1.0f32; n.div_ceil(LT_BLOCK) * kp];
    for (nb, block) in row_scales.chunks(LT_BLOCK * kb).enumerate() {
        let first = &block[..kb];
        if block.chunks(kb).any(|row| row != first) {
            return None;
        }
        out[nb * kp..nb * kp + kb].copy_from_slice(first);
    }
    Some(out)
}

/// Sets one attribute of a matmul descriptor.
///
/// # Safety
/// `desc` is a live descriptor and `T` the attribute's type.
unsafe fn set_attr<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    // SAFETY: the caller vouches for the descriptor and the attribute's type.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (value as *const T).cast::<c_void>(),
            std::mem::size_of::<T>(),
        )
    }
    .map_err(lt_err)
}

fn lt_err(e: lt::CublasError) -> CudaError {
    CudaError::BlasLt(e.to_string())
}

/// The descriptors of one product, destroyed when dropped.
struct Descs {
    op: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: sys::cublasLtMatmulPreference_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: every handle was created once by the functions of `lt` and is destroyed once.
        unsafe {
            if !self.pref.is_null() {
                let _ = lt::destroy_matmul_pref(self.pref);
            }
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
            let _ = lt::destroy_matmul_desc(self.op);
        }
    }
}

impl Gpu {
    /// The FP8 tensor-core GEMM's cuBLASLt, opened at the first call; `None` (said once in the log)
    /// where it does not run: not a Hopper, cuBLASLt older than 12.9 or missing.
    pub fn fp8_lt(&self) -> Option<&Fp8Lt> {
        self.fp8_lt
            .get_or_init(|| {
                if !self.fp8_tc {
                    tracing::info!(
                        "FP8 prefill GEMMs dequantise to bf16 tiles: FP8 tensor cores off"
                    );
                    return None;
                }
                // A missing libcublasLt panics inside cudarc's loader: an error here.
                let compute = self.info().compute_capability;
                guarded("cuBLASLt", || {
                    Fp8Lt::open(self.stream(), compute).map_err(CudaError::BlasLt)
                })
                .inspect_err(|why| {
                    tracing::info!("FP8 prefill GEMMs dequantise to bf16 tiles: {why}")
                })
                .ok()
            })
            .as_ref()
    }

    /// Quantises `x` (`[m, k]` bf16, `k` a multiple of 128) per token and 128-column group into `q`
    /// (`[m, k]` e4m3 bytes) and `s` (`[k / 128][m]` f32), as the FP8 tensor-core GEMM reads them.
    pub fn quant_f8_tokens(
        &self,
        x: &impl DevicePtr<bf16>,
        q: &mut impl DevicePtrMut<u8>,
        s: &mut impl DevicePtrMut<f32>,
        m: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "quant_f8_tokens";
        ensure(k.is_multiple_of(LT_BLOCK), OP, || {
            format!("k = {k} is not a multiple of {LT_BLOCK}")
        })?;
        check_len(OP, "x", x, m * k)?;
        check_len(OP, "q", q, m * k)?;
        check_len(OP, "s", s, m * (k / LT_BLOCK))?;
        if m == 0 || k == 0 {
            return Ok(());
        }
        ensure(
            self.addr(x).is_multiple_of(8) && self.addr_mut(q).is_multiple_of(4),
            OP,
            || "x must be 8-byte and q 4-byte aligned".into(),
        )?;
        let grid = (grid_u32(OP, k / LT_BLOCK)?, grid_u32(OP, m)?, 1);
        let (mi, ki) = (int(OP, "m", m)?, int(OP, "k", k)?);
        let mut b = self.launch(self.kernel("quant_f8_tokens")?);
        b.ptr(x).ptr_mut(q).ptr_mut(s).arg(&mi).arg(&ki);
        // SAFETY: argument types match the kernel; lengths and alignment checked above, one warp
        // per (row, group) inside [m, k].
        unsafe { b.launch(cfg(grid, 32, 0)) }
    }

    /// `y[m, n] = x · Wᵀ` on the FP8 tensor cores: `xq` / `xs` the activations as
    /// [`Gpu::quant_f8_tokens`] wrote them, W's bytes with its cuBLASLt block scales `blk`
    /// ([`lt_block_scales`]), y bf16. Errors when cuBLASLt takes no algorithm for the shape.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_fp8_lt(
        &self,
        lt_: &Fp8Lt,
        xq: &impl DevicePtr<u8>,
        xs: &impl DevicePtr<f32>,
        w: &Fp8Mat<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
        blk: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<bf16>,
        m: usize,
    ) -> Result<()> {
        const OP: &str = "gemm_fp8_lt";
        let (n, k) = (w.n, w.k);
        ensure(
            k.is_multiple_of(LT_BLOCK) && w.group == LT_BLOCK,
            OP,
            || format!("k = {k}, group {} (needs multiples of {LT_BLOCK})", w.group),
        )?;
        check_len(OP, "xq", xq, m * k)?;
        check_len(OP, "xs", xs, m * (k / LT_BLOCK))?;
        check_len(OP, "W", w.bytes, n * k)?;
        let kp = (k / LT_BLOCK).next_multiple_of(4);
        check_len(OP, "block scales", blk, n.div_ceil(LT_BLOCK) * kp)?;
        check_len(OP, "y", y, m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        use cudarc::cublas::sys::cublasOperation_t as Op;
        use sys::cublasLtMatmulDescAttributes_t as A;
        use sys::cublasLtMatmulMatrixScale_t as Mode;
        let s = self.stream();
        let (wp, _gw) = w.bytes.device_ptr(s);
        let (xp, _gx) = xq.device_ptr(s);
        let (bp, _gb) = blk.device_ptr(s);
        let (sp, _gs) = xs.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let (wsp, _gws) = lt_.workspace.device_ptr(s);
        // cuBLASLt takes 64-bit sizes; the kernels' 32-bit limits still bound them.
        let _ = (int(OP, "m", m)?, int(OP, "n", n)?, int(OP, "k", k)?);
        let f8 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(lt_err)?;
        let mut d = Descs {
            op: desc,
            layouts: Vec::with_capacity(4),
            pref: std::ptr::null_mut(),
        };
        for (ty, rows, cols, ld) in [
            (f8, k, n, k),
            (f8, k, m, k),
            (sys::cudaDataType_t::CUDA_R_16BF, n, m, n),
        ] {
            d.layouts.push(
                lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
                    .map_err(lt_err)?,
            );
        }
        // SAFETY: live descriptors; each attribute with its documented type.
        unsafe {
            set_attr(d.op, A::CUBLASLT_MATMUL_DESC_TRANSA, &Op::CUBLAS_OP_T)?;
            set_attr(d.op, A::CUBLASLT_MATMUL_DESC_TRANSB, &Op::CUBLAS_OP_N)?;
            set_attr(
                d.op,
                A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                &Mode::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
            )?;
            set_attr(
                d.op,
                A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                &Mode::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
            )?;
            set_attr(d.op, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &bp)?;
            set_attr(d.op, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sp)?;
        }
        d.pref = lt::create_matmul_pref().map_err(lt_err)?;
        let ws_bytes = LT_WORKSPACE;
        // SAFETY: a live preference; the attribute is a usize.
        unsafe {
            lt::set_matmul_pref_attribute(
                d.pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws_bytes as *const usize).cast::<c_void>(),
                std::mem::size_of::<usize>(),
            )
        }
        .map_err(lt_err)?;
        let (la, lb, ly) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        // SAFETY: live handle and descriptors.
        let heur =
            unsafe { lt::get_matmul_algo_heuristic(lt_.handle, d.op, la, lb, ly, ly, d.pref) }
                .map_err(lt_err)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: W holds n·k bytes, xq m·k, the scales their layouts' lengths and y m·n bf16
        // (checked above); the workspace is LT_WORKSPACE bytes; all on this stream. C is y with
        // beta 0 (never read).
        unsafe {
            lt::matmul(
                lt_.handle,
                d.op,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                wp as *const c_void,
                la,
                xp as *const c_void,
                lb,
                yp as *const c_void,
                ly,
                yp as *mut c_void,
                ly,
                &heur.algo,
                wsp as *mut c_void,
                LT_WORKSPACE,
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(lt_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_scales_take_one_row_per_block_padded_to_four() {
        // n = 130 (two row blocks, the second of 2 rows), k = 256 (2 k-blocks, padded to 4).
        let (n, k) = (130, 256);
        let row_scales: Vec<f32> = (0..n)
            .flat_map(|r| {
                let nb = (r / 128) as f32;
                [10.0 * nb + 1.0, 10.0 * nb + 2.0]
            })
            .collect();
        let blk = lt_block_scales(&row_scales, n, k, 128).unwrap();
        assert_eq!(blk, [1.0, 2.0, 1.0, 1.0, 11.0, 12.0, 1.0, 1.0]);
    }

    #[test]
    fn block_scales_refuse_rows_that_differ_or_other_groups() {
        let mut row_scales = vec![1.0f32; 128 * 2];
        assert!(lt_block_scales(&row_scales, 128, 256, 128).is_some());
        row_scales[2 * 5] = 2.0; // row 5's first block differs from row 0's
        assert!(lt_block_scales(&row_scales, 128, 256, 128).is_none());
        assert!(lt_block_scales(&vec![1.0; 128 * 4], 128, 256, 64).is_none());
        assert!(lt_block_scales(&[1.0; 3], 128, 256, 128).is_none());
    }
}
