//! Packed integer weights in the compressed-tensors `pack-quantized` layout, and this project's INT6
//! gapless layout.
//!
//! A quantized Linear `X` of shape `[out, in]` is stored as `X.weight_packed` (int32 words, row-major,
//! `out` rows of [`words_per_row`] words), `X.weight_scale` (`[out, in/group]` or `[out, 1]`, any float
//! dtype, used as f32) and `X.weight_shape` (`[out, in]`). Values are symmetric integers `q` stored
//! unsigned as `q + 2^(b−1)` and packed LSB-first along the input dimension:
//! - INT4: 8 values per word, value `j` at bits `[4(j%8), 4(j%8)+4)` of word `j/8`; rows padded to 8.
//! - INT8: 4 values per word, likewise; rows padded to 4.
//! - INT6 gapless: each row zero-padded to a multiple of 32 values; every 32 values fill 6 words, value
//!   `j` at bits `[6j, 6j+6)` of the row's little-endian bit stream (it may straddle two words).
//!
//! The weight is `w[r, j] = q[r, j] · scale[r, j / group]` (`group` = `in` for channel scales).

use std::borrow::Cow;

use rayon::prelude::*;
use sanmai_config::QuantScheme;

use crate::{Init, Result, WeightError};

/// The int32 words of a packed tensor: owned, or little-endian bytes borrowed from an mmapped file.
#[derive(Debug, Clone)]
pub enum PackedWords<'a> {
    Owned(Vec<u32>),
    Bytes(&'a [u8]),
}

/// A quantized weight matrix kept in its packed form.
#[derive(Debug, Clone)]
pub struct PackedTensor<'a> {
    pub name: String,
    /// 4, 6 (gapless) or 8.
    pub bits: u32,
    /// Inputs per scale; 0 = one scale per output row.
    pub group_size: usize,
    /// Output rows (for a fused 3-D expert tensor `[E, n, k]`: `E·n`).
    pub out_features: usize,
    pub in_features: usize,
    /// `out_features · words_per_row(bits, in_features)` words.
    pub packed: PackedWords<'a>,
    /// `out_features · scale_cols(group_size, in_features)` scales, row-major.
    pub scales: Vec<f32>,
    /// The codes are float8_e4m3fn bytes (`bits` 8, one byte a value in the INT8 word layout), the
    /// value `fp8(code) · scale` (a block-scaled FP8 checkpoint's Linear, its block scales repeated
    /// per row, see [`crate::fp8::packed`]); otherwise offset integers.
    pub fp8: bool,
}

/// Int32 words of one packed row of `in_features` values.
pub fn words_per_row(bits: u32, in_features: usize) -> usize {
    match bits {
        6 => in_features.div_ceil(32) * 6,
        b => in_features.div_ceil((32 / b) as usize),
    }
}

/// Bytes of the bf16 workspace the CUDA backend's packed prefill GEMM dequantises weight tiles into
/// (allocated with its first packed weight).
pub const PACKED_WORKSPACE_BYTES: usize = 32 << 20;

/// Whether the CUDA backend's packed kernels take a `[_, k]` matrix of `bits` with `group_size`
/// (0 = per row); a packed weight they do not take is dequantised to bf16 on the device.
pub fn packed_fits(bits: u32, group_size: usize, k: usize) -> bool {
    let step = match bits {
        4 | 8 => 32,
        6 => 8,
        _ => return false,
    };
    k > 0 && k.is_multiple_of(step) && group_size.is_multiple_of(8)
}

/// Scales per row: one per group of `group_size` inputs (the last group may be short), or 1.
pub fn scale_cols(group_size: usize, in_features: usize) -> usize {
    if group_size == 0 {
        1
    } else {
        in_features.div_ceil(group_size)
    }
}

/// The offset that makes a signed value unsigned: `2^(bits−1)`.
pub fn offset(bits: u32) -> i32 {
    1 << (bits - 1)
}

