//! The float8_e4m3fn byte codec, shared by the FP8 weights ([`crate::fp8`]) and the packed form
//! that carries them ([`crate::quant`]).

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
