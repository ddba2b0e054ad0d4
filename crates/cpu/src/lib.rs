//! The CPU reference backend: every op of the model in plain f32 on the host, multi-threaded with rayon.
//! It is the oracle each GPU kernel is tested against, and it runs the built-in model and small
//! checkpoints on machines without a GPU.

mod backend;
pub mod ops;

pub use backend::{CpuBackend, CpuTensor, CpuWeight, QsaSelection};