/// Packs signed values `q` (`[out, in]`, each in `[−2^(b−1), 2^(b−1))`) into words.
pub fn pack(q: &[i8], out_features: usize, in_features: usize, bits: u32) -> Vec<u32> {
    let wpr = words_per_row(bits, in_features);
    let mut words = vec![0u32; out_features * wpr];
    let off = offset(bits);
    let mask = (1u32 << bits) - 1;
    for (r, row) in words.chunks_mut(wpr.max(1)).enumerate().take(out_features) {
        for j in 0..in_features {
            let code = ((q[r * in_features + j] as i32 + off) as u32) & mask;
            let (w, s) = bit_pos(bits, j);
            row[w] |= code << s;
            if s + bits > 32 {
                row[w + 1] |= code >> (32 - s);
            }
        }
    }
    words
}

/// Word index and bit shift of value `j` within its row.
#[inline]
fn bit_pos(bits: u32, j: usize) -> (usize, u32) {
    if bits == 6 {
        let b = 6 * j;
        (b / 32, (b % 32) as u32)
    } else {
        let per = (32 / bits) as usize;
        (j / per, (j % per) as u32 * bits)
    }
}

/// The unsigned code of value `j` of a row.
#[inline]
fn code_at(row: &[u32], bits: u32, j: usize) -> u32 {
    let (w, s) = bit_pos(bits, j);
    let mut v = row[w] >> s;
    if s + bits > 32 {
        v |= row[w + 1] << (32 - s);
    }
    v & ((1u32 << bits) - 1)
}

fn check_bits(name: &str, bits: u32) -> Result<()> {
    if matches!(bits, 4 | 6 | 8) {
        Ok(())
    } else {
        Err(WeightError::Quant {
            name: name.into(),
            message: format!("{bits}-bit weights are not served (4, 6, 8)"),
        })
    }
}

impl<'a> PackedTensor<'a> {
    /// Builds a packed tensor after checking that the word and scale counts fit the shape.
    pub fn new(
        name: &str,
        scheme: QuantScheme,
        out_features: usize,
        in_features: usize,
        packed: PackedWords<'a>,
        scales: Vec<f32>,
    ) -> Result<Self> {
        check_bits(name, scheme.bits)?;
        let t = PackedTensor {
            name: name.into(),
            bits: scheme.bits,
            group_size: scheme.group_size,
            out_features,
            in_features,
            packed,
            scales,
            fp8: false,
        };
        let words = match &t.packed {
            PackedWords::Owned(w) => w.len(),
            PackedWords::Bytes(b) if b.len() % 4 == 0 => b.len() / 4,
            PackedWords::Bytes(b) => {
                return Err(t.err(format!("{} packed bytes: not whole int32 words", b.len())))
            }
        };
        if words != out_features * t.words_per_row() {
            return Err(t.err(format!(
                "{words} packed words, expected {out_features} rows × {} words for {in_features} \
                 inputs at {} bits",
                t.words_per_row(),
                t.bits
            )));
        }
        if t.scales.len() != out_features * t.scale_cols() {
            return Err(t.err(format!(
                "{} scales, expected {out_features} × {}",
                t.scales.len(),
                t.scale_cols()
            )));
        }
        Ok(t)
    }

    fn err(&self, message: String) -> WeightError {
        WeightError::Quant {
            name: self.name.clone(),
            message,
        }
    }

    pub fn scheme(&self) -> QuantScheme {
        QuantScheme {
            bits: self.bits,
            group_size: self.group_size,
        }
    }

    pub fn words_per_row(&self) -> usize {
        words_per_row(self.bits, self.in_features)
    }

    pub fn scale_cols(&self) -> usize {
        scale_cols(self.group_size, self.in_features)
    }

    /// Inputs per scale (`in_features` for channel scales).
    pub fn group_len(&self) -> usize {
        if self.group_size == 0 {
            self.in_features.max(1)
        } else {
            self.group_size
        }
    }

    /// The packed words.
    pub fn words(&self) -> Cow<'_, [u32]> {
        match &self.packed {
            PackedWords::Owned(w) => Cow::Borrowed(w),
            PackedWords::Bytes(b) => Cow::Owned(
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
        }
    }

