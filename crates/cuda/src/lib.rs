//! The CUDA backend: device selection and detection, the NVRTC kernel registry with its on-disk cache,
//! bf16 kernels (each checked against its CPU twin in `sanmai_cpu::ops`) and [`CudaBackend`], the
//! `sanmai_model::Backend` implementation over them.
//!
//! The CUDA libraries (driver, NVRTC, cuBLAS, NCCL) are loaded at run time (cudarc's dynamic
//! loading), so the crate builds and its tests run on machines without a GPU or a CUDA toolkit:
//! probes answer "no device" with the reason, and GPU tests print that they were skipped.
//!
//! What exists:
//! - [`DeviceSelection`] (`cpu`, `cuda`, `cuda:N`), [`probe`], [`gpu_present`], [`device_count`].
//! - The registry ([`registry`]): `kernels/*.cu` embedded with `include_str!`, compiled to CUBIN for the
//!   device's architecture (`sm_86`, `sm_90`, …) once per process, cached on disk under the folder
//!   [`registry::CompileOptions`] names, keyed by source hash + architecture + driver and NVRTC
//!   versions; a compile error names the `.cu` file and line ([`CudaError::Compile`]).
//! - [`Gpu`]: context, stream, loaded kernels and a cuBLAS handle, with these ops (bf16 activations,
//!   f32 arithmetic, one rounding per output): `rms_norm` (zero-centred and plain), `gated_rms_norm`,
//!   `rope_neox` (partial, strided heads), `qk_norm_rope` (per-head q/k norm + partial RoPE + gate
//!   split; `qk_norm_rope_mrope` at explicit interleaved-MRoPE `(t, h, w)` positions), `kv_write` (new K/V rows into the paged pools), `swiglu`, `silu`, `embed`, `gemv_bf16` /
//!   `gemv_bf16_f32` (decode, 1–8 rows), `gemm_bf16` / `gemm_bf16_f32` (cuBLAS, prefill),
//!   `route_topk` (softmax + top-k + renormalise), `moe_sort` / `moe_gemv` / `moe_combine` (routed
//!   experts grouped by expert on the device, through a table of expert weight addresses),
//!   `conv1d_prefill` (causal conv + SiLU of prefill chunks with the conv state ring), `gdn_decode`
//!   (a GDN layer's decode step in one launch: conv update, delta rule with f32 state in slots, gated
//!   RMSNorm), `gdn_chunk_prefill` (every sequence of a prefill step in one launch, chunked), `attention_paged_decode` / `attention_paged_prefill` (gated GQA attention
//!   over the paged K/V cache, split-K with a reduce kernel that applies `sigmoid(gate)`), and the
//!   elementwise `add_bf16`, `gather_rows`, `concat_cols`, `hc_premix`,
//!   `hc_gated_residual`; and a one-row decoding layer's mixer or MoE block in one persistent
//!   cooperative launch (`moe_layer_decode`, `gdn_layer_decode`, `attn_layer_decode`).
//! - Options, not environment: [`CudaOptions`] (CUDA graphs on or off, and the [`GpuOptions`]: PDL on
//!   or off, the kernel cache and CUDA header folders) says how a backend opens; this crate reads no
//!   environment variable, its caller (the `sanmai` binary, the tests' own helper) decides.
//! - [`CudaBackend`]: `CudaBackend::new(ordinal, &options)` (or `with_limits(ordinal, max_tokens,
//!   max_seqs, &options)`) opens device `ordinal` and is a `sanmai_model::Backend`: `Model::load(cfg,
//!   &src, CudaBackend::new(n, &options)?)` runs a model on `cuda:n`. Tensors and weights are
//!   device bf16, K/V pools bf16 (`CACHE_ELEM_BYTES = 2`), GDN state slots conv bf16 + recurrent
//!   f32 ([`CudaBackend::state_bytes_per_slot`]); [`CudaBackend::memory`] reports bytes of weights, K/V
//!   pools, GDN state slots and persistent workspace for the memory plan. Step metadata (ids, output
//!   rows, positions, K/V destinations, state slots, lengths, block tables) reaches the device once
//!   per step through pinned staging ([`CudaBackend::begin_step`], or lazily per op); no op waits for
//!   the device except `to_host`.
//! - CUDA graphs for decode steps (`Backend::decode_step`, which `Model::step` uses for steps of
//!   one-token chunks): batch sizes [`DEFAULT_GRAPH_BATCH_SIZES`] by default
//!   ([`CudaBackend::set_graph_batch_sizes`]; empty, or [`CudaOptions::cuda_graphs`] off, keeps every
//!   step eager). Per region, batch size and
//!   attention span (the next power of two of the longest context, at least [`MIN_GRAPH_SPAN`]; decode
//!   attention sizes its split grid by it and splits past a sequence's length exit early): one eager
//!   warm-up step, a stream capture at the next, replays after, outputs copied out of persistent
//!   per-graph buffers. A failed capture logs a warning and leaves that key eager;
//!   [`CudaBackend::graph_stats`] counts what ran how. With kernel timing on ([`timer`], through
//!   `Probe::time_kernels`), captures put a timed event after each kernel and give each persistent
//!   layer launch a trace slot, and the last replay's per-kernel times and layer phases are read back
//!   (`sanmai bench --kernel-times`).
//! - Errors: every op returns `sanmai_model::OpResult`; a [`CudaError`] becomes the op's
//!   `BackendError` ([`CudaError::at`]: shape and contract errors `Invalid`, driver, cuBLAS and NVRTC
//!   failures `Device`). The backend also implements `sanmai_model::Probe` (copy bandwidth, routed
//!   expert record) for `sanmai bench`.
//! - Packed weights (compressed-tensors INT4 / INT8 pack-quantized, INT6 gapless): `packed_weight`
//!   keeps a quantized Linear as its words and scales ([`CudaWeight::Packed`], no dequantised copy;
//!   shapes the packed kernels do not take, see [`packed_fits`], become bf16); `linear` runs the packed
//!   GEMV up to 8 rows and the tiled dequantise + cuBLAS GEMM beyond, through one persistent
//!   [`PACKED_WORKSPACE_BYTES`] workspace; routed experts run the packed grouped GEMV over tables of
//!   word and scale addresses; a packed embedding table stays packed (its lookup decodes the rows).
//! - Block-scaled FP8 weights (`quant_method: fp8`): `packed_weight` keeps an FP8 Linear as its bytes
//!   and per-row block scales ([`CudaWeight::Fp8`], one byte a weight; shapes the FP8 kernels do not
//!   take, see [`fp8_fits`], become bf16); `linear` runs the FP8 GEMV up to 8 rows and beyond, on a
//!   Hopper with 128×128 blocks, the FP8 tensor-core GEMM through cuBLASLt (activations quantised per
//!   token group, [`Gpu::quant_f8_tokens`], [`Gpu::gemm_fp8_lt`]; checked once against the bf16
//!   tiles), else the tiled dequantise + cuBLAS GEMM; routed FP8 experts run the grouped FP8 GEMV.
//!
//! - The NCCL link between pipeline stages on two devices ([`link`]): [`link::connect`] joins two
//!   backends with a two-rank communicator, [`link::LinkSender::send`] and
//!   [`link::LinkReceiver::recv`] hand a [`CudaTensor`] over on each stage's own stream;
//!   [`link::nccl_library`] loads libnccl (at first use) and names its version or why it is missing.
//!
//! - QSA attention (fp8 index keys next to the K/V, exact top-k, attention over the selected rows),
//!   the PLE mix (its conv state in the state slots) and hyper-connections (fused gated residual for
//!   decode) on the device.
//!
//! - The vision tower ([`vision::CudaTower`]): a multimodal checkpoint's tower on the device (bf16
//!   linears through cuBLAS, f32 residual stream, LayerNorm, 2-D rotary, bidirectional attention
//!   per frame and the patch merger in `kernels/vision.cu`), a `sanmai_model::vision::Tower`.
//!
//! What is next: the faithful chunked (WY/UT) GDN prefill, a tiled prefill attention that shares K/V
//! loads across query rows, a grouped GEMM for large prefill MoE (the tiled grouped GEMV reads each
//! expert once per 8 routed tokens), MRoPE and f32 logits.

