//! Row-wide numeric passes over logits, organised around blocks of [`BLOCK`] consecutive ids.
//!
//! A row is ~250k values per token, so the sampler reads it in as few passes as it can: one pass yields
//! the maximum of every block, one more the sum of exponentials of every block. Later stages consult the
//! block summaries and touch only the blocks that can matter (the argmax block, the blocks holding the
//! top-k, the block the draw lands in).
//!
//! Each pass is a fixed-width lane loop the compiler vectorises, with a branch-free `exp` (Cody–Waite
//! reduction and a degree-6 polynomial, within a few ulp on the range used) instead of scalar libm calls.
//! On x86-64 CPUs with AVX2 the two full-row passes run the same arithmetic eight lanes wide (no FMA,
//! so results are bit-identical to the portable build).

/// Ids per block.
pub(crate) const BLOCK: usize = 128;
/// Lane width of the accumulating loops.
const LANES: usize = 8;

/// Weight levels `2^-j` (given as `j`) whose cumulative mass [`block_exp_sums`] can report: the mass of
/// all tokens with `(z - shift) · scale >= -j · ln 2`.
pub(crate) const LEVELS: [f32; 5] = [6.0, 12.0, 20.0, 32.0, 64.0];
/// Mass at or above each of [`LEVELS`].
pub(crate) type LevelMass = [f64; LEVELS.len()];

/// `e^x` for `x <= 0`; values below `-87` (where `e^x` is under `f32::MIN_POSITIVE`), `-inf` and NaN give 0.
#[inline(always)]
pub(crate) fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5·2^23 rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = if x > -87.0 { x } else { -87.0 };
    let xc = if xc < 0.0 { xc } else { 0.0 };
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    // Wrapping ops: no overflow is possible here, and unchecked arithmetic keeps the loop vectorised.
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let y = p * scale;
    if x > -87.0 {
        y
    } else {
        0.0
    }
}

/// The largest value (NaN ignored); `-inf` for an empty slice.
#[inline(always)]
pub(crate) fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(rest) {
        m = if v > m { v } else { m };
    }
    m
}

/// Block `b` of `row` (empty past the end).
pub(crate) fn block(row: &[f32], b: usize) -> &[f32] {
    let start = (b * BLOCK).min(row.len());
    &row[start..(start + BLOCK).min(row.len())]
}

#[inline(always)]
fn block_maxima_inline(row: &[f32], maxima: &mut Vec<f32>) -> f32 {
    maxima.clear();
    let mut m = f32::NEG_INFINITY;
    for block in row.chunks(BLOCK) {
        let bm = max(block);
        maxima.push(bm);
        m = if bm > m { bm } else { m };
    }
    m
}

#[inline(always)]
fn block_exp_sums_inline<const WITH_LEVELS: bool>(
    row: &[f32],
    shift: f32,
    scale: f32,
    sums: &mut Vec<f32>,
    levels: &mut LevelMass,
) -> f64 {
    const NL: usize = LEVELS.len();
    let thresholds = LEVELS.map(|j| -j * std::f32::consts::LN_2);
    sums.clear();
    *levels = [0.0; NL];
    let mut total = 0.0f64;
    for block in row.chunks(BLOCK) {
        let mut acc = [0.0f32; LANES];
        let mut lacc = [[0.0f32; LANES]; NL];
        let lanes = block.chunks_exact(LANES);
        let rest = lanes.remainder();
        for c in lanes {
            for j in 0..LANES {
                let x = (c[j] - shift) * scale;
                let w = exp_nonpos(x);
                acc[j] += w;
                if WITH_LEVELS {
                    for l in 0..NL {
                        lacc[l][j] += if x >= thresholds[l] { w } else { 0.0 };
                    }
                }
            }
        }
        let mut s: f32 = acc.iter().sum();
        for &z in rest {
            let x = (z - shift) * scale;
            let w = exp_nonpos(x);
            s += w;
            if WITH_LEVELS {
                for l in 0..NL {
                    lacc[l][0] += if x >= thresholds[l] { w } else { 0.0 };
                }
            }
        }
        if WITH_LEVELS {
            for l in 0..NL {
                levels[l] += lacc[l].iter().sum::<f32>() as f64;
            }
        }
        sums.push(s);
        total += s as f64;
    }
    total
}

/// Writes the maximum of every block of `row` into `maxima` and returns the row's maximum.
pub(crate) fn block_maxima(row: &[f32], maxima: &mut Vec<f32>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(row: &[f32], maxima: &mut Vec<f32>) -> f32 {
            block_maxima_inline(row, maxima)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(row, maxima) };
        }
    }
    block_maxima_inline(row, maxima)
}

/// Writes `Σ e^((x - shift) · scale)` of every block into `sums` and returns the total (`shift` at
/// least the row's maximum); with `levels`, also the mass at or above each of [`LEVELS`].
pub(crate) fn block_exp_sums(
    row: &[f32],
    shift: f32,
    scale: f32,
    sums: &mut Vec<f32>,
    levels: Option<&mut LevelMass>,
) -> f64 {
    let mut unused = [0.0; LEVELS.len()];
    let with_levels = levels.is_some();
    let levels = levels.unwrap_or(&mut unused);
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(
            row: &[f32],
            shift: f32,
            scale: f32,
            sums: &mut Vec<f32>,
            levels: &mut LevelMass,
            with: bool,
        ) -> f64 {
            if with {
                block_exp_sums_inline::<true>(row, shift, scale, sums, levels)
            } else {
                block_exp_sums_inline::<false>(row, shift, scale, sums, levels)
            }
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(row, shift, scale, sums, levels, with_levels) };
        }
    }
    if with_levels {
        block_exp_sums_inline::<true>(row, shift, scale, sums, levels)
    } else {
        block_exp_sums_inline::<false>(row, shift, scale, sums, levels)
    }
}

