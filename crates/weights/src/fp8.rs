//! Block-scaled FP8 weights (the `quant_method: fp8` releases, see [`sanmai_config::Fp8Config`]): a
//! Linear's `weight` is float8_e4m3fn bytes and its `weight_scale_inv` one f32 per block; the weight is
//! `fp8(q) · scale_inv[block]`, computed here in f32 exactly so.

use rayon::prelude::*;
use sanmai_config::Fp8Config;

pub use crate::e4m3::{f32_to_fp8_e4m3, fp8_e4m3_to_f32};
use crate::quant::{splitmix, words_per_row, PackedTensor, PackedWords};
use crate::{Init, Result, WeightError};

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

/// Whether the CUDA backend's FP8 kernels take a `[_, k]` FP8 weight with blocks of `group` columns
/// (whole 16-byte chunks of a row, each inside one group); one they do not take is dequantised to
/// bf16 on the device. The rule lives with the format so a plan made without a GPU counts the same
/// bytes.
pub fn device_fits(group: usize, k: usize) -> bool {
    k > 0 && k.is_multiple_of(16) && group > 0 && group.is_multiple_of(16)
}

/// The FP8 weight `name` (bytes `q`, shape `[.., rows, cols]`, leading dims stacked experts, with
/// block scales `[.., ceil(rows / br), ceil(cols / bc)]`) in the packed form a backend consumes
/// directly: `bits` 8 with `fp8` set, one code byte a value in rows of `cols` bytes (borrowed when
/// `cols % 4 == 0`, else copied into rows padded to whole u32 words), and the block scales repeated
/// per row: `scales[r, g] = scale_inv[r / br, g]` for groups of `bc` columns (`group_size = bc`).
/// Repeating them per row is what lets a loader reorder or split rows (Qwen3-Next's grouped
/// `in_proj_qkvz`, fused gate|up, 3-D experts) exactly as it does for packed integers; it costs 4
/// bytes per `bc` weights. [`PackedTensor::dequantize`] gives exactly [`dequantize`]'s values.
pub fn packed<'a>(
    name: &str,
    q: &'a [u8],
    block_scales: &[f32],
    shape: &[usize],
    cfg: &Fp8Config,
) -> Result<PackedTensor<'a>> {
    let (rows, cols) = rows_cols(shape);
    let mats: usize = shape[..shape.len().saturating_sub(2)].iter().product();
    let [sr, sc] = cfg.scale_shape(rows, cols);
    let [br, bc] = cfg.block;
    let err = |message: String| WeightError::Quant {
        name: name.into(),
        message,
    };
    if q.len() != mats * rows * cols {
        return Err(err(format!("{} FP8 bytes for shape {shape:?}", q.len())));
    }
    if block_scales.len() != mats * sr * sc {
        return Err(err(format!(
            "{} block scales, expected {mats} × {sr} × {sc}",
            block_scales.len()
        )));
    }
    let n = mats * rows;
    let mut scales = Vec::with_capacity(n * sc);
    for m in 0..mats {
        for r in 0..rows {
            let at = (m * sr + r / br) * sc;
            scales.extend_from_slice(&block_scales[at..at + sc]);
        }
    }
    let packed = if cols % 4 == 0 {
        PackedWords::Bytes(q)
    } else {
        let wpr = words_per_row(8, cols);
        let mut words = vec![0u32; n * wpr];
        for (row, out) in q.chunks(cols).zip(words.chunks_mut(wpr)) {
            for (j, &b) in row.iter().enumerate() {
                out[j / 4] |= (b as u32) << (8 * (j % 4));
            }
        }
        PackedWords::Owned(words)
    };
    Ok(PackedTensor {
        name: name.into(),
        bits: 8,
        group_size: bc,
        out_features: n,
        in_features: cols,
        packed,
        scales,
        fp8: true,
    })
}

