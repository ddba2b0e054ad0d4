//! The preprocessing against transformers' PIL-backend Qwen2-VL image processor
//! (`tests/reference/make_image_fixtures.py`): the same patches, values and grid for PNG (RGB, grey,
//! with transparency), JPEG, WebP and GIF files, upscaled, downscaled and left at their size.

use std::path::PathBuf;

use sanmai_vision::{preprocess, PreprocessorConfig};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/images")
}

#[test]
fn patches_equal_the_reference_processor() {
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap())
            .unwrap();
    let settings = &manifest["settings"];
    let cases = manifest["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut v = settings.clone();
        v["min_pixels"] = case["min_pixels"].clone();
        v["max_pixels"] = case["max_pixels"].clone();
        let cfg = PreprocessorConfig::from_value(&v, "manifest.json").unwrap();
        let bytes = std::fs::read(dir().join(case["file"].as_str().unwrap())).unwrap();
        let got = preprocess(&bytes, &cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        let grid: [usize; 3] = serde_json::from_value(case["grid_thw"].clone()).unwrap();
        assert_eq!(got.grid_thw, grid, "{name}: grid");
        let want: Vec<f32> = std::fs::read(dir().join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got.pixel_values.len(), want.len(), "{name}: length");
        let differ = got
            .pixel_values
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let max = got
            .pixel_values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let mean = got
            .pixel_values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() as f64)
            .sum::<f64>()
            / want.len() as f64;
        println!(
            "{name}: {differ} of {} values differ, max {max}, mean {mean:.2e}",
            want.len()
        );
        if name.ends_with("jpeg") {
            // JPEG decoders differ in their IDCT and chroma upsampling (Pillow uses libjpeg-turbo):
            // a level or two, after the resample's averaging.
            assert!(
                max <= 6.0 / 127.5 && mean < 1.0 / 127.5,
                "{name}: max {max}, mean {mean}"
            );
        } else {
            assert_eq!(
                differ,
                0,
                "{name}: {differ} of {} values differ (max {max})",
                want.len()
            );
        }
    }
}

#[test]
fn undecodable_bytes_are_an_error() {
    let e = preprocess(b"not an image", &PreprocessorConfig::qwen3_5())
        .unwrap_err()
        .to_string();
    assert!(e.contains("could not be decoded"), "{e}");
}

/// The vision fixture's second image, preprocessed on a GPU host by transformers 5.17's processor
/// (`tests/reference/make_vision_fixtures.py`): the same values bit for bit.
#[test]
fn the_vision_fixtures_second_image_is_transformers_5_17s() {
    let vis =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_vision_tiny");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(vis.join("reference.json")).unwrap())
            .unwrap();
    let image = &r["images"][1];
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap())
            .unwrap();
    let mut v = manifest["settings"].clone();
    v["min_pixels"] = image["preprocessor"]["min_pixels"].clone();
    v["max_pixels"] = image["preprocessor"]["max_pixels"].clone();
    let cfg = PreprocessorConfig::from_value(&v, "reference.json").unwrap();
    let got = preprocess(&std::fs::read(vis.join("second.png")).unwrap(), &cfg).unwrap();
    let grid: Vec<usize> = serde_json::from_value(image["grid_thw"].clone()).unwrap();
    assert_eq!(got.grid_thw.to_vec(), grid);
    let want: Vec<u32> = std::fs::read(vis.join("second.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let got: Vec<u32> = got.pixel_values.iter().map(|x| x.to_bits()).collect();
    assert_eq!(got, want);
}