/// Recomputes the maxima of the blocks holding `ids` after sparse edits (all blocks when there are many).
pub(crate) fn refresh_maxima(
    row: &[f32],
    maxima: &mut [f32],
    ids: impl ExactSizeIterator<Item = u32>,
) {
    if ids.len() * 4 >= maxima.len() {
        for (m, block) in maxima.iter_mut().zip(row.chunks(BLOCK)) {
            *m = max(block);
        }
        return;
    }
    for id in ids {
        let b = id as usize / BLOCK;
        if let Some(m) = maxima.get_mut(b) {
            *m = max(block(row, b));
        }
    }
}

/// Index of the first occurrence of the maximum `m`, found through the block maxima.
pub(crate) fn position_of_max(row: &[f32], maxima: &[f32], m: f32) -> Option<usize> {
    let b = maxima.iter().position(|&x| x == m)?;
    block(row, b)
        .iter()
        .position(|&x| x == m)
        .map(|i| b * BLOCK + i)
}

/// `ln Σ e^x` over the row; `None` when no value is finite (nothing to normalise) or one is `+inf`.
pub(crate) fn log_sum_exp(xs: &[f32]) -> Option<f32> {
    let mut maxima = Vec::new();
    let m = block_maxima(xs, &mut maxima);
    if !m.is_finite() {
        return None;
    }
    let total = block_exp_sums(xs, m, 1.0, &mut maxima, None);
    Some(m + total.ln() as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm_to_a_few_ulp() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = (x as f64).exp();
            let got = exp_nonpos(x) as f64;
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "x={x} got={got} want={want}"
            );
            x -= 0.001_37;
        }
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-0.0), 1.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos(f32::NAN), 0.0);
        assert_eq!(exp_nonpos(-1000.0), 0.0);
    }

    fn test_row() -> Vec<f32> {
        (0..5000)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.01 - 3.0)
            .collect()
    }

    #[test]
    fn block_maxima_and_first_position() {
        let mut xs: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32).collect();
        xs[5] = f32::NAN;
        let mut maxima = Vec::new();
        let m = block_maxima(&xs, &mut maxima);
        assert_eq!(m, 100.0);
        assert_eq!(maxima.len(), 1000usize.div_ceil(BLOCK));
        for (b, &bm) in maxima.iter().enumerate() {
            let block = &xs[b * BLOCK..((b + 1) * BLOCK).min(1000)];
            assert_eq!(
                bm,
                block
                    .iter()
                    .cloned()
                    .filter(|x| !x.is_nan())
                    .fold(f32::MIN, f32::max)
            );
        }
        let first = xs.iter().position(|&x| x == 100.0);
        assert_eq!(position_of_max(&xs, &maxima, m), first);
        // Raise one value in a late block and lower the old maximum: the refreshed blocks agree.
        xs[900] = 500.0;
        xs[first.unwrap()] = -1.0;
        refresh_maxima(
            &xs,
            &mut maxima,
            [900u32, first.unwrap() as u32].into_iter(),
        );
        assert_eq!(max(&maxima), 500.0);
        assert_eq!(position_of_max(&xs, &maxima, 500.0), Some(900));
        assert_eq!(max(&[f32::NAN; 9]), f32::NEG_INFINITY);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn dispatched_passes_match_the_portable_code_bit_for_bit() {
        let xs = test_row();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert_eq!(block_maxima(&xs, &mut a), block_maxima_inline(&xs, &mut b));
        assert_eq!(a, b);
        let m = max(&xs);
        let (mut la, mut lb) = ([0.0; LEVELS.len()], [0.0; LEVELS.len()]);
        let ta = block_exp_sums(&xs, m, 1.3, &mut a, Some(&mut la));
        let tb = block_exp_sums_inline::<true>(&xs, m, 1.3, &mut b, &mut lb);
        assert_eq!((ta, &a, la), (tb, &b, lb));
    }

    #[test]
    fn block_sums_agree_with_direct_evaluation() {
        let xs = test_row();
        let m = max(&xs);
        let mut sums = Vec::new();
        let mut levels = [0.0; LEVELS.len()];
        let total = block_exp_sums(&xs, m, 1.0 / 0.7, &mut sums, Some(&mut levels));
        assert_eq!(
            block_exp_sums(&xs, m, 1.0 / 0.7, &mut Vec::new(), None),
            total
        );
        for (l, &j) in LEVELS.iter().enumerate() {
            let want: f64 = xs
                .iter()
                .map(|&x| (x - m) / 0.7)
                .filter(|&x| x >= -j * std::f32::consts::LN_2)
                .map(|x| (x as f64).exp())
                .sum();
            assert!((levels[l] - want).abs() < 1e-5 * want.max(1.0), "level {j}");
        }
        let want: f64 = xs.iter().map(|&x| ((x - m) as f64 / 0.7).exp()).sum();
        assert!((total - want).abs() / want < 1e-6);
        assert_eq!(sums.len(), xs.len().div_ceil(BLOCK));
        for (b, &s) in sums.iter().enumerate() {
            let want: f64 = xs[b * BLOCK..((b + 1) * BLOCK).min(xs.len())]
                .iter()
                .map(|&x| ((x - m) as f64 / 0.7).exp())
                .sum();
            assert!((s as f64 - want).abs() < 1e-5 * want.max(1.0));
        }
        let lse = log_sum_exp(&xs).unwrap();
        let want_lse = m as f64 + xs.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
        assert!((lse as f64 - want_lse).abs() < 1e-5);
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 4]), None);
    }
}
