//! An image file's bytes to the vision tower's input, as transformers' PIL-backend Qwen2-VL image
//! processor (`Qwen2VLImageProcessorPil`) prepares it:
//!
//! 1. decode (PNG, JPEG, WebP, GIF: its first frame) and convert to RGB; transparency is composited
//!    onto white with Pillow's `alpha_composite` arithmetic, as transformers' `convert_to_rgb` does;
//! 2. `smart_resize`: both sides a multiple of patch × merge, the pixel count within the bounds, the
//!    aspect ratio kept (Python's rounding: halves to even);
//! 3. Pillow's bicubic resample ([`crate::resample`]);
//! 4. rescale (`u8 · factor` in f64, then f32) and normalise (`(x − mean) / std` in f32);
//! 5. patches: one row per `patch × patch` patch, merge windows of `merge × merge` patches
//!    consecutive, each row `[channel, temporal, y, x]` with the image repeated over the temporal
//!    patch.

use std::io::Cursor;

use image::{DynamicImage, GenericImageView, ImageReader, Limits};

use crate::config::PreprocessorConfig;
use crate::resample::resize_rgb;
use crate::{Result, VisionError};

/// The vision tower's input for one image.
#[derive(Debug, Clone, PartialEq)]
pub struct Patches {
    /// `[grid_h · grid_w, 3 · temporal · patch · patch]`, row-major.
    pub pixel_values: Vec<f32>,
    /// `(t, h, w)` in patches: `(1, resized height / patch, resized width / patch)`.
    pub grid_thw: [usize; 3],
}

/// transformers' `smart_resize`: the resized `(height, width)`.
pub fn smart_resize(
    height: usize,
    width: usize,
    cfg: &PreprocessorConfig,
) -> Result<(usize, usize)> {
    let size_err = |message: String| VisionError::Size {
        height,
        width,
        message,
    };
    if height == 0 || width == 0 {
        return Err(size_err("an image needs at least one pixel".into()));
    }
    let (h, w) = (height as f64, width as f64);
    if h.max(w) / h.min(w) > 200.0 {
        return Err(size_err(format!(
            "the aspect ratio {} is above 200",
            h.max(w) / h.min(w)
        )));
    }
    let factor = cfg.factor() as f64;
    let mut h_bar = (h / factor).round_ties_even() * factor;
    let mut w_bar = (w / factor).round_ties_even() * factor;
    if h_bar * w_bar > cfg.max_pixels as f64 {
        let beta = (h * w / cfg.max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / factor).floor() * factor);
        w_bar = factor.max((w / beta / factor).floor() * factor);
    } else if h_bar * w_bar < cfg.min_pixels as f64 {
        let beta = (cfg.min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / factor).ceil() * factor;
        w_bar = (w * beta / factor).ceil() * factor;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Pillow's `alpha_composite` of `(r, g, b, a)` over opaque white, one channel.
fn over_white(v: u8, a: u8) -> u8 {
    if a == 0 {
        return 255;
    }
    const BITS: u32 = 7;
    let (v, a) = (v as u32, a as u32);
    let coef1 = a << BITS;
    let coef2 = (255 << BITS) - coef1;
    let t = v * coef1 + 255 * coef2 + (0x80 << BITS);
    let shifted = ((t >> 8) + t) >> 8;
    (shifted >> BITS) as u8
}

/// The image as RGB rows (`height × width × 3`).
fn to_rgb(img: &DynamicImage) -> Vec<u8> {
    if img.color().has_alpha() {
        img.to_rgba8()
            .pixels()
            .flat_map(|p| {
                let [r, g, b, a] = p.0;
                [over_white(r, a), over_white(g, a), over_white(b, a)]
            })
            .collect()
    } else {
        img.to_rgb8().into_raw()
    }
}

/// The most pixels an image may have: a larger one is refused from its header, before decoding.
pub const MAX_IMAGE_PIXELS: u64 = 50_000_000;

/// The most bytes the decoder may allocate at once, its output image included.
const MAX_DECODE_ALLOC: u64 = 512 << 20;

/// Decodes an image file's bytes, reading its header first so that an image over
/// [`MAX_IMAGE_PIXELS`] is refused before its pixels are allocated.
fn decode(bytes: &[u8]) -> Result<DynamicImage> {
    let decode_err = |e: image::ImageError| VisionError::Decode(e.to_string());
    let mut limits = Limits::default();
    limits.max_alloc = Some(MAX_DECODE_ALLOC);
    let reader = || {
        let mut r = ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| VisionError::Decode(e.to_string()))?;
        r.limits(limits.clone());
        Ok::<_, VisionError>(r)
    };
    let (w, h) = reader()?.into_dimensions().map_err(decode_err)?;
    if u64::from(w) * u64::from(h) > MAX_IMAGE_PIXELS {
        return Err(VisionError::Size {
            height: h as usize,
            width: w as usize,
            message: format!("more than {MAX_IMAGE_PIXELS} pixels"),
        });
    }
    reader()?.decode().map_err(decode_err)
}

/// Prepares one image file's bytes.
pub fn preprocess(bytes: &[u8], cfg: &PreprocessorConfig) -> Result<Patches> {
    let img = decode(bytes)?;
    let (w, h) = img.dimensions();
    let (h, w) = (h as usize, w as usize);
    let (rh, rw) = smart_resize(h, w, cfg)?;
    let rgb = resize_rgb(&to_rgb(&img), h, w, rh, rw);
    let (p, t, m) = (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size);
    let (gh, gw) = (rh / p, rw / p);
    // Channel-first floats, rescaled and normalised.
    let mut chw = vec![0f32; 3 * rh * rw];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let x = (px[c] as f64 * cfg.rescale_factor) as f32;
            chw[c * rh * rw + i] = (x - cfg.image_mean[c]) / cfg.image_std[c];
        }
    }
    let row = 3 * t * p * p;
    let mut out = Vec::with_capacity(gh * gw * row);
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        for _ in 0..t {
                            for y in 0..p {
                                let at = c * rh * rw + (y0 + y) * rw + x0;
                                out.extend_from_slice(&chw[at..at + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(Patches {
        pixel_values: out,
        grid_thw: [1, gh, gw],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_follows_the_processor() {
        let cfg = PreprocessorConfig {
            min_pixels: 64 * 64,
            max_pixels: 128 * 128,
            ..PreprocessorConfig::qwen3_5()
        };
        // Upscaled to the minimum; already fine; downscaled to the maximum.
        assert_eq!(smart_resize(45, 70, &cfg).unwrap(), (64, 96));
        assert_eq!(smart_resize(64, 96, &cfg).unwrap(), (64, 96));
        assert_eq!(smart_resize(400, 300, &cfg).unwrap(), (128, 96));
        // Python rounds halves to even: 80 / 32 = 2.5 → 2, 112 / 32 = 3.5 → 4.
        let wide = PreprocessorConfig {
            min_pixels: 32 * 32,
            ..cfg.clone()
        };
        assert_eq!(smart_resize(80, 112, &wide).unwrap(), (64, 128));
        assert!(smart_resize(1, 300, &cfg)
            .unwrap_err()
            .to_string()
            .contains("aspect ratio"));
    }

    #[test]
    fn compositing_over_white_matches_pillow_at_the_ends() {
        assert_eq!(over_white(0, 255), 0);
        assert_eq!(over_white(200, 255), 200);
        assert_eq!(over_white(0, 0), 255);
        assert_eq!(over_white(0, 128), 127);
    }
}
