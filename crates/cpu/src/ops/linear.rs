//! `matmul_t`: the PyTorch `Linear` product `y = x · wᵀ` in f32.
//!
//! Both operands keep their natural layout (`x: [t, k]`, `w: [n, k]`, reduction axis contiguous), so
//! every output is a dot product of two contiguous rows. The kernel computes an `MR × NR` tile of such
//! dot products at once, each in 8 fused multiply-add lanes, which the compiler turns into SIMD
//! registers; the tile shares every loaded row of `x` across `NR` rows of `w` and vice versa.
//!
//! Every output element is reduced in exactly the same order whatever the tile it falls in (8 lanes over
//! the multiples of 8, `hsum8`, then the tail in order), so the result is batch-invariant and independent
//! of the thread count.
//!
//! Blocking: a task owns `T_BLOCK` rows of `x` and `n_block(k)` rows of `w` (about 256 KiB, L2-resident);
//! inside it each micro-panel of `MR` rows of `x` (L1-resident) sweeps the task's rows of `w`.

use rayon::prelude::*;

use super::{hsum8, multiversion, SharedOut, PAR_MIN_WORK};

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
        unsafe { block(x, w, k, n, t0, t1, n0, n1, out) };
    };
    let tasks = tasks_t * tasks_n;
    if tasks == 1 || t * n * k < PAR_MIN_WORK {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Computes `y[t0..t1, n0..n1]`.
///
/// # Safety
/// No other thread may access that tile of `out` meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    x: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
    t0: usize,
    t1: usize,
    n0: usize,
    n1: usize,
    out: SharedOut,
) {
    let wb = &w[n0 * k..n1 * k];
    let cols = n1 - n0;
    let mut r = t0;
    while r < t1 {
        let mr = (t1 - r).min(4);
        let xb = &x[r * k..(r + mr) * k];
        // SAFETY (for every `slice` below): rows r..r+mr, columns n0..n1 lie inside this block's tile.
        let mut rows: [&mut [f32]; 4] = Default::default();
        for (i, row) in rows.iter_mut().take(mr).enumerate() {
            *row = unsafe { out.slice((r + i) * n + n0, cols) };
        }
        match mr {
            4 => panel4(xb, wb, k, &mut rows),
            3 => panel3(xb, wb, k, &mut rows),
            2 => panel2(xb, wb, k, &mut rows),
            _ => panel1(xb, wb, k, &mut rows),
        }
        r += mr;
    }
}

multiversion! {
    fn panel4(x: &[f32], w: &[f32], k: usize, y: &mut [&mut [f32]; 4]) {
        panel::<4, 3>(x, w, k, y)
    }
}
multiversion! {
    fn panel3(x: &[f32], w: &[f32], k: usize, y: &mut [&mut [f32]; 4]) {
        panel::<3, 4>(x, w, k, y)
    }
}
multiversion! {
    fn panel2(x: &[f32], w: &[f32], k: usize, y: &mut [&mut [f32]; 4]) {
        panel::<2, 4>(x, w, k, y)
    }
}
multiversion! {
    fn panel1(x: &[f32], w: &[f32], k: usize, y: &mut [&mut [f32]; 4]) {
        panel::<1, 8>(x, w, k, y)
    }
}

/// `MR` rows of `x` against every row of `w` (`NR` at a time, then one at a time for the remainder).
/// `y[i]` is the output row of `x` row `i`, restricted to the columns of `w`.
#[inline(always)]
fn panel<const MR: usize, const NR: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    y: &mut [&mut [f32]; 4],
) {
    let cols = w.len() / k;
    let mut c = 0;
    while c + NR <= cols {
        let tile = tile::<MR, NR>(x, &w[c * k..(c + NR) * k], k);
        for (i, row) in tile.iter().enumerate() {
            y[i][c..c + NR].copy_from_slice(row);
        }
        c += NR;
    }
    while c < cols {
        let tile = tile::<MR, 1>(x, &w[c * k..(c + 1) * k], k);
        for (i, row) in tile.iter().enumerate() {
            y[i][c] = row[0];
        }
        c += 1;
    }
}

/// The `MR × NR` dot products of `MR` rows of `x` with `NR` rows of `w` (rows of length `k`).
#[inline(always)]
fn tile<const MR: usize, const NR: usize>(x: &[f32], w: &[f32], k: usize) -> [[f32; NR]; MR] {
    let x = &x[..MR * k];
    let w = &w[..NR * k];
    let k8 = k / 8 * 8;
    let mut acc = [[[0f32; 8]; NR]; MR];
    let mut p = 0;
    while p < k8 {
        let mut xv = [[0f32; 8]; MR];
        for (i, v) in xv.iter_mut().enumerate() {
            *v = x[i * k + p..i * k + p + 8].try_into().unwrap_or([0.0; 8]);
        }
        for j in 0..NR {
            let wv: [f32; 8] = w[j * k + p..j * k + p + 8].try_into().unwrap_or([0.0; 8]);
            for i in 0..MR {
                for l in 0..8 {
                    acc[i][j][l] = xv[i][l].mul_add(wv[l], acc[i][j][l]);
                }
            }
        }
        p += 8;
    }
    let mut res = [[0f32; NR]; MR];
    for i in 0..MR {
        for j in 0..NR {
            let mut s = hsum8(&acc[i][j]);
            for q in k8..k {
                s = x[i * k + q].mul_add(w[j * k + q], s);
            }
            res[i][j] = s;
        }
    }
    res
}
