//! The forward pass of Qwen3-Next / Qwen3.5-MoE hybrid models, written once over the [`Backend`] trait:
//! embedding, gated attention and gated-delta-net mixers, dense and MoE feed-forward blocks, the final
//! norm and lm_head, and the MTP draft head. Backends (CPU reference, CUDA) supply the ops and own the
//! per-sequence caches; this crate decides what is computed, in which order, with which weights.

pub mod backend;
pub mod builtin;
mod forward;
mod load;

pub use backend::{
    AttnShape, AttnWeights, Backend, GdnShape, GdnWeights, MlpWeights, MoeWeights, Rope, SeqChunk,
};
pub use forward::StepOutput;
pub use load::{Ffn, Layer, Mixer, Model, MtpWeights};
