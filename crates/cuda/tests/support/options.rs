//! How the CUDA tests open their device. The crate reads no environment variable; the tests read the
//! ones the `sanmai` binary reads, so that `scripts/gpu_check.sh` and CI steer them the same way:
//! `SANMAI_PDL`, `SANMAI_CUDA_GRAPHS`, `SANMAI_FUSED_DECODE`, `SANMAI_MOE_LAYER`, `SANMAI_GDN_LAYER`,
//! `SANMAI_ATTN_LAYER` and `SANMAI_ROW_GEMV` (`0`, `off` or `false` turn them off),
//! `SANMAI_FP8_TENSOR_CORES` (`1`, `on` or `true` turn the backend's FP8 tensor cores on), the kernel cache
//! `SANMAI_CACHE_DIR` (else `$XDG_CACHE_HOME/sanmai`, else `~/.cache/sanmai`) and the CUDA header
//! folders `SANMAI_CUDA_INCLUDE` (`:`-separated), `$CUDA_HOME/include` and `$CUDA_PATH/include`.

use sanmai_cuda::registry::CompileOptions;
use sanmai_cuda::{CudaBackend, CudaOptions, GpuOptions};

fn switched(var: &str, values: [&str; 3]) -> bool {
    std::env::var(var).is_ok_and(|v| values.contains(&v.trim().to_ascii_lowercase().as_str()))
}

fn switched_off(var: &str) -> bool {
    switched(var, ["0", "off", "false"])
}

/// Whether the run asks for the FP8 tensor cores (`SANMAI_FP8_TENSOR_CORES=1`; off by default, as
/// in the `sanmai` binary).
pub fn fp8_tensor_cores() -> bool {
    switched("SANMAI_FP8_TENSOR_CORES", ["1", "on", "true"])
}

/// The kernel cache and CUDA header folders the environment names.
pub fn compile_options() -> CompileOptions {
    CompileOptions::from_vars(|v| std::env::var_os(v))
}

/// The options of a test's [`sanmai_cuda::Gpu`].
pub fn gpu_options() -> GpuOptions {
    GpuOptions {
        pdl: !switched_off("SANMAI_PDL"),
        fp8_tensor_cores: fp8_tensor_cores(),
        row_gemv: !switched_off("SANMAI_ROW_GEMV"),
        compile: compile_options(),
    }
}

/// The options of a test's [`sanmai_cuda::CudaBackend`].
pub fn cuda_options() -> CudaOptions {
    CudaOptions {
        gpu: gpu_options(),
        cuda_graphs: !switched_off("SANMAI_CUDA_GRAPHS"),
        fused_decode: !switched_off("SANMAI_FUSED_DECODE"),
        moe_layer: !switched_off("SANMAI_MOE_LAYER"),
        gdn_layer: !switched_off("SANMAI_GDN_LAYER"),
        attn_layer: !switched_off("SANMAI_ATTN_LAYER"),
    }
}

/// The test's backend on device 0 with [`cuda_options`], or `None` after printing
/// `skipped: <test>: <reason>` (no GPU, no driver). Test crates that open their devices otherwise
/// (the NCCL link's two, the FP8 suite's checked open) leave it unused.
#[allow(dead_code)]
pub fn backend(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0, &cuda_options()) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}
