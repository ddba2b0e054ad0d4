//! Serial f32 GEMM kernels shared by the ops: `NT` (both operands reduce along their contiguous rows, the
//! `Linear` layout) and `NN` (the right operand is `[k, n]` row-major). Strided rows let callers multiply
//! sub-matrices in place (one head of an interleaved `[t, heads, d]` buffer, a block of weights).
//!
//! Both kernels fix the reduction order of every output element independently of the tile it falls in:
//! - NT: 8 fused multiply-add lanes over the multiples of 8 (lane `l` takes `p ≡ l mod 8`, in order),
//!   `hsum8`, then the tail in order;
//! - NN: one fused multiply-add per `p`, in order.
//!
//! Each kernel has an AVX2+FMA version with explicit intrinsics (picked at run time) and a portable one;
//! they perform the same fused operations in the same order and agree bit for bit.

use super::hsum8;

/// Largest row group of a panel.
pub(crate) const MR_MAX: usize = 4;

/// Whether the AVX2 + FMA kernels can run (cached by the standard library after the first call).
#[inline(always)]
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

// ---------------------------------------------------------------------------------------------------
// NT: y[i, j] = Σ_p x[i·ldx + p] · w[j·ldw + p]
// ---------------------------------------------------------------------------------------------------

/// NT product of `mr ≤ 4` rows of `x` (stride `g.ldx`) with `g.ncols` rows of `w` (stride `g.ldw`),
/// rows of length `g.k ≥ 1`; row `i` of the result goes to `y[i][..g.ncols]`.
pub(crate) fn nt_panel(x: &[f32], w: &[f32], mr: usize, g: Geom, y: &mut [&mut [f32]; MR_MAX]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA.
        unsafe { nt_panel_avx2(x, w, mr, g, y) };
        return;
    }
    match mr {
        4 => nt_rows::<4, 3, false>(x, w, g, y),
        3 => nt_rows::<3, 4, false>(x, w, g, y),
        2 => nt_rows::<2, 4, false>(x, w, g, y),
        _ => nt_rows::<1, 8, false>(x, w, g, y),
    }
}

/// Floats of the right-hand operand a kernel sweeps before moving to the next row group: about 128 KiB,
/// so the block stays in L2 while every row group of the left operand passes over it.
const SWEEP_FLOATS: usize = 32 * 1024;

/// `y[i·y.ld + j] = Σ_p x[i·x.ld + p] · w[j·w.ld + p]` for `i < m`, `j < n` (serial). Rows of `w`
/// are taken in blocks of about `SWEEP_FLOATS` so each block is reused by all row groups of `x`.
pub(crate) fn gemm_nt(x: Mat<'_>, w: Mat<'_>, y: MatMut<'_>, m: usize, k: usize, n: usize) {
    if m == 0 || n == 0 {
        return;
    }
    let ldy = y.ld;
    assert!(ldy >= n, "gemm_nt: output stride shorter than a row");
    let nb = (SWEEP_FLOATS / k.max(1)).max(24) / 24 * 24;
    let mut j0 = 0;
    while j0 < n {
        let cols = nb.min(n - j0);
        let mut i = 0;
        for rows in y.data.chunks_mut(MR_MAX * ldy) {
            if i >= m {
                break;
            }
            let mr = (m - i).min(MR_MAX);
            let mut out: [&mut [f32]; MR_MAX] = Default::default();
            for (o, row) in out.iter_mut().zip(rows.chunks_mut(ldy)).take(mr) {
                *o = &mut row[j0..j0 + cols];
            }
            if k == 0 {
                out.iter_mut().for_each(|o| o.fill(0.0));
            } else {
                let g = Geom {
                    ldx: x.ld,
                    ldw: w.ld,
                    k,
                    ncols: cols,
                };
                nt_panel(&x.data[i * x.ld..], &w.data[j0 * w.ld..], mr, g, &mut out);
            }
            i += mr;
        }
        j0 += cols;
    }
}

