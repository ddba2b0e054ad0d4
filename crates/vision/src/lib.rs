//! Images for the vision tower: what an image becomes before the model sees it. This crate owns the
//! preprocessing of the Qwen3.5/3.6 and qwen4_exp checkpoints ([`mod@preprocess`]): decoding, RGB,
//! the processor's `smart_resize`, a bicubic resample that reproduces Pillow's byte for byte
//! ([`resample`]), rescale and normalisation, and the patch layout the vision model reads; and where
//! each patch and image token sits ([`positions`]). It also owns the vision tower's CPU reference
//! forward ([`tower`]): patch embedding, position embeddings, the blocks and the patch merger in f32,
//! equal to transformers' to the fixture's tolerance.

pub mod config;
pub mod positions;
pub mod preprocess;
pub mod resample;
pub mod tower;

pub use config::PreprocessorConfig;
pub use preprocess::{preprocess, smart_resize, Patches};

/// Why an image could not be prepared or run through the tower. Each names the field, tensor or
/// image at fault.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error("{file}: field `{field}`: {message}")]
    Config {
        file: String,
        field: String,
        message: String,
    },
    #[error("the image could not be decoded: {0}")]
    Decode(String),
    #[error("image tokens: {0}")]
    Tokens(String),
    #[error("the image is {height}x{width}: {message}")]
    Size {
        height: usize,
        width: usize,
        message: String,
    },
    #[error("vision weight `{name}`: {message}")]
    Weight { name: String, message: String },
    #[error("vision tower input: {0}")]
    Input(String),
}

pub type Result<T> = std::result::Result<T, VisionError>;
