//! Packed integer weights (compressed-tensors INT4 g128 / INT8 channel, INT6 gapless) consumed by the
//! model and by [`sanmai_cuda::CudaBackend`]:
//!
//! - [`grouped`]: the packed grouped GEMV of the routed experts (`Gpu::moe_gemv_packed`) against the
//!   CPU (the same integers dequantised, then `matmul_t`), for gate|up (bf16 out, token rows) and down
//!   (f32 out, pair rows), INT4 g128 / g32, INT8 channel and INT6 gapless, decode and prefill tile
//!   counts; and the backend's `linear` on packed weights (GEMV up to 8 rows, tiled GEMM beyond, f32
//!   logits) against the CPU backend.
//! - [`e2e`]: `tests/fixtures/qwen3_5_moe_text_tiny_quant` loaded on the GPU (packed) and on the CPU
//!   (dequantised): prompt log-probs through prefill and decode steps.
//! - [`plan`] (no GPU): the shrunken `qwen3-next-80b-a3b` config with dummy weights loads its routed
//!   experts INT4 g128, shared experts INT6, projections INT8 in packed form, in shapes the GPU keeps
//!   packed, at their packed sizes.
//!
//! Without a GPU the device tests print `skipped: <test>: <reason>` and pass. Each check prints one
//! `PACKED` line.

#[path = "../support/launch.rs"]
mod launch;
#[path = "../support/logits.rs"]
mod logits;
#[path = "../support/options.rs"]
mod options;
#[path = "../support/rng.rs"]
mod rng;

mod e2e;
mod grouped;
mod layers;
mod plan;

use half::bf16;

pub use rng::Rng;

impl Rng {
    /// `n` normals times `scale`.
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.normal()).collect()
    }
}

/// Values rounded to bf16 (as f32): what a bf16 device copy holds exactly.
pub fn bf16_round(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// `max|got − want| / max|want|` and `‖got − want‖ / ‖want‖`.
pub fn rel_errors(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let (mut max_abs, mut se, mut sw) = (0f32, 0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        let d = (g - w).abs();
        assert!(d.is_finite(), "non-finite result: got {g}, want {w}");
        max_abs = max_abs.max(d);
        se += (d as f64).powi(2);
        sw += (*w as f64).powi(2);
    }
    (max_abs / scale, (se / sw.max(1e-300)).sqrt() as f32)
}