/// Random FP8 weights of `shape` for a dummy source, deterministic in `seed`: random code bytes (the
/// NaN codes replaced by ±448), the first value of every block ±448 (as a
/// quantizer scaling each block by its largest magnitude / 448 leaves it), and every block scale
/// chosen so the values have the standard deviation `init` asks for around 0. `None` for a constant
/// `init` (the caller rounds those values itself).
pub fn random_packed(
    seed: u64,
    name: &str,
    shape: &[usize],
    cfg: &Fp8Config,
    init: Init,
) -> Result<Option<PackedTensor<'static>>> {
    let Init::Random { std, .. } = init else {
        return Ok(None);
    };
    let (rows, cols) = rows_cols(shape);
    let mats: usize = shape[..shape.len().saturating_sub(2)].iter().product();
    let [_, sc] = cfg.scale_shape(rows, cols);
    let [br, bc] = cfg.block;
    // Codes 0..=0x7d once each and 0x7e twice in 128 draws (the NaN code 0x7f becomes 0x7e).
    let ms = (0..=0x7eu8)
        .map(|b| (fp8_e4m3_to_f32(b) as f64).powi(2) * if b == 0x7e { 2.0 } else { 1.0 })
        .sum::<f64>()
        / 128.0;
    let scale = (std as f64 / ms.sqrt()) as f32;
    let wpr = words_per_row(8, cols);
    let mut words = vec![0u32; mats * rows * wpr];
    words
        .par_chunks_mut(wpr.max(1))
        .enumerate()
        .for_each(|(r, row)| {
            let mut s = seed.wrapping_add((r as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
            for pair in row.chunks_mut(2) {
                let v = splitmix(&mut s);
                for (i, w) in pair.iter_mut().enumerate() {
                    let w0 = (v >> (32 * i)) as u32;
                    // Bytes whose low 7 bits are 0x7f (NaN) get their lowest bit cleared: exact, as
                    // a byte of x = w & 0x7f7f7f7f plus 1 carries into bit 7 only at 0x7f.
                    let nan = ((w0 & 0x7f7f_7f7f) + 0x0101_0101) & 0x8080_8080;
                    *w = w0 ^ (nan >> 7);
                }
            }
            // Padding past `cols` (rows of a multiple of 4 bytes) holds zeros.
            if cols % 4 != 0 {
                row[wpr - 1] &= (1u32 << (8 * (cols % 4))) - 1;
            }
            if (r % rows) % br == 0 {
                for j in (0..cols).step_by(bc) {
                    let sh = 8 * (j % 4);
                    row[j / 4] = (row[j / 4] & !(0x7f << sh)) | (0x7e << sh);
                }
            }
        });
    Ok(Some(PackedTensor {
        name: name.into(),
        bits: 8,
        group_size: bc,
        out_features: mats * rows,
        in_features: cols,
        packed: PackedWords::Owned(words),
        scales: vec![scale; mats * rows * sc],
        fp8: true,
    }))
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

    #[test]
    fn packed_form_dequantises_as_the_oracle() {
        let cfg = Fp8Config {
            block: [2, 4],
            not_converted: vec![],
        };
        // [3, 6] (rows padded to whole words), [4, 8] (bytes borrowed), [2, 3, 8] (stacked experts).
        for shape in [vec![3, 6], vec![4, 8], vec![2, 3, 8]] {
            let n: usize = shape.iter().product();
            let q: Vec<u8> = (0..n).map(|i| ((i * 37 + 11) % 255) as u8 & 0xf7).collect();
            let s_len: usize = scale_shape(&shape, &cfg).iter().product();
            let scales: Vec<f32> = (0..s_len).map(|i| 0.25 + i as f32).collect();
            let p = packed("w", &q, &scales, &shape, &cfg).unwrap();
            assert!(p.fp8 && p.bits == 8 && p.group_size == 4);
            let want = dequantize(&q, &scales, &shape, &cfg);
            let got = p.dequantize();
            assert_eq!(got.len(), want.len());
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            assert_eq!(
                p.nbytes(),
                4 * (p.out_features * p.words_per_row() + p.scales.len())
            );
        }
        assert!(packed("w", &[0; 5], &[1.0; 4], &[3, 6], &cfg).is_err());
    }

    #[test]
    fn random_fp8_weights_have_the_asked_spread_and_full_blocks() {
        let cfg = Fp8Config {
            block: [128, 128],
            not_converted: vec![],
        };
        let std = 0.02f32;
        let p = random_packed(3, "w", &[300, 160], &cfg, Init::std(std))
            .unwrap()
            .unwrap();
        assert!(p.fp8);
        let w = p.dequantize();
        assert!(w.iter().all(|v| v.is_finite()));
        let rms = (w.iter().map(|v| (v * v) as f64).sum::<f64>() / w.len() as f64).sqrt();
        assert!((rms as f32 / std - 1.0).abs() < 0.1, "rms {rms}");
        // Each block's first value is ±448 times its scale.
        for (r, c) in [(0, 0), (0, 128), (128, 0), (256, 128)] {
            assert_eq!(w[r * 160 + c].abs(), 448.0 * p.scales[0]);
        }
        assert!(random_packed(3, "w", &[4, 16], &cfg, Init::ZEROS)
            .unwrap()
            .is_none());
    }
}
