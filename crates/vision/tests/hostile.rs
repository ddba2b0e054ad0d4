//! Image files built to hurt the decoder: a small PNG whose header claims 20000×20000 pixels is
//! refused from its header, naming its size; a PNG cut short is a decode error.

use image::codecs::png::PngEncoder;
use image::{ExtendedColorType, ImageEncoder};
use sanmai_vision::preprocess::MAX_IMAGE_PIXELS;
use sanmai_vision::{preprocess, PreprocessorConfig, VisionError};

/// CRC-32 (IEEE, reflected, polynomial 0xEDB88320) as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// One PNG chunk: length, type, data, CRC of type and data.
fn chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut out = (data.len() as u32).to_be_bytes().to_vec();
    let mut body = kind.to_vec();
    body.extend_from_slice(data);
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32(&body).to_be_bytes());
    out
}

/// A PNG of a few dozen bytes whose IHDR says `width × height` (8-bit RGB).
fn png_claiming(width: u32, height: u32) -> Vec<u8> {
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&height.to_be_bytes());
    // Bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace.
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    // A zlib stream holding nothing: far fewer bytes than the header promises.
    png.extend(chunk(
        b"IDAT",
        &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    ));
    png.extend(chunk(b"IEND", &[]));
    png
}

/// A real 64×64 RGB PNG of varied pixels.
fn real_png() -> Vec<u8> {
    let (w, h) = (64u32, 64u32);
    let pixels: Vec<u8> = (0..w * h * 3)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut out = Vec::new();
    PngEncoder::new(&mut out)
        .write_image(&pixels, w, h, ExtendedColorType::Rgb8)
        .unwrap();
    out
}

#[test]
fn the_crc_matches_the_standard_check_value() {
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    assert_eq!(crc32(b"IEND"), 0xAE42_6082);
}

#[test]
fn a_huge_header_is_refused_before_decoding() {
    let cfg = PreprocessorConfig::qwen3_5();
    let png = png_claiming(20_000, 20_000);
    assert!(png.len() < 100);
    let err = preprocess(&png, &cfg).unwrap_err();
    match &err {
        VisionError::Size { height, width, .. } => assert_eq!((*height, *width), (20_000, 20_000)),
        other => panic!("expected a size error, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!("the image is 20000x20000: more than {MAX_IMAGE_PIXELS} pixels")
    );
    // Just over the bound is refused too, and names its own size.
    let err = preprocess(&png_claiming(10_000, 5_001), &cfg).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("the image is 5001x10000: more than {MAX_IMAGE_PIXELS} pixels")
    );
}

#[test]
fn a_small_header_with_missing_pixels_is_a_decode_error() {
    let err = preprocess(&png_claiming(32, 32), &PreprocessorConfig::qwen3_5()).unwrap_err();
    assert!(matches!(err, VisionError::Decode(_)), "{err:?}");
}

#[test]
fn a_truncated_png_is_a_decode_error() {
    // Small enough bounds that the 64×64 image keeps its size: 4×4 patches of 16.
    let cfg = PreprocessorConfig {
        min_pixels: 32 * 32,
        ..PreprocessorConfig::qwen3_5()
    };
    let png = real_png();
    let whole = preprocess(&png, &cfg).unwrap();
    assert_eq!(whole.grid_thw, [1, 4, 4]);
    let err = preprocess(&png[..png.len() / 2], &cfg).unwrap_err();
    assert!(matches!(err, VisionError::Decode(_)), "{err:?}");
    assert!(
        err.to_string()
            .starts_with("the image could not be decoded: "),
        "{err}"
    );
}
