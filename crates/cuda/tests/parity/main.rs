//! GPU parity tests: every kernel against its CPU twin in `sanmai_cpu::ops` on random inputs, plus the
//! NVRTC compile check for sm_86 and sm_90 and (ignored by default) the GEMV/GEMM timing.
//!
//! Without a GPU each test prints `skipped: <test>: <reason>` and passes. Each parity test prints one
//! `PARITY` line per case, which `scripts/gpu_check.sh` collects into its report.
//!
//! Tolerances (bf16 outputs carry 8 significant bits, so one rounding is at most 2⁻⁸ relative):
//! - elementwise ops (norms, RoPE, SwiGLU, conv): every element within `2⁻⁸·|ref| + 1e-4·max|ref|`;
//! - reductions with a bf16 output (GEMV, GEMM, GDN output, attention output): `max|gpu − ref| / max|ref| ≤ 1e-2` and
//!   `‖gpu − ref‖ / ‖ref‖ ≤ 4e-3`;
//! - f32 results (router weights, GDN state): `max|gpu − ref| / max|ref| ≤ 1e-4`;
//! - router ids: equal, except documented near-ties (the two probabilities within 1e-6 relative); for
//!   the one-launch decode routing, whose logits come from its own GEMV, a differing rank only where the
//!   two experts' logits lie within twice the token's largest logit difference between the two
//!   computations (`router.rs`), and exactly equal ids, weights and tiles from the same logits.

#[path = "../support/launch.rs"]
mod launch;
#[path = "../support/options.rs"]
mod options;
#[path = "../support/rng.rs"]
mod rng;

mod attention;
mod attn_layer;
mod bench;
mod bench_attn;
mod bench_attn_layer;
mod bench_dense;
mod bench_gdn;
mod bench_gdn_layer;
mod bench_moe;
mod bench_moe_gemm;
mod bench_moe_layer;
mod common;
mod compile;
mod conv;
mod dense;
mod elementwise;
mod gdn;
mod gdn_decode;
mod gdn_gates;
mod gdn_layer;
mod hc;
mod kv;
mod moe;
mod moe_fused;
mod moe_gemm;
mod moe_layer;
mod norm;
mod qsa_layer;
mod quant;
mod router;
mod sample;
