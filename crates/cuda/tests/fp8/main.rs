//! Block-scaled FP8 weights consumed as their bytes by [`sanmai_cuda`], against the CPU:
//!
//! - [`kernels`]: each FP8 kernel against its CPU twin (the checkpoint's bytes and block scales
//!   dequantised exactly as `sanmai_weights::fp8::dequantize` does, then `matmul_t`): the decode GEMV
//!   (m = 1..8, bf16 and f32 out, several weights a launch), the tile dequantisation (bit for bit),
//!   the prefill GEMM, the grouped expert GEMV (decode and prefill tile counts, the 80B's shapes).
//! - [`tensor_cores`]: the FP8 tensor-core prefill GEMMs: the per-token-group activation
//!   quantisation against its CPU twin (exact), and the dense GEMM (Hopper, cuBLASLt) and the routed
//!   experts' grouped GEMM (`mma.sync` e4m3, sm_89 and later) against the CPU product of the same
//!   quantised activations and the dequantised weights.
//! - [`e2e`]: the tiny FP8 fixtures (`qwen3_next_fp8_tiny`, `qwen3_5_moe_fp8_tiny`) loaded on the GPU
//!   (FP8 kept as bytes) and on the CPU (dequantised to f32): prompt log-probs through a prefill chunk
//!   and decode steps, within the bounds of the packed formats' end-to-end test.
//!
//! Without a GPU the device tests print `skipped: <test>: <reason>` and pass. Each check prints one
//! `FP8` line.

#[path = "../support/logits.rs"]
mod logits;
#[path = "../support/options.rs"]
mod options;
#[path = "../support/rng.rs"]
mod rng;

mod e2e;
mod kernels;
mod tensor_cores;

use half::bf16;

pub use rng::Rng;

/// Values rounded to bf16 (as f32).
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
