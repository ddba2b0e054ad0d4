//! Shared test plumbing: the GPU (or the reason there is none), a seeded generator, bf16 rounding and
//! the comparison that prints `PARITY` lines.

use std::sync::OnceLock;

use half::bf16;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{Gpu, PackedMat, PackedScheme};

/// The test GPU, created once; `None` (after printing why) when there is no usable device.
pub fn gpu(test: &str) -> Option<&'static Gpu> {
    static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
    match GPU.get_or_init(|| Gpu::new(0, &crate::options::gpu_options()).map_err(|e| e.to_string()))
    {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}

pub use crate::rng::Rng;

impl Rng {
    /// `n` normals times `scale` plus `mean`.
    pub fn normals(&mut self, n: usize, mean: f32, scale: f32) -> Vec<f32> {
        (0..n).map(|_| mean + scale * self.normal()).collect()
    }
}

/// Rounds to bf16: the device copy and the f32 values the CPU oracle sees.
pub fn to_bf16(x: &[f32]) -> (Vec<bf16>, Vec<f32>) {
    let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let f = b.iter().map(|v| v.to_f32()).collect();
    (b, f)
}

pub fn from_bf16(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// Error statistics of `got` against `want`.
pub struct Stats {
    pub max_abs: f32,
    /// `max|got − want| / max|want|`.
    pub max_rel: f32,
    /// `‖got − want‖ / ‖want‖`.
    pub rms_rel: f32,
    /// Largest `|got − want| / (2⁻⁸·|want| + 1e-4·max|want|)`: ≤ 1 means within one bf16 rounding.
    pub elem_ratio: f32,
}

pub fn stats(got: &[f32], want: &[f32]) -> Stats {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (mut max_abs, mut se, mut sw, mut ratio) = (0f32, 0f64, 0f64, 0f32);
    for (g, w) in got.iter().zip(want) {
        let d = (g - w).abs();
        assert!(d.is_finite(), "non-finite result: got {g}, want {w}");
        max_abs = max_abs.max(d);
        se += (d as f64).powi(2);
        sw += (*w as f64).powi(2);
        ratio = ratio.max(d / (w.abs() / 256.0 + 1e-4 * scale));
    }
    Stats {
        max_abs,
        max_rel: if scale > 0.0 {
            max_abs / scale
        } else {
            max_abs
        },
        rms_rel: if sw > 0.0 {
            (se / sw).sqrt() as f32
        } else {
            se.sqrt() as f32
        },
        elem_ratio: ratio,
    }
}

fn report(op: &str, shape: &str, s: &Stats, tol: &str) {
    println!(
        "PARITY op={op} shape={shape} max_abs={:.3e} max_rel={:.3e} rms_rel={:.3e} elem_ratio={:.3} tol={tol}",
        s.max_abs, s.max_rel, s.rms_rel, s.elem_ratio
    );
}

/// An elementwise op with a bf16 output: every element within one bf16 rounding of the reference.
pub fn check_elementwise(op: &str, shape: &str, got: &[f32], want: &[f32]) {
    let s = stats(got, want);
    report(op, shape, &s, "elem");
    assert!(
        s.elem_ratio <= 1.0 && s.max_rel <= 1e-2,
        "{op} {shape}: elementwise error {:.3} roundings (max_rel {:.3e})",
        s.elem_ratio,
        s.max_rel
    );
}

/// `got` within max-norm relative `max_rel` and rms relative `rms_rel` of `want`.
fn check_within(op: &str, shape: &str, got: &[f32], want: &[f32], (max_rel, rms_rel): (f32, f32)) {
    let s = stats(got, want);
    report(
        op,
        shape,
        &s,
        &format!("max_rel<={max_rel:e},rms_rel<={rms_rel:e}"),
    );
    assert!(
        s.max_rel <= max_rel && s.rms_rel <= rms_rel,
        "{op} {shape}: max_rel {:.3e}, rms_rel {:.3e}",
        s.max_rel,
        s.rms_rel
    );
}

/// A reduction with a bf16 output: max-norm relative ≤ 1e-2, rms relative ≤ 4e-3.
pub fn check_reduction(op: &str, shape: &str, got: &[f32], want: &[f32]) {
    check_within(op, shape, got, want, (1e-2, 4e-3));
}

/// A backend op made of several kernels, each rounding its output to bf16, against the CPU backend's
/// f32 pipeline (e.g. the whole routed-expert op: gate|up, SwiGLU and the combine each round): the
/// bounds of the end-to-end lockstep test, max-norm relative ≤ 5e-2, rms relative ≤ 2e-2.
pub fn check_composite(op: &str, shape: &str, got: &[f32], want: &[f32]) {
    check_within(op, shape, got, want, (5e-2, 2e-2));
}

/// A composite op whose GEMMs take their inputs in e4m3 (the FP8 format's dynamic scheme on the FP8
/// tensor cores: each quantised input about 2.5% RMS from bf16, two in a row for the experts'
/// gate|up then down): max-norm relative ≤ 1e-1, rms relative ≤ 5e-2.
pub fn check_composite_e4m3(op: &str, shape: &str, got: &[f32], want: &[f32]) {
    check_within(op, shape, got, want, (1e-1, 5e-2));
}

/// An f32 result: max-norm relative ≤ 1e-4.
pub fn check_f32(op: &str, shape: &str, got: &[f32], want: &[f32]) {
    let s = stats(got, want);
    report(op, shape, &s, "max_rel<=1e-4");
    assert!(s.max_rel <= 1e-4, "{op} {shape}: max_rel {:.3e}", s.max_rel);
}

/// A packed `[n, k]` weight on the device (`words`, `scales`; scheme `bits` / `group_size`) as the
/// packed ops take it.
pub fn packed_mat<'a>(
    words: &'a CudaSlice<u32>,
    scales: &'a CudaSlice<f32>,
    (bits, group_size): (u32, usize),
    (n, k): (usize, usize),
) -> PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>> {
    PackedMat {
        words,
        scales,
        scheme: PackedScheme { bits, group_size },
        n,
        k,
    }
}