mod backend;
pub mod cache;
mod device;
mod error;
mod gpu;
pub mod link;
pub mod nvrtc;
mod ops;
pub mod registry;
pub mod timer;
pub mod vision;

pub use backend::{fp8_device_bytes, Fp8Weight};
pub use backend::{packed_device_bytes, packed_fits, PackedWeight, PACKED_WORKSPACE_BYTES};
pub use backend::{
    CudaBackend, CudaOptions, CudaTensor, CudaWeight, DenseBf16, GraphStats, MemoryReport,
    DEFAULT_GRAPH_BATCH_SIZES, DEFAULT_MAX_SEQS, DEFAULT_MAX_TOKENS, MIN_GRAPH_SPAN,
};
pub use cudarc;
pub use device::{device_count, driver_version, gpu_present, probe, DeviceInfo, DeviceSelection};
pub use error::{CudaError, Result};
pub use gpu::{device_memory, Gpu, GpuOptions};
pub use ops::{fp8_fits, Fp8Experts, Fp8Mat, Fp8Part};
pub use ops::{layer_phases, GdnLayer, GdnLayerBufs, MoeLayer, MoeLayerBufs, MoeLayerShared};
pub use ops::{lt_block_scales, Fp8Lt, LtCheck, LT_BLOCK};
pub use ops::{
    moe_max_tiles, AttnDims, ChunkRows, DecodeLens, GdnDecodeWeights, GdnDims, HeadLayout,
    HeadNorm, KvPools, MoeOut, MropeArgs, NormRows, PagedCache, PleDims, Queries, RopeArgs,
    Selection, ATTN_MAX_HEAD_DIM, GEMV_MAX_M, MOE_TILE, QK_MAX_HEAD_DIM, ROUTER_MAX_K,
};
pub use ops::{AttnLayer, AttnLayerBufs, LayerRope, LayerSeq};
pub use ops::{
    CombineInto, DecodeRouting, Experts, PairGroups, PairRows, RouteDims, Routed, SharedGate,
    SharedY,
};
pub use ops::{ConvWeight, DecodeSlots, GdnGateProj, GdnGates, GdnPools, GdnProj, SeqRows};
pub use ops::{IndexCache, IndexHeads, IndexProj, IndexQueries, KeyNorm, ScoreRows};
pub use ops::{PackedM1, PackedMat, PackedScheme, RowAddNorm, NORM_MAX_D};
pub use ops::{PleGateWeights, PleGated, PleLin};
pub use ops::{RowCache, RowCacheBufs, RowCacheState, ROW_CACHE_MAX_LINES};
pub use ops::{SampleBatch, SampleBuffers};
pub use ops::{SeqKv, StagingArena};
pub use vision::CudaTower;
