//! Block-scaled FP8 weights (the `quant_method: fp8` releases, see [`sanmai_config::Fp8Config`]): a
//! Linear's `weight` is float8_e4m3fn bytes and its `weight_scale_inv` one f32 per block; the weight is
//! `fp8(q) · scale_inv[block]`, computed here in f32 exactly so.

use sanmai_config::Fp8Config;

/// The value of a float8_e4m3fn byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; no
/// infinities, `S.1111.111` is NaN.
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    sign * if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// The float8_e4m3fn byte nearest `x` (ties to the even code, magnitudes past 448 saturate to
/// ±448, NaN to the NaN code).
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    // The non-negative codes 0x00..=0x7e are increasing in value.
    let a = x.abs();
    let (mut lo, mut hi) = (0u8, 0x7e);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fp8_e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let below = lo;
    let code = match below {
        0x7e => 0x7e,
        _ => {
            let (l, h) = (fp8_e4m3_to_f32(below), fp8_e4m3_to_f32(below + 1));
            match (a - l).total_cmp(&(h - a)) {
                std::cmp::Ordering::Less => below,
                std::cmp::Ordering::Greater => below + 1,
                std::cmp::Ordering::Equal if below % 2 == 0 => below,
                std::cmp::Ordering::Equal => below + 1,
            }
        }
    };
    code | if x.is_sign_negative() && code != 0 {
        0x80
    } else {
        0
    }
}

/// `w` (shape `[.., rows, cols]`) as an FP8 checkpoint stores it, in f32: each block scaled so its
/// largest magnitude is 448, rounded to the nearest e4m3 value, scaled back. What `--load-format
/// dummy` gives for an FP8 config's converted Linears.
pub fn round_blocks(w: &mut [f32], shape: &[usize], cfg: &Fp8Config) {
    let (rows, cols) = rows_cols(shape);
    let [br, bc] = cfg.block;
    for mat in w.chunks_mut(rows * cols) {
        for r0 in (0..rows).step_by(br) {
            for c0 in (0..cols).step_by(bc) {
                let (r1, c1) = ((r0 + br).min(rows), (c0 + bc).min(cols));
                let amax = (r0..r1)
                    .flat_map(|r| mat[r * cols + c0..r * cols + c1].iter())
                    .fold(0f32, |m, v| m.max(v.abs()));
                let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                for r in r0..r1 {
                    for v in &mut mat[r * cols + c0..r * cols + c1] {
                        *v = fp8_e4m3_to_f32(f32_to_fp8_e4m3(*v / scale)) * scale;
                    }
                }
            }
        }
    }
}

/// The f32 weight of FP8 bytes `q` of shape `[.., rows, cols]` (leading dims: stacked experts) with
/// scales `[.., ceil(rows / br), ceil(cols / bc)]` for blocks `cfg.block = [br, bc]`.
pub fn dequantize(q: &[u8], scales: &[f32], shape: &[usize], cfg: &Fp8Config) -> Vec<f32> {
    let lut: Vec<f32> = (0..=255u8).map(fp8_e4m3_to_f32).collect();
    let (rows, cols) = rows_cols(shape);
    let [sr, sc] = cfg.scale_shape(rows, cols);
    let [br, bc] = cfg.block;
    let mut out = Vec::with_capacity(q.len());
    for (m, mat) in q.chunks(rows * cols).enumerate() {
        let s = &scales[m * sr * sc..(m + 1) * sr * sc];
        for (r, row) in mat.chunks(cols).enumerate() {
            let srow = &s[(r / br) * sc..(r / br + 1) * sc];
            out.extend(
                row.iter()
                    .enumerate()
                    .map(|(c, &b)| lut[b as usize] * srow[c / bc]),
            );
        }
    }
    out
}

/// The last two dims of `shape` (a 1-D shape is one row).
pub fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape {
        [] => (1, 1),
        [c] => (1, *c),
        [.., r, c] => (*r, *c),
    }
}

/// The expected shape of the scales of an FP8 weight of `shape`.
pub fn scale_shape(shape: &[usize], cfg: &Fp8Config) -> Vec<usize> {
    let (rows, cols) = rows_cols(shape);
    let lead = &shape[..shape.len().saturating_sub(2)];
    let mut s = lead.to_vec();
    s.extend(cfg.scale_shape(rows, cols));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_picks_the_nearest_code_and_round_trips_every_code() {
        for b in 0..=255u8 {
            let x = fp8_e4m3_to_f32(b);
            if x.is_nan() {
                continue;
            }
            let back = f32_to_fp8_e4m3(x);
            assert_eq!(fp8_e4m3_to_f32(back), x, "code {b:#04x}");
        }
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1000.0)), 448.0);
        assert_eq!(fp8_e4m3_to_f32(f32_to_fp8_e4m3(-1000.0)), -448.0);
        // Between 1.0 and 1.125 (codes 0x38, 0x39): nearest, the tie to the even code.
        assert_eq!(f32_to_fp8_e4m3(1.05), 0x38);
        assert_eq!(f32_to_fp8_e4m3(1.07), 0x39);
        assert_eq!(f32_to_fp8_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_fp8_e4m3(-1.07), 0xb9);
    }

    #[test]
    fn rounded_blocks_are_fp8_values_times_one_scale_a_block() {
        let cfg = Fp8Config {
            block: [2, 3],
            not_converted: Vec::new(),
        };
        let shape = [2, 5, 4];
        let mut w: Vec<f32> = (0..40)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.013)
            .collect();
        let orig = w.clone();
        round_blocks(&mut w, &shape, &cfg);
        // Rounding again changes nothing, and each value moved by at most half an e4m3 step.
        let mut again = w.clone();
        round_blocks(&mut again, &shape, &cfg);
        assert_eq!(again, w);
        for (a, b) in w.iter().zip(&orig) {
            assert!((a - b).abs() <= b.abs() / 16.0 + 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn e4m3_bytes_decode_as_the_format_defines() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0); // exponent 7, mantissa 0
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0); // the largest finite
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(fp8_e4m3_to_f32(0x3c), 1.5);
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
        assert!(fp8_e4m3_to_f32(0xff).is_nan());
        // Every finite byte decodes to a value that torch's float8_e4m3fn holds: 8 per binade.
        for b in 0..=255u8 {
            let v = fp8_e4m3_to_f32(b);
            assert!(v.is_nan() || v.abs() <= 448.0, "{b:#x} {v}");
        }
    }

    #[test]
    fn each_block_takes_its_scale_and_edge_blocks_are_partial() {
        let cfg = Fp8Config {
            block: [2, 3],
            not_converted: Vec::new(),
        };
        // Two stacked [3, 4] matrices: scale grids of [2, 2] each.
        let shape = [2, 3, 4];
        assert_eq!(scale_shape(&shape, &cfg), vec![2, 2, 2]);
        let q = vec![0x38u8; 24]; // every weight 1.0
        let scales: Vec<f32> = (1..=8).map(|x| x as f32).collect();
        let w = dequantize(&q, &scales, &shape, &cfg);
        #[rustfmt::skip]
        let want = [
            1., 1., 1., 2.,  1., 1., 1., 2.,  3., 3., 3., 4.,
            5., 5., 5., 6.,  5., 5., 5., 6.,  7., 7., 7., 8.,
        ];
        assert_eq!(w, want);
    }
}