    /// The packed words as little-endian bytes (what a device upload copies).
    pub fn packed_bytes(&self) -> Cow<'_, [u8]> {
        match &self.packed {
            PackedWords::Bytes(b) => Cow::Borrowed(b),
            PackedWords::Owned(w) => Cow::Owned(w.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
    }

    /// Bytes of packed words plus f32 scales.
    pub fn nbytes(&self) -> usize {
        4 * (self.out_features * self.words_per_row() + self.scales.len())
    }

    /// The signed integers `q`, `[out, in]` row-major (for FP8 codes: the bytes as `i8`, not values).
    pub fn unpack(&self) -> Vec<i8> {
        let words = self.words();
        let (wpr, k) = (self.words_per_row(), self.in_features);
        let off = offset(self.bits);
        let mut q = vec![0i8; self.out_features * k];
        if k == 0 {
            return q;
        }
        q.par_chunks_mut(k).enumerate().for_each(|(r, out)| {
            let row = &words[r * wpr..(r + 1) * wpr];
            for (j, v) in out.iter_mut().enumerate() {
                *v = (code_at(row, self.bits, j) as i32 - off) as i8;
            }
        });
        q
    }

    /// The weight values `q · scale` as f32, `[out, in]` row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let words = self.words();
        let (wpr, k, sc, g) = (
            self.words_per_row(),
            self.in_features,
            self.scale_cols(),
            self.group_len(),
        );
        let off = offset(self.bits);
        let lut: Vec<f32> = (0..=255u8).map(crate::e4m3::fp8_e4m3_to_f32).collect();
        let mut w = vec![0f32; self.out_features * k];
        if k == 0 {
            return w;
        }
        w.par_chunks_mut(k).enumerate().for_each(|(r, out)| {
            let row = &words[r * wpr..(r + 1) * wpr];
            let scales = &self.scales[r * sc..(r + 1) * sc];
            for (j, v) in out.iter_mut().enumerate() {
                let code = code_at(row, self.bits, j);
                let q = if self.fp8 {
                    lut[code as usize]
                } else {
                    (code as i32 - off) as f32
                };
                *v = q * scales[j / g];
            }
        });
        w
    }
}

/// Symmetric max-abs quantization as compressed-tensors computes it: per group (or row)
/// `scale = max|w| / ((2^b − 1) / 2)`, `q = clamp(round_half_even(w / scale), −2^(b−1), 2^(b−1) − 1)`.
pub fn quantize(
    name: &str,
    w: &[f32],
    out_features: usize,
    in_features: usize,
    scheme: QuantScheme,
) -> Result<PackedTensor<'static>> {
    check_bits(name, scheme.bits)?;
    if w.len() != out_features * in_features {
        return Err(WeightError::Shape {
            name: name.into(),
            expected: vec![out_features, in_features],
            found: vec![w.len()],
        });
    }
    let g = if scheme.group_size == 0 {
        in_features.max(1)
    } else {
        scheme.group_size
    };
    let sc = scale_cols(scheme.group_size, in_features);
    let half_range = ((1u32 << scheme.bits) - 1) as f32 / 2.0;
    let (qmin, qmax) = (
        -offset(scheme.bits) as f32,
        (offset(scheme.bits) - 1) as f32,
    );
    let mut scales = vec![0f32; out_features * sc];
    let mut q = vec![0i8; w.len()];
    for r in 0..out_features {
        for c in 0..sc {
            let (a, b) = (
                r * in_features + c * g,
                r * in_features + ((c + 1) * g).min(in_features),
            );
            let amax = w[a..b].iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = if amax > 0.0 { amax / half_range } else { 1.0 };
            scales[r * sc + c] = s;
            for i in a..b {
                q[i] = (w[i] / s).round_ties_even().clamp(qmin, qmax) as i8;
            }
        }
    }
    let words = pack(&q, out_features, in_features, scheme.bits);
    PackedTensor::new(
        name,
        scheme,
        out_features,
        in_features,
        PackedWords::Owned(words),
        scales,
    )
}

