//! The number formats of QSA's index-key cache: bf16 rounding of the per-token scale and fp8 e4m3
//! ("fn": no infinities, max 448, 0x7F/0xFF NaN) of the scaled key, both round to nearest even.

/// Largest finite e4m3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// `x` rounded to bf16 (nearest even), as its 16 bits.
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// The f32 value of bf16 bits.
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `x` as fp8 e4m3 (nearest even, saturating at ±448; NaN stays NaN).
pub fn fp8_e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    // Exponent of the quantum: values below the smallest normal 2^-6 share the subnormal quantum 2^-9.
    let e = if a < 2f32.powi(-6) {
        -6
    } else {
        ((a.to_bits() >> 23) as i32 - 127).min(8)
    };
    let q = 2f32.powi(e - 3);
    let r = ((a / q).round_ties_even() * q).min(FP8_E4M3_MAX);
    if r == 0.0 {
        return sign;
    }
    if r < 2f32.powi(-6) {
        return sign | (r / 2f32.powi(-9)) as u8;
    }
    let e = (r.to_bits() >> 23) as i32 - 127;
    let m = (r / 2f32.powi(e) * 8.0) as i32 - 8;
    sign | (((e + 7) as u8) << 3) | m as u8
}

/// The f32 value of an fp8 e4m3 byte (the one decoder, shared with FP8 checkpoints).
pub use sanmai_weights::fp8::fp8_e4m3_to_f32 as fp8_e4m3_decode;

/// One index-key cache entry of `k` (`dI` values): `dI` fp8 bytes of `k / s` followed by the bf16
/// scale `s = bf16(max|k| / 448)` (1 when that is 0) little-endian; `out` has `dI + 2` bytes.
pub fn quantize_index_key(k: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        k.len() + 2,
        "quantize_index_key: out must be dI + 2 bytes"
    );
    let amax = k.iter().fold(0f32, |m, x| m.max(x.abs()));
    let mut s = bf16_bits(amax / FP8_E4M3_MAX);
    if bf16_value(s) == 0.0 {
        s = bf16_bits(1.0);
    }
    let sv = bf16_value(s);
    for (o, x) in out.iter_mut().zip(k) {
        *o = fp8_e4m3_encode(x / sv);
    }
    out[k.len()..].copy_from_slice(&s.to_le_bytes());
}

/// The dequantised key `k̂ = k8 · s` of an entry written by [`quantize_index_key`].
pub fn dequantize_index_key(entry: &[u8], out: &mut [f32]) {
    let d = out.len();
    assert_eq!(
        entry.len(),
        d + 2,
        "dequantize_index_key: entry must be dI + 2 bytes"
    );
    let s = bf16_value(u16::from_le_bytes([entry[d], entry[d + 1]]));
    for (o, &b) in out.iter_mut().zip(&entry[..d]) {
        *o = fp8_e4m3_decode(b) * s;
    }
}
