//! The numeric ops of the reference backend: plain f32 kernels over row-major slices.
//!
//! These functions are the oracle every accelerated kernel is tested against, so each one follows the
//! HF transformers reference (Qwen3-Next / Qwen3.5-MoE) operation by operation, in f32. Shapes are given
//! in the doc comment of each function as `[outer, .., inner]` with the last axis contiguous.
//!
//! Determinism: every op gives bit-identical results for any thread count. The SIMD versions of the hot
//! loops (AVX2+FMA, picked at run time) perform the same operations in the same order as their portable
//! versions, so results do not depend on the vector width either (`exp`, `ln_1p`, `cos` and `sin` come
//! from the platform's libm). `matmul_t` is batch-invariant: row `i` of the output depends only on row `i`
//! of the input, never on how many rows are computed with it; likewise each query row of
//! `attention_causal` does not depend on how the queries are split across calls.
//!
//! Shape mismatches between the slices and the sizes passed are programming errors and panic with a
//! message naming the op; no op panics on the values it is given (NaN and infinities flow through).

mod act;
mod attention;
mod conv;
mod fp8;
mod gdn;
mod gdn_chunked;
mod gemm;
mod linear;
mod moe;
mod norm;
mod ple;
mod qsa;
mod rope;
pub mod row_cache;

pub use act::{sigmoid, silu, softplus, swiglu};
pub use attention::{attention_causal, Causal, Heads};
pub use conv::causal_conv1d_silu;
pub use fp8::{
    bf16_bits, bf16_value, dequantize_index_key, fp8_e4m3_decode, fp8_e4m3_encode,
    quantize_index_key, FP8_E4M3_MAX,
};
pub use gdn::{gdn_recurrent, GdnInputs, GdnSizes};
pub use gdn_chunked::gdn_chunked;
pub use linear::matmul_t;
pub use moe::route_topk;
pub use norm::{gated_rms_norm, l2_norm, rms_norm};
pub use ple::{dilated_conv_silu, hc_weights, ple_gate, signed_sqrt, PLE_EPS};
pub use qsa::{attend_rows, index_scores, layer_norm, topk_positions};
pub use rope::{mrope_axis, rope_mrope_interleaved, rope_neox, MropePositions};

/// Work (in multiply-adds) below which an op stays on the calling thread: a rayon fork costs a few
/// microseconds, about what 100k multiply-adds take on one core.
pub(crate) const PAR_MIN_WORK: usize = 1 << 17;

/// Compiles `$body` twice, once for the baseline target and once with AVX2 and FMA enabled, and picks the
/// second at run time when the CPU has them. The body must be plain arithmetic: without explicit
/// `mul_add` the compiler never fuses, so both versions compute bit-identical results; the fast one only
/// uses wider vectors (and a real FMA instruction where the body asks for `mul_add`).
/// Helpers called from the body must be `#[inline(always)]` to be compiled with the features.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? {
                    imp($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports every feature `fast` is compiled with.
                    return unsafe { fast($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// A raw output pointer shared by parallel tasks that write disjoint elements of one buffer
/// (tiles of a matrix, strided rows of a head). Every use states why its writes are disjoint.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: `SharedOut` is only a pointer; the tasks that share it write disjoint ranges (checked by
// `slice` against the buffer length, disjointness stated at each call site) and the buffer outlives them
// because the parallel section borrows it mutably for its whole duration.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub(crate) fn new(buf: &mut [f32]) -> Self {
        Self {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// The sub-slice `[start, start + len)` of the buffer.
    ///
    /// # Safety
    /// No other live reference (from any thread) may overlap this range while the slice is alive.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(
            start <= self.len && len <= self.len - start,
            "SharedOut range out of bounds"
        );
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// Sum of 8 lanes in a fixed tree order (the order a SIMD reduction uses), so every op that accumulates in
/// 8 lanes reduces them the same way.
#[inline(always)]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let s0 = a[0] + a[4];
    let s1 = a[1] + a[5];
    let s2 = a[2] + a[6];
    let s3 = a[3] + a[7];
    (s0 + s2) + (s1 + s3)
}

/// Sum of squares with 8 plain (unfused) lanes, then `hsum8`, then the tail in order.
#[inline(always)]
pub(crate) fn sum_sq(a: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut c = a.chunks_exact(8);
    for x in &mut c {
        for l in 0..8 {
            acc[l] += x[l] * x[l];
        }
    }
    let mut s = hsum8(&acc);
    for x in c.remainder() {
        s += x * x;
    }
    s
}
