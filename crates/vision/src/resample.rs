//! Bicubic resampling of 8-bit RGB images, byte for byte as Pillow's `Image.resize(size,
//! Image.BICUBIC)` computes it (`libImaging/Resample.c`), which is what transformers' PIL-backend
//! image processors call (and what torchvision's antialiased uint8 resize was built to match):
//!
//! - the filter is Keys' cubic with `a = −0.5`, support 2, widened by the scale when shrinking
//!   (antialiasing);
//! - each output pixel's weights are computed in f64 around the centre `(x + 0.5)·scale`, over the
//!   input pixels from `trunc(centre − support + 0.5)` to `trunc(centre + support + 0.5)` (clamped),
//!   normalised to sum 1, then rounded to fixed point with 22 fractional bits;
//! - the horizontal pass runs first (over only the rows the vertical pass reads), each sum starting at
//!   one half and clipped to 0..=255 after the shift; then the vertical pass, the same way.
//!
//! A pass whose size does not change is skipped, as Pillow skips it.

const PRECISION_BITS: u32 = 32 - 8 - 2;
const SUPPORT: f64 = 2.0;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One axis: for each output index, the first input index and the fixed-point weights.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn coeffs(in_size: usize, out_size: usize) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = SUPPORT * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) truncates toward zero.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize - xmin;
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(xmax) {
            let w = bicubic((x as f64 + xmin as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for (x, &kx) in k.iter().enumerate().take(xmax) {
            let w = if ww != 0.0 { kx / ww } else { kx };
            let f = w * (1u32 << PRECISION_BITS) as f64;
            weights[xx * ksize + x] = if w < 0.0 {
                (f - 0.5) as i32
            } else {
                (f + 0.5) as i32
            };
        }
        bounds.push((xmin, xmax));
    }
    Coeffs {
        ksize,
        bounds,
        weights,
    }
}

fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `src` is `h × w` RGB (row-major, 3 bytes a pixel); returns `out_h × out_w` RGB.
pub fn resize_rgb(src: &[u8], h: usize, w: usize, out_h: usize, out_w: usize) -> Vec<u8> {
    assert_eq!(src.len(), h * w * 3, "an RGB image of {h}x{w}");
    let vert = coeffs(h, out_h);
    let (first, last) = match (vert.bounds.first(), vert.bounds.last()) {
        (Some(f), Some(l)) => (f.0, l.0 + l.1),
        _ => return Vec::new(),
    };
    let half = 1i32 << (PRECISION_BITS - 1);
    // Horizontal pass over the rows the vertical one reads.
    let (rows, cur_w, row0) = if out_w != w {
        let hc = coeffs(w, out_w);
        let mut tmp = vec![0u8; (last - first) * out_w * 3];
        for y in first..last {
            let line = &src[y * w * 3..(y + 1) * w * 3];
            let out = &mut tmp[(y - first) * out_w * 3..(y - first + 1) * out_w * 3];
            for xx in 0..out_w {
                let (xmin, n) = hc.bounds[xx];
                let k = &hc.weights[xx * hc.ksize..xx * hc.ksize + n];
                let mut s = [half; 3];
                for (x, &kx) in k.iter().enumerate() {
                    let p = &line[(xmin + x) * 3..(xmin + x) * 3 + 3];
                    for c in 0..3 {
                        s[c] += p[c] as i32 * kx;
                    }
                }
                for c in 0..3 {
                    out[xx * 3 + c] = clip8(s[c]);
                }
            }
        }
        (std::borrow::Cow::Owned(tmp), out_w, first)
    } else {
        (std::borrow::Cow::Borrowed(src), w, 0)
    };
    if out_h == h {
        return match rows {
            std::borrow::Cow::Owned(v) if row0 == 0 && last - first == h => v,
            rows => rows[(first - row0) * cur_w * 3..(last - row0) * cur_w * 3].to_vec(),
        };
    }
    // Vertical pass.
    let mut out = vec![0u8; out_h * cur_w * 3];
    for yy in 0..out_h {
        let (ymin, n) = vert.bounds[yy];
        let k = &vert.weights[yy * vert.ksize..yy * vert.ksize + n];
        for xx in 0..cur_w * 3 {
            let mut s = half;
            for (y, &ky) in k.iter().enumerate() {
                s += rows[(ymin + y - row0) * cur_w * 3 + xx] as i32 * ky;
            }
            out[yy * cur_w * 3 + xx] = clip8(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(45, 64), (70, 96), (150, 64), (230, 96), (7, 3)] {
            let c = coeffs(i, o);
            for xx in 0..o {
                let s: i64 = c.weights[xx * c.ksize..(xx + 1) * c.ksize]
                    .iter()
                    .map(|&w| w as i64)
                    .sum();
                assert!(
                    (s - (1 << PRECISION_BITS)).abs() <= c.ksize as i64,
                    "{i}->{o} at {xx}: {s}"
                );
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat_and_same_size_is_a_copy() {
        let src = vec![77u8; 9 * 13 * 3];
        assert!(resize_rgb(&src, 9, 13, 20, 5).iter().all(|&v| v == 77));
        let img: Vec<u8> = (0..6 * 4 * 3).map(|i| (i * 7 % 256) as u8).collect();
        assert_eq!(resize_rgb(&img, 6, 4, 6, 4), img);
    }
}
