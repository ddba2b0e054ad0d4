//! The ops: host-side launchers of the kernels in `kernels/*.cu`, as methods of [`crate::Gpu`].
//!
//! Every op takes device buffers (`CudaSlice`, `CudaView`, `CudaViewMut` or anything implementing
//! cudarc's `DevicePtr`/`DevicePtrMut`) with their shape, checks the buffer lengths and shape limits
//! (an error, never a panic or an out-of-bounds access), and queues the kernel on the `Gpu`'s stream.
//! Operands that belong together come as one struct: a shape ([`NormRows`], [`AttnDims`],
//! [`GdnDims`], …), a layer's caches ([`KvPools`], [`PagedCache`], [`GdnPools`]), a step's
//! sequences ([`DecodeLens`], [`SeqRows`], [`DecodeSlots`]), a packed weight ([`PackedMat`]), an FP8
//! one ([`Fp8Mat`]) or the routed experts ([`Experts`], [`PairRows`], [`PairGroups`]).
//! Activations are bf16 with f32 arithmetic inside the kernels and one rounding per output.

mod attention;
mod attn_layer;
mod conv;
mod elementwise;
mod fp8;
mod fp8_lt;
mod gdn;
mod gdn_chunk;
mod gdn_layer;
mod gemm;
mod gemv;
pub(crate) mod hc;
mod kv;
mod layer;
mod moe;
mod moe_gemm;
mod moe_layer;
mod norm;
mod packed_m1;
mod ple;
mod qsa;
mod qsa_staged;
mod quant;
mod rope;
mod router;
mod row_cache;
mod sample;
mod tensor;

pub use attention::{AttnDims, ChunkRows, DecodeLens, PagedCache, Queries, ATTN_MAX_HEAD_DIM};
pub use attn_layer::{AttnLayer, AttnLayerBufs, LayerRope, LayerSeq};
pub use conv::ConvWeight;
pub use fp8::{fp8_fits, Fp8Experts, Fp8Mat, Fp8Part};
pub use fp8_lt::{lt_block_scales, Fp8Lt, LtCheck, LtVerdict, LT_BLOCK};
pub use gdn::{DecodeSlots, GdnDecodeWeights, GdnDims, GdnGateProj, GdnPools, GdnProj, SeqRows};
pub use gdn_chunk::GdnGates;
pub use gdn_layer::{GdnLayer, GdnLayerBufs};
pub use gemv::GEMV_MAX_M;
pub(crate) use gemv::GEMV_SEGS;
pub use kv::{HeadLayout, HeadNorm, MropeArgs, RopeArgs, QK_MAX_HEAD_DIM};
pub use layer::layer_phases;
pub use moe::{
    moe_max_tiles, CombineInto, Experts, MoeOut, PairGroups, PairRows, Routed, SharedGate, SharedY,
    MOE_TILE, SWIGLU_FUSED_MAX_PAIRS,
};
pub use moe_layer::{MoeLayer, MoeLayerBufs, MoeLayerShared};
pub use norm::NormRows;
pub use ple::{PleDims, PleGateWeights, PleGated, PleLin};
pub use qsa::{IndexCache, IndexHeads, IndexProj, IndexQueries, KeyNorm, ScoreRows, Selection};
pub use qsa_staged::{SeqKv, StagingArena};
pub use quant::{PackedM1, PackedMat, PackedScheme, RowAddNorm, NORM_MAX_D};
pub use router::{DecodeRouting, RouteDims, ROUTER_MAX_K};
pub use row_cache::{RowCache, RowCacheBufs, RowCacheState, ROW_CACHE_MAX_LINES};
pub(crate) use sample::SAMPLE_MAX_VOCAB;
pub use sample::{SampleBatch, SampleBuffers};

/// A layer's K and V pools, `[num_blocks, block_size, hkv·head_dim]` bf16 each (the CPU backend's
/// layout): `KvPools<&CudaSlice<bf16>>` where a kernel reads them, `KvPools<&mut CudaSlice<bf16>>`
/// where it writes them.
#[derive(Debug, Clone, Copy)]
pub struct KvPools<T> {
    pub k: T,
    pub v: T,
}

/// Threads per block for a row of `d` elements: one warp at least, 256 at most.
pub(crate) fn row_threads(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, 256) as u32
}