/// The module a weight tensor of `shape` belongs to and whether it is a Linear, for the tensors a
/// quantization scheme may cover: 2-D `X.weight` (an embedding is no Linear) and the fused 3-D routed
/// experts `…experts.gate_up_proj` / `…experts.down_proj`. Anything else (norms, convs, biases) is `None`.
pub fn quant_module<'n>(name: &'n str, shape: &[usize]) -> Option<(&'n str, bool)> {
    match shape.len() {
        2 => {
            let module = name.strip_suffix(".weight")?;
            Some((module, !module.ends_with("embed_tokens")))
        }
        3 if name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") => {
            Some((name, true))
        }
        _ => None,
    }
}

pub(crate) fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Random packed weights for a dummy source, deterministic in `seed`: codes uniform over the symmetric
/// range `[−(2^(b−1)−1), 2^(b−1)−1]` (INT4/INT8 map the one extra negative code to 0), all scales equal so
/// the values have the standard deviation `init` asks for around 0 (Linear weights; a `Random` mean is
/// not applied), and `Const(c)` makes every value exactly `c`.
pub fn random_packed(
    seed: u64,
    name: &str,
    shape: &[usize],
    scheme: QuantScheme,
    init: Init,
) -> Result<PackedTensor<'static>> {
    check_bits(name, scheme.bits)?;
    let k = *shape.last().unwrap_or(&0);
    let n: usize = shape[..shape.len().saturating_sub(1)].iter().product();
    let wpr = words_per_row(scheme.bits, k);
    let mut words = vec![0u32; n * wpr];
    let sc = scale_cols(scheme.group_size, k);
    let m = (offset(scheme.bits) - 1) as f64;
    let scale = match init {
        Init::Const(c) => {
            // q = 1 everywhere: the code is offset + 1 in every slot.
            let one = vec![1i8; k];
            let row = pack(&one, 1, k, scheme.bits);
            words
                .par_chunks_mut(wpr.max(1))
                .for_each(|r| r.copy_from_slice(&row));
            c
        }
        Init::Random { std, .. } => {
            let q_var = if scheme.bits == 6 {
                2.0 * m * (m + 1.0) * (2.0 * m + 1.0) / 6.0 / (2.0 * m + 1.0)
            } else {
                2.0 * m * (m + 1.0) * (2.0 * m + 1.0) / 6.0 / (1u64 << scheme.bits) as f64
            };
            let bits = scheme.bits;
            words
                .par_chunks_mut(wpr.max(1))
                .enumerate()
                .for_each(|(r, row)| {
                    let mut s = seed.wrapping_add((r as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
                    match bits {
                        4 | 8 => {
                            let (lsb, msb_shift) = if bits == 4 {
                                (0x1111_1111u32, 3)
                            } else {
                                (0x0101_0101u32, 7)
                            };
                            for w in row.iter_mut() {
                                let mut x = splitmix(&mut s) as u32;
                                // Code 0 (q = −2^(b−1)) becomes the zero code 2^(b−1).
                                let mut t = x;
                                for i in 1..bits {
                                    t |= x >> i;
                                }
                                x |= (!t & lsb) << msb_shift;
                                *w = x;
                            }
                            // Padding slots past `k` hold zeros by convention.
                            let per = (32 / bits) as usize;
                            if !k.is_multiple_of(per) {
                                let last = row.len() - 1;
                                row[last] &= (1u32 << ((k % per) as u32 * bits)) - 1;
                            }
                        }
                        _ => {
                            let q: Vec<i8> = (0..k)
                                .map(|_| ((splitmix(&mut s) >> 32) % 63) as i8 - 31)
                                .collect();
                            row.copy_from_slice(&pack(&q, 1, k, 6));
                        }
                    }
                });
            (std as f64 / q_var.sqrt()) as f32
        }
    };
    PackedTensor::new(
        name,
        scheme,
        n,
        k,
        PackedWords::Owned(words),
        vec![scale; n * sc],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheme(bits: u32, group_size: usize) -> QuantScheme {
        QuantScheme { bits, group_size }
    }

    #[test]
    fn pack_unpack_round_trip_all_formats() {
        for (bits, k) in [(4, 64), (4, 13), (8, 40), (8, 7), (6, 32), (6, 45), (6, 1)] {
            let n = 3;
            let lo = -offset(bits);
            let span = 2 * offset(bits);
            let q: Vec<i8> = (0..n * k)
                .map(|i| (lo + ((i * 7 + 3) as i32 % span)) as i8)
                .collect();
            let words = pack(&q, n, k, bits);
            assert_eq!(words.len(), n * words_per_row(bits, k));
            let t = PackedTensor::new(
                "w",
                scheme(bits, 0),
                n,
                k,
                PackedWords::Owned(words),
                vec![0.5; n],
            )
            .unwrap();
            assert_eq!(t.unpack(), q, "bits {bits} k {k}");
            let d = t.dequantize();
            for (a, b) in d.iter().zip(&q) {
                assert_eq!(*a, *b as f32 * 0.5);
            }
        }
    }

    #[test]
    fn int6_gapless_bit_positions() {
        // Value j = code j+1 at bits [6j, 6j+6): value 5 straddles words 0 and 1 (bits 30..36).
        let q: Vec<i8> = (0..32).map(|j| (j + 1 - 32) as i8).collect();
        let words = pack(&q, 1, 32, 6);
        assert_eq!(words.len(), 6);
        let mut stream: u128 = 0;
        for (i, w) in words.iter().take(4).enumerate() {
            stream |= (*w as u128) << (32 * i);
        }
        for j in 0..21 {
            assert_eq!(((stream >> (6 * j)) & 63) as usize, j + 1);
        }
        // INT4: value j at nibble j of the word.
        let q4: Vec<i8> = (0..8).map(|j| j - 8).collect();
        assert_eq!(pack(&q4, 1, 8, 4), vec![0x7654_3210]);
    }

    #[test]
    fn quantize_then_dequantize_is_close() {
        let (n, k) = (5, 256);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        for (bits, g, tol) in [(4, 128, 0.08), (8, 0, 0.005), (6, 0, 0.02), (4, 32, 0.08)] {
            let t = quantize("w", &w, n, k, scheme(bits, g)).unwrap();
            let d = t.dequantize();
            let err = w
                .iter()
                .zip(&d)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err < tol, "bits {bits} g {g}: {err}");
        }
    }

    #[test]
    fn new_checks_counts() {
        let e = PackedTensor::new(
            "x.weight",
            scheme(4, 0),
            2,
            16,
            PackedWords::Owned(vec![0; 3]),
            vec![1.0; 2],
        )
        .unwrap_err();
        assert!(e.to_string().contains("x.weight"));
        assert!(PackedTensor::new(
            "x",
            scheme(4, 8),
            2,
            16,
            PackedWords::Owned(vec![0; 4]),
            vec![1.0; 2],
        )
        .is_err());
        assert!(PackedTensor::new(
            "x",
            scheme(5, 0),
            1,
            8,
            PackedWords::Owned(vec![0; 2]),
            vec![1.0],
        )
        .is_err());
    }

    #[test]
    fn random_packed_has_requested_spread_and_no_extreme_code() {
        for (bits, std) in [(4u32, 0.05f32), (8, 0.02), (6, 0.1)] {
            let t = random_packed(9, "w", &[64, 130], scheme(bits, 0), Init::std(std)).unwrap();
            let q = t.unpack();
            assert!(q.iter().all(|&v| v as i32 > -offset(bits)));
            let d = t.dequantize();
            let mean = d.iter().sum::<f32>() / d.len() as f32;
            let var = d.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / d.len() as f32;
            assert!(
                (var.sqrt() / std - 1.0).abs() < 0.05,
                "bits {bits}: {}",
                var.sqrt()
            );
            assert!(mean.abs() < 0.05 * std, "bits {bits}: mean {mean}");
            // Padding slots hold zero codes.
            let words = t.words();
            let wpr = t.words_per_row();
            if bits != 6 {
                let per = 32 / bits as usize;
                let used = (130 % per) as u32 * bits;
                assert_eq!(words[wpr - 1] >> used, 0);
            }
        }
        let c = random_packed(1, "w", &[2, 3, 8], scheme(8, 0), Init::Const(0.25)).unwrap();
        assert_eq!(c.out_features, 6);
        assert!(c.dequantize().iter().all(|&v| v == 0.25));
    }
}
