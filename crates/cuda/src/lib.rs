//! The CUDA backend's foundation: device selection and detection, the NVRTC kernel registry with its
//! on-disk cache, and the first bf16 kernels, each checked against its CPU twin in `sanmai_cpu::ops`.
//!
//! The CUDA libraries (driver, NVRTC, cuBLAS) are loaded at run time (cudarc's dynamic loading), so the
//! crate builds and its tests run on machines without a GPU or a CUDA toolkit: probes answer "no
//! device" with the reason, and GPU tests print that they were skipped.
//!
//! What exists:
//! - [`DeviceSelection`] (`cpu`, `cuda`, `cuda:N`), [`probe`], [`gpu_present`], [`device_count`].
//! - The registry ([`registry`]): `kernels/*.cu` embedded with `include_str!`, compiled to CUBIN for the
//!   device's architecture (`sm_86`, `sm_90`, …) once per process, cached on disk under
//!   [`cache::cache_dir`] keyed by source hash + architecture + driver and NVRTC versions; a compile
//!   error names the `.cu` file and line ([`CudaError::Compile`]).
//! - [`Gpu`]: context, stream, loaded kernels and a cuBLAS handle, with these ops (bf16 activations,
//!   f32 arithmetic, one rounding per output): `rms_norm` (zero-centred and plain), `gated_rms_norm`,
//!   `rope_neox` (partial, strided heads), `swiglu`, `embed`, `gemv_bf16` / `gemv_bf16_f32` (decode,
//!   1–8 rows), `gemm_bf16` (cuBLAS, prefill), `route_topk` (softmax + top-k + renormalise),
//!   `conv1d_prefill` / `conv1d_update` (causal conv + SiLU with rolling state),
//!   `gdn_recurrent_step` (GDN decode, f32 state in slots), `gdn_recurrent_prefill` (one sequence's
//!   chunk, token by token inside one launch) and `attention_paged_decode` /
//!   `attention_paged_prefill` (gated GQA attention over the paged K/V cache, split-K with a reduce
//!   kernel that applies `sigmoid(gate)`).
//!
//! What is next (the rest of the CUDA issue): the faithful chunked (WY/UT) GDN prefill, a tiled
//! prefill attention that shares K/V loads across query rows, K/V cache writes, MRoPE, fused residual+norm, routed experts (grouped GEMV for
//! decode, grouped GEMM for prefill), quantised weights (INT4/INT8/INT6 pack-quantized), on-device
//! sampling, the `Backend` implementation over these ops with a memory plan, CUDA graphs for decode
//! and the `sanmai bench` roofline.

mod backend;
pub mod cache;
mod device;
mod error;
mod gpu;
pub mod nvrtc;
mod ops;
pub mod registry;

pub use backend::{
    CudaBackend, CudaTensor, CudaWeight, DenseBf16, MemoryReport, DEFAULT_MAX_SEQS,
    DEFAULT_MAX_TOKENS,
};
pub use cudarc;
pub use device::{device_count, driver_version, gpu_present, probe, DeviceInfo, DeviceSelection};
pub use error::{CudaError, Result};
pub use gpu::Gpu;
pub use ops::{
    moe_max_tiles, AttnDims, GdnDims, HeadLayout, MoeOut, RopeArgs, ATTN_MAX_HEAD_DIM, ATTN_SPLIT,
    GEMV_MAX_M, MOE_TILE, QK_MAX_HEAD_DIM, ROUTER_MAX_K,
};
