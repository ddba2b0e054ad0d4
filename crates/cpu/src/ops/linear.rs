//! `matmul_t`: the PyTorch `Linear` product `y = x · wᵀ` in f32.
//!
//! Both operands keep their natural layout (`x: [t, k]`, `w: [n, k]`, reduction axis contiguous), so
//! every output is a dot product of two contiguous rows, computed by the NT kernel of `gemm.rs` in
//! register tiles of up to 4 rows of `x` by 3–8 rows of `w`.
//!
//! Every output element is reduced in exactly the same order whatever the tile it falls in (8 fused
//! lanes over the multiples of 8, `hsum8`, then the tail in order), so the result is batch-invariant and
//! independent of the thread count.
//!
//! Blocking: a task owns `T_BLOCK` rows of `x` and `n_block(k)` rows of `w` (about 256 KiB, L2-resident);
//! inside it each micro-panel of `MR` rows of `x` (L1-resident) sweeps the task's rows of `w`.

use rayon::prelude::*;

use std::ops::Range;

use super::gemm::{nt_panel, Geom, MR_MAX};
use super::{SharedOut, PAR_MIN_WORK};

/// Rows of `x` per task.
const T_BLOCK: usize = 64;

/// Rows of `w` per task: about 64 Ki floats (256 KiB) of weights, a multiple of 24 (every `NR` divides it).
fn n_block(k: usize) -> usize {
    let rows = (64 * 1024 / k.max(1)).max(24);
    rows / 24 * 24
}

/// `y[s, o] = Σ_i x[s, i] · w[o, i]`.
///
/// `x`: `[t, k]`; `w`: `[n, k]` (PyTorch `Linear.weight` layout); `y`: `[t, n]`, overwritten.
/// Multi-threaded over (row block, weight block) tiles when the product is large.
pub fn matmul_t(x: &[f32], w: &[f32], t: usize, k: usize, n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), t * k, "matmul_t: x must be [t, k]");
    assert_eq!(w.len(), n * k, "matmul_t: w must be [n, k]");
    assert_eq!(y.len(), t * n, "matmul_t: y must be [t, n]");
    if t == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    let nb = n_block(k);
    let tasks_n = n.div_ceil(nb);
    let tasks_t = t.div_ceil(T_BLOCK);
    let out = SharedOut::new(y);
    let run = |task: usize| {
        let (ti, ni) = (task / tasks_n, task % tasks_n);
        let (t0, n0) = (ti * T_BLOCK, ni * nb);
        let (t1, n1) = ((t0 + T_BLOCK).min(t), (n0 + nb).min(n));
        // SAFETY: task (ti, ni) writes only y[t0..t1, n0..n1]; distinct tasks own disjoint tiles, and `y`
        // stays mutably borrowed by this function until every task has finished.
        unsafe { block(x, w, k, n, t0..t1, n0..n1, out) };
    };
    let tasks = tasks_t * tasks_n;
    if tasks == 1 || t * n * k < PAR_MIN_WORK {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Computes `y[rows, cols]` (`y` is `[t, n]`).
///
/// # Safety
/// No other thread may access that tile of `out` meanwhile.
unsafe fn block(
    x: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out: SharedOut,
) {
    let wb = &w[cols.start * k..cols.end * k];
    let g = Geom {
        ldx: k,
        ldw: k,
        k,
        ncols: cols.len(),
    };
    let mut r = rows.start;
    while r < rows.end {
        let mr = (rows.end - r).min(MR_MAX);
        let mut dst: [&mut [f32]; MR_MAX] = Default::default();
        for (i, row) in dst.iter_mut().take(mr).enumerate() {
            // SAFETY: row r + i, columns `cols` lie inside this block's tile, which the caller owns.
            *row = unsafe { out.slice((r + i) * n + cols.start, cols.len()) };
        }
        nt_panel(&x[r * k..(r + mr) * k], wb, mr, g, &mut dst);
        r += mr;
    }
}
