//! The crate's error type.

use std::path::PathBuf;

use sanmai_model::{BackendError, OpResult};

/// Everything that can go wrong between the host and the device.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver or device (library missing, `cuInit` failed, no device, bad ordinal).
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A device selection string that is not `cpu`, `cuda` or `cuda:N`.
    #[error("invalid device {0:?}: expected cpu, cuda or cuda:N")]
    BadDevice(String),
    /// A call into the CUDA driver failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A call into cuBLAS failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// A call into cuBLASLt failed (the FP8 tensor-core GEMM).
    #[error("cuBLASLt: {0}")]
    BlasLt(String),
    /// NVRTC is not available (library not found) or failed outside compilation proper.
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// A kernel source failed to compile: `file` and `line` name the first error NVRTC reported.
    #[error("kernel compile error in {file}{}:\n{log}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Compile {
        file: String,
        line: Option<u32>,
        log: String,
    },
    /// The CUDA headers (`cuda_bf16.h`) were not found in any include directory tried.
    #[error("CUDA headers not found (tried {tried:?}): set CUDA_HOME or SANMAI_CUDA_INCLUDE")]
    NoHeaders { tried: Vec<PathBuf> },
    /// A kernel name the registry does not hold.
    #[error("unknown kernel {0}")]
    UnknownKernel(String),
    /// NCCL is not available (library not found) or one of its calls failed (`link`).
    #[error("NCCL: {0}")]
    Nccl(String),
    /// Two backends on one device given to `link::connect`, which joins two devices.
    #[error("link: both backends are on cuda:{0}; one device hands over by device copy, not NCCL")]
    SameDevice(usize),
    /// Buffer sizes or shapes that do not fit the op.
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, CudaError>;

impl CudaError {
    /// This error as the [`BackendError`] of the backend op `op`: a shape or contract error of the
    /// call is [`BackendError::Invalid`], everything the driver, cuBLAS or NVRTC reported (out of
    /// memory, a launch or copy failure) is [`BackendError::Device`]. The message names the inner op
    /// when it differs from `op`.
    pub fn at(self, op: &'static str) -> BackendError {
        match self {
            CudaError::Shape { op: inner, msg } if inner == op => BackendError::invalid(op, msg),
            CudaError::Shape { op: inner, msg } => {
                BackendError::invalid(op, format!("{inner}: {msg}"))
            }
            CudaError::BadDevice(_) | CudaError::SameDevice(_) => {
                BackendError::invalid(op, self.to_string())
            }
            e => BackendError::device(op, e),
        }
    }
}

/// [`CudaError::at`] on a result: `r.at("linear")`.
pub(crate) trait At<T> {
    fn at(self, op: &'static str) -> OpResult<T>;
}

impl<T> At<T> for Result<T> {
    fn at(self, op: &'static str) -> OpResult<T> {
        self.map_err(|e| e.at(op))
    }
}

/// A shape error for `op` unless `ok`.
pub(crate) fn ensure(ok: bool, op: &'static str, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape { op, msg: msg() })
    }
}