/// A row-major operand read with row stride `ld` (possibly a sub-matrix of a larger buffer).
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) ld: usize,
}

impl<'a> Mat<'a> {
    pub(crate) fn new(data: &'a [f32], ld: usize) -> Self {
        Self { data, ld }
    }
}

/// A row-major output written with row stride `ld`.
pub(crate) struct MatMut<'a> {
    pub(crate) data: &'a mut [f32],
    pub(crate) ld: usize,
}

impl<'a> MatMut<'a> {
    pub(crate) fn new(data: &'a mut [f32], ld: usize) -> Self {
        Self { data, ld }
    }
}

/// The geometry of an NT panel: the row strides of `x` and `w`, the reduction length `k` and the
/// rows of `w` swept (`ncols`).
#[derive(Clone, Copy)]
pub(crate) struct Geom {
    pub(crate) ldx: usize,
    pub(crate) ldw: usize,
    pub(crate) k: usize,
    pub(crate) ncols: usize,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn nt_panel_avx2(x: &[f32], w: &[f32], mr: usize, g: Geom, y: &mut [&mut [f32]; MR_MAX]) {
    match mr {
        4 => nt_rows::<4, 3, true>(x, w, g, y),
        3 => nt_rows::<3, 4, true>(x, w, g, y),
        2 => nt_rows::<2, 4, true>(x, w, g, y),
        _ => nt_rows::<1, 8, true>(x, w, g, y),
    }
}

/// `MR` rows of `x` against the `ncols` rows of `w`, `NR` at a time, then one at a time.
#[inline(always)]
fn nt_rows<const MR: usize, const NR: usize, const AVX: bool>(
    x: &[f32],
    w: &[f32],
    g: Geom,
    y: &mut [&mut [f32]; MR_MAX],
) {
    let mut c = 0;
    while c + NR <= g.ncols {
        let tile = nt_tile::<MR, NR, AVX>(x, &w[c * g.ldw..], g);
        for (i, row) in tile.iter().enumerate() {
            y[i][c..c + NR].copy_from_slice(row);
        }
        c += NR;
    }
    while c < g.ncols {
        let tile = nt_tile::<MR, 1, AVX>(x, &w[c * g.ldw..], g);
        for (i, row) in tile.iter().enumerate() {
            y[i][c] = row[0];
        }
        c += 1;
    }
}

/// The `MR × NR` dot products of rows of `x` and `w`, in the NT reduction order.
#[inline(always)]
fn nt_tile<const MR: usize, const NR: usize, const AVX: bool>(
    x: &[f32],
    w: &[f32],
    g: Geom,
) -> [[f32; NR]; MR] {
    let k = g.k;
    let x = &x[..(MR - 1) * g.ldx + k];
    let w = &w[..(NR - 1) * g.ldw + k];
    #[cfg(target_arch = "x86_64")]
    let acc = if AVX {
        // SAFETY: AVX = true only inside `nt_panel_avx2` (AVX2 and FMA present); the slices above
        // hold every row the tile reads, which bounds every load.
        unsafe { nt_lanes_avx2::<MR, NR>(x, w, g) }
    } else {
        nt_lanes::<MR, NR>(x, w, g)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let acc = nt_lanes::<MR, NR>(x, w, g);
    let k8 = k / 8 * 8;
    let mut res = [[0f32; NR]; MR];
    for i in 0..MR {
        for j in 0..NR {
            let mut s = hsum8(&acc[i][j]);
            for q in k8..k {
                s = x[i * g.ldx + q].mul_add(w[j * g.ldw + q], s);
            }
            res[i][j] = s;
        }
    }
    res
}

/// The 8 lane sums of every tile output, in plain Rust.
#[inline(always)]
fn nt_lanes<const MR: usize, const NR: usize>(
    x: &[f32],
    w: &[f32],
    g: Geom,
) -> [[[f32; 8]; NR]; MR] {
    let mut acc = [[[0f32; 8]; NR]; MR];
    let mut p = 0;
    while p + 8 <= g.k {
        for j in 0..NR {
            let wv = &w[j * g.ldw + p..j * g.ldw + p + 8];
            for i in 0..MR {
                let xv = &x[i * g.ldx + p..i * g.ldx + p + 8];
                for l in 0..8 {
                    acc[i][j][l] = xv[l].mul_add(wv[l], acc[i][j][l]);
                }
            }
        }
        p += 8;
    }
    acc
}

/// The 8 lane sums of every tile output, one `__m256` accumulator per output.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `x` must hold `(MR−1)·ldx + k` floats and `w` `(NR−1)·ldw + k`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn nt_lanes_avx2<const MR: usize, const NR: usize>(
    x: &[f32],
    w: &[f32],
    g: Geom,
) -> [[[f32; 8]; NR]; MR] {
    use std::arch::x86_64::*;
    assert!(x.len() >= (MR - 1) * g.ldx + g.k && w.len() >= (NR - 1) * g.ldw + g.k);
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let mut p = 0;
    while p + 8 <= g.k {
        let mut xv = [_mm256_setzero_ps(); MR];
        for (i, v) in xv.iter_mut().enumerate() {
            // SAFETY: i·ldx + p + 8 ≤ (MR−1)·ldx + k ≤ x.len().
            *v = unsafe { _mm256_loadu_ps(xp.add(i * g.ldx + p)) };
        }
        for j in 0..NR {
            // SAFETY: j·ldw + p + 8 ≤ (NR−1)·ldw + k ≤ w.len().
            let wv = unsafe { _mm256_loadu_ps(wp.add(j * g.ldw + p)) };
            for i in 0..MR {
                acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
            }
        }
        p += 8;
    }
    let mut out = [[[0f32; 8]; NR]; MR];
    for i in 0..MR {
        for j in 0..NR {
            // SAFETY: `out[i][j]` holds 8 floats.
            unsafe { _mm256_storeu_ps(out[i][j].as_mut_ptr(), acc[i][j]) };
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------------
// NN: c[i, j] = Σ_p a[i·lda + p] · b[p·ldb + j]
// ---------------------------------------------------------------------------------------------------

/// Columns per NN tile (three 8-wide vectors).
const NN_COLS: usize = 24;

/// `c[i·c.ld + j] = Σ_p a[i·a.ld + p] · b[p·b.ld + j]` for `i < m`, `j < n`, one fused multiply-add
/// per `p` in order (serial).
pub(crate) fn gemm_nn(a: Mat<'_>, b: Mat<'_>, c: MatMut<'_>, m: usize, k: usize, n: usize) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA.
        unsafe { gemm_nn_avx2(a, b, c, m, k, n) };
        return;
    }
    gemm_nn_generic::<false>(a, b, c, m, k, n);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_nn_avx2(a: Mat<'_>, b: Mat<'_>, c: MatMut<'_>, m: usize, k: usize, n: usize) {
    gemm_nn_generic::<true>(a, b, c, m, k, n);
}

/// The geometry of an NN row group: the row strides of `a`, `b` and `c`, the reduction length `k`
/// of this sweep, the columns `n`, and whether the sums continue from the values in `c` (`acc`) or
/// start from zero.
#[derive(Clone, Copy)]
struct NnGeom {
    lda: usize,
    ldb: usize,
    ldc: usize,
    k: usize,
    n: usize,
    acc: bool,
}

/// Sweeps `b` in blocks of rows (about `SWEEP_FLOATS` floats each); every row group of `a` passes over a
/// block before the next, continuing its accumulators from `c`, so the order of each output's fused
/// multiply-adds stays `p = 0, 1, …, k−1`.
#[inline(always)]
fn gemm_nn_generic<const AVX: bool>(
    a: Mat<'_>,
    b: Mat<'_>,
    c: MatMut<'_>,
    m: usize,
    k: usize,
    n: usize,
) {
    let (lda, ldb, ldc) = (a.ld, b.ld, c.ld);
    let (a, b, c) = (a.data, b.data, c.data);
    assert!(ldc >= n, "gemm_nn: output stride shorter than a row");
    let kb = (SWEEP_FLOATS / n.max(1)).max(8);
    let mut p0 = 0;
    loop {
        let kk = kb.min(k - p0);
        let g = NnGeom {
            lda,
            ldb,
            ldc,
            k: kk,
            n,
            acc: p0 > 0,
        };
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(MR_MAX);
            let ai = &a[i * lda + p0..];
            let bp = &b[p0 * ldb..];
            let ci = &mut c[i * ldc..];
            match mr {
                4 => nn_rows::<4, AVX>(ai, bp, ci, g),
                3 => nn_rows::<3, AVX>(ai, bp, ci, g),
                2 => nn_rows::<2, AVX>(ai, bp, ci, g),
                _ => nn_rows::<1, AVX>(ai, bp, ci, g),
            }
            i += mr;
        }
        p0 += kk;
        if p0 >= k {
            break;
        }
    }
}

/// `MR` rows of `c`: column blocks of 24, then 8, then single columns. With `g.acc`, the sums
/// continue from the values in `c`; otherwise they start from zero.
#[inline(always)]
fn nn_rows<const MR: usize, const AVX: bool>(a: &[f32], b: &[f32], c: &mut [f32], g: NnGeom) {
    let NnGeom {
        lda,
        ldb,
        ldc,
        k,
        n,
        acc,
    } = g;
    let a = &a[..(MR - 1) * lda + k];
    let mut j = 0;
    while j + NN_COLS <= n {
        nn_tile::<MR, 3, AVX>(a, &b[j..], &mut c[j..], g);
        j += NN_COLS;
    }
    while j + 8 <= n {
        nn_tile::<MR, 1, AVX>(a, &b[j..], &mut c[j..], g);
        j += 8;
    }
    while j < n {
        for i in 0..MR {
            let mut s = if acc { c[i * ldc + j] } else { 0.0 };
            for p in 0..k {
                s = a[i * lda + p].mul_add(b[p * ldb + j], s);
            }
            c[i * ldc + j] = s;
        }
        j += 1;
    }
}

/// An `MR × 8·NV` tile of `c` (columns from the start of `b` and `c`), continuing from `c` with
/// `g.acc`.
#[inline(always)]
fn nn_tile<const MR: usize, const NV: usize, const AVX: bool>(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    g: NnGeom,
) {
    let NnGeom {
        lda,
        ldb,
        ldc,
        k,
        acc,
        ..
    } = g;
    if k == 0 {
        if !acc {
            for i in 0..MR {
                c[i * ldc..i * ldc + 8 * NV].fill(0.0);
            }
        }
        return;
    }
    let b = &b[..(k - 1) * ldb + 8 * NV];
    let c = &mut c[..(MR - 1) * ldc + 8 * NV];
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: AVX = true only under `gemm_nn_avx2` (AVX2 and FMA present); the slices hold every
        // element the tile touches.
        unsafe { nn_tile_avx2::<MR, NV>(a, b, c, g) };
        return;
    }
    let mut sums = [[[0f32; 8]; NV]; MR];
    if acc {
        for i in 0..MR {
            for v in 0..NV {
                sums[i][v].copy_from_slice(&c[i * ldc + 8 * v..i * ldc + 8 * v + 8]);
            }
        }
    }
    for p in 0..k {
        for v in 0..NV {
            let bv = &b[p * ldb + 8 * v..p * ldb + 8 * v + 8];
            for i in 0..MR {
                let av = a[i * lda + p];
                for l in 0..8 {
                    sums[i][v][l] = av.mul_add(bv[l], sums[i][v][l]);
                }
            }
        }
    }
    for i in 0..MR {
        for v in 0..NV {
            c[i * ldc + 8 * v..i * ldc + 8 * v + 8].copy_from_slice(&sums[i][v]);
        }
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA; `a` must hold `(MR−1)·lda + k` floats, `b` `(k−1)·ldb + 8·NV`
/// and `c` `(MR−1)·ldc + 8·NV`, with `k ≥ 1` (the sizes of `g`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn nn_tile_avx2<const MR: usize, const NV: usize>(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    g: NnGeom,
) {
    let NnGeom {
        lda,
        ldb,
        ldc,
        k,
        acc: acc_in,
        ..
    } = g;
    use std::arch::x86_64::*;
    assert!(k >= 1);
    assert!(a.len() >= (MR - 1) * lda + k);
    assert!(b.len() >= (k - 1) * ldb + 8 * NV);
    assert!(c.len() >= (MR - 1) * ldc + 8 * NV);
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    let mut acc = [[_mm256_setzero_ps(); NV]; MR];
    if acc_in {
        for (i, row) in acc.iter_mut().enumerate() {
            for (v, r) in row.iter_mut().enumerate() {
                // SAFETY: i·ldc + 8v + 8 ≤ (MR−1)·ldc + 8·NV ≤ c.len().
                *r = unsafe { _mm256_loadu_ps(cp.add(i * ldc + 8 * v)) };
            }
        }
    }
    for p in 0..k {
        let mut bv = [_mm256_setzero_ps(); NV];
        for (v, r) in bv.iter_mut().enumerate() {
            // SAFETY: p·ldb + 8v + 8 ≤ (k−1)·ldb + 8·NV ≤ b.len().
            *r = unsafe { _mm256_loadu_ps(bp.add(p * ldb + 8 * v)) };
        }
        for i in 0..MR {
            // SAFETY: i·lda + p < (MR−1)·lda + k ≤ a.len().
            let av = _mm256_set1_ps(unsafe { *ap.add(i * lda + p) });
            for v in 0..NV {
                acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
            }
        }
    }
    for i in 0..MR {
        for v in 0..NV {
            // SAFETY: i·ldc + 8v + 8 ≤ (MR−1)·ldc + 8·NV ≤ c.len().
            unsafe { _mm256_storeu_ps(cp.add(i * ldc + 8 * v), acc[i][v]) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The NT order written out: 8 fused lanes, `hsum8`, the tail.
    fn nt_ref(x: &[f32], w: &[f32], k: usize) -> f32 {
        let mut lanes = [0f32; 8];
        let k8 = k / 8 * 8;
        for p in 0..k8 {
            lanes[p % 8] = x[p].mul_add(w[p], lanes[p % 8]);
        }
        let mut s = hsum8(&lanes);
        for p in k8..k {
            s = x[p].mul_add(w[p], s);
        }
        s
    }

    /// `gemm` of the `[m, k]` operands `(values, row stride)` into an `[m, ldc]` output that starts
    /// all NaN.
    fn run(
        gemm: fn(Mat<'_>, Mat<'_>, MatMut<'_>, usize, usize, usize),
        (a, lda): (&[f32], usize),
        (b, ldb): (&[f32], usize),
        ldc: usize,
        (m, k, n): (usize, usize, usize),
    ) -> Vec<f32> {
        let mut c = vec![f32::NAN; m * ldc];
        gemm(
            Mat::new(a, lda),
            Mat::new(b, ldb),
            MatMut::new(&mut c, ldc),
            m,
            k,
            n,
        );
        c
    }

    /// Asserts `c[i·ldc + j]` is `want(i, j)` bit for bit for every `i < m`, `j < n`.
    fn assert_bits(
        c: &[f32],
        ldc: usize,
        (m, k, n): (usize, usize, usize),
        want: impl Fn(usize, usize) -> f32,
    ) {
        for i in 0..m {
            for j in 0..n {
                assert_eq!(
                    c[i * ldc + j].to_bits(),
                    want(i, j).to_bits(),
                    "m={m} k={k} n={n} at {i},{j}"
                );
            }
        }
    }

    #[test]
    fn nt_follows_its_reduction_order_exactly() {
        for (m, k, n, ldx, ldw) in [
            (1, 1, 1, 1, 1),
            (5, 13, 30, 20, 13),
            (7, 64, 9, 64, 70),
            (3, 700, 101, 700, 700),
        ] {
            let x = data((m - 1) * ldx + k, 1);
            let w = data((n - 1) * ldw + k, 2);
            let ldy = n + 3;
            let y = run(gemm_nt, (&x, ldx), (&w, ldw), ldy, (m, k, n));
            assert_bits(&y, ldy, (m, k, n), |i, j| {
                nt_ref(&x[i * ldx..i * ldx + k], &w[j * ldw..j * ldw + k], k)
            });
            for i in 0..m {
                assert!(
                    y[i * ldy + n..(i + 1) * ldy].iter().all(|v| v.is_nan()),
                    "wrote past n"
                );
            }
        }
    }

    #[test]
    fn nn_follows_its_reduction_order_exactly() {
        // k larger than one sweep block (32 Ki floats / n) exercises the accumulate path.
        for (m, k, n, lda, ldb) in [
            (1, 1, 1, 1, 1),
            (5, 13, 30, 13, 31),
            (6, 3000, 33, 3000, 40),
            (2, 9, 8, 9, 8),
        ] {
            let a = data((m - 1) * lda + k, 3);
            let b = data((k - 1) * ldb + n, 4);
            let ldc = n + 2;
            let c = run(gemm_nn, (&a, lda), (&b, ldb), ldc, (m, k, n));
            assert_bits(&c, ldc, (m, k, n), |i, j| {
                let mut s = 0f32;
                for p in 0..k {
                    s = a[i * lda + p].mul_add(b[p * ldb + j], s);
                }
                s
            });
        }
    }

    #[test]
    fn portable_and_simd_kernels_agree_bit_for_bit() {
        let (m, k, n) = (7, 77, 53);
        let x = data(m * k, 5);
        let w = data(n * k, 6);
        let b = data(k * n, 7);
        let g = Geom {
            ldx: k,
            ldw: k,
            k,
            ncols: n,
        };
        let run_nt = |simd: bool| {
            let mut y = vec![0f32; m * n];
            let mut i = 0;
            for rows in y.chunks_mut(MR_MAX * n) {
                let mr = (m - i).min(MR_MAX);
                let mut out: [&mut [f32]; MR_MAX] = Default::default();
                for (o, row) in out.iter_mut().zip(rows.chunks_mut(n)) {
                    *o = row;
                }
                let xi = &x[i * k..];
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: only reached when the CPU has AVX2 and FMA (checked by the caller).
                    unsafe { nt_panel_avx2(xi, &w, mr, g, &mut out) };
                    i += mr;
                    continue;
                }
                let _ = simd;
                match mr {
                    4 => nt_rows::<4, 3, false>(xi, &w, g, &mut out),
                    3 => nt_rows::<3, 4, false>(xi, &w, g, &mut out),
                    2 => nt_rows::<2, 4, false>(xi, &w, g, &mut out),
                    _ => nt_rows::<1, 8, false>(xi, &w, g, &mut out),
                }
                i += mr;
            }
            y
        };
        let run_nn = |simd: bool| {
            let mut c = vec![0f32; m * n];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: only reached when the CPU has AVX2 and FMA (checked by the caller).
                unsafe {
                    gemm_nn_avx2(
                        Mat::new(&x, k),
                        Mat::new(&b, n),
                        MatMut::new(&mut c, n),
                        m,
                        k,
                        n,
                    )
                };
                return c;
            }
            let _ = simd;
            gemm_nn_generic::<false>(
                Mat::new(&x, k),
                Mat::new(&b, n),
                MatMut::new(&mut c, n),
                m,
                k,
                n,
            );
            c
        };
        if !has_avx2_fma() {
            eprintln!("no AVX2+FMA on this CPU: only the portable kernels ran");
            return;
        }
        assert_eq!(run_nt(true), run_nt(false));
        assert_eq!(run_nn(true), run_nn(false));
    }
}
