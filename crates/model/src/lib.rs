//! The forward pass of Qwen3-Next / Qwen3.5-MoE hybrid models and of qwen4_exp, written once over the
//! [`Backend`] trait: embedding, gated attention (dense, or QSA with its lightning indexer) and
//! gated-delta-net mixers, dense and MoE feed-forward blocks, the PLE mix with its host-gathered table
//! rows, hyper-connections' residual streams, the final norm and lm_head, and the MTP draft head. One
//! entry point, [`Model::step`], runs a batch of sequence chunks through the whole layer stack or one
//! pipeline stage of it (`Model::load_stage`). Backends (CPU reference, CUDA) supply the ops and own
//! the per-sequence caches; this crate decides what is computed, in which order, with which weights,
//! and how sampling draws a token from a row of logits with a request's parameters (`sample`: the
//! math the backends' sampling op follows, and `SamplingParams`, the one parameter type from the
//! request to that op). Images enter through [`vision`] (the tower's weights and merged tokens, a
//! prompt's MRoPE positions) and [`Model::step_multimodal`] (the step inputs that carry them).

pub mod backend;
pub mod builtin;
mod forward;
mod load;
mod ple;
mod roofline;
pub mod sample;
pub mod vision;
pub mod weight_plan;

pub use backend::{
    AttnCall, AttnShape, AttnWeights, Backend, BackendError, DecodeStep, GdnCall, GdnGates,
    GdnShape, GdnWeights, Handover, HcNext, HcWeights, IndexerWeights, KvHost, KvHostStats,
    MlpWeights, MoeCall, MoeWeights, Mrope, OpResult, PhaseTable, PleCall, PleShape, PleWeights,
    Probe, QsaCall, QsaShape, Rope, RowCacheCounts, SampleCall, SeqChunk, SharedExpert,
    SharedFusion, StageLink, StageRecv, StageSend,
};
pub use forward::{
    OutRows, Prepared, StepChunk, StepEmbeds, StepError, StepInput, StepMultimodal, StepOutput,
    StepStart,
};
pub use load::{Ffn, Layer, Mixer, Model, MtpWeights};
pub use ple::PleSource;
pub use roofline::StepBytes;
