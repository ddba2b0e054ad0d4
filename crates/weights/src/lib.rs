//! Model weights on the host: safetensors checkpoints read through mmap (single file or sharded with
//! `model.safetensors.index.json`), random "dummy" weights of the right shapes, and the per-architecture
//! name maps that turn a checkpoint's layout into the canonical tensors the model asks for.
//!
//! A [`TensorSource`] answers "give me tensor NAME of shape S"; [`names::LayerWeights`] knows where each
//! architecture keeps a layer's tensors (Qwen3-Next's grouped GDN projections, per-expert or fused 3-D
//! routed experts, the multimodal wrapper's `model.language_model.` prefix, `mtp.*`).
//!
//! Quantized checkpoints (compressed-tensors `pack-quantized`, see [`quant`]) are read transparently:
//! [`TensorSource::tensor`] dequantises a packed Linear to f32, and [`TensorSource::packed`] hands the
//! packed words and scales to a backend that consumes them directly. Block-scaled FP8 checkpoints
//! ([`fp8`]) are dequantised to f32 when a tensor is asked for, and [`TensorSource::packed`] hands
//! their bytes and block scales over as a [`PackedTensor`] with `fp8` set.

mod checkpoint;
mod dummy;
mod e4m3;
pub mod fp8;
pub mod names;
pub mod overlay;
pub mod quant;
mod tensor;

pub use checkpoint::Checkpoint;
pub use dummy::Dummy;
pub use overlay::Overlay;
pub use quant::{PackedTensor, PackedWords};
pub use tensor::{DType, HostTensor, TensorData};

/// Errors from loading weights. Each names the tensor (and file) involved.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("tensor `{name}` is missing from the checkpoint")]
    Missing { name: String },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` has dtype {found}, expected one of bf16, f16, f32")]
    DType { name: String, found: String },
    #[error("quantized tensor `{name}`: {message}")]
    Quant { name: String, message: String },
    #[error("uploading a weight to the backend: {message}")]
    Upload { message: String },
}

pub type Result<T> = std::result::Result<T, WeightError>;

/// How a dummy tensor is filled; checkpoints ignore it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform with this standard deviation, centred on `mean`.
    Random {
        mean: f32,
        std: f32,
    },
    Const(f32),
}

impl Init {
    pub const ZEROS: Init = Init::Const(0.0);
    pub const ONES: Init = Init::Const(1.0);
    pub fn std(std: f32) -> Init {
        Init::Random { mean: 0.0, std }
    }
}

/// Where tensors come from: a checkpoint on disk or a random generator.
pub trait TensorSource: Send + Sync {
    /// The tensor called `name`, which must have `shape`; `init` fills it when the source is random.
    fn tensor(&self, name: &str, shape: &[usize], init: Init) -> Result<HostTensor<'_>>;
    /// Whether `name` exists (a random source has every tensor). A quantized Linear's `X.weight` exists
    /// when its packed triplet does.
    fn contains(&self, name: &str) -> bool;
    /// The packed form of the quantized weight `name` (`X.weight`, or a fused 3-D expert tensor) of
    /// `shape` (packed integers, or FP8 bytes with their block scales), or `None` when the source
    /// holds it unquantized.
    fn packed(&self, name: &str, shape: &[usize], init: Init) -> Result<Option<PackedTensor<'_>>> {
        let _ = (name, shape, init);
        Ok(None)
    }
}
