//! The vision tower's CPU forward against transformers 5.17 (`tests/fixtures/qwen3_5_vision_tiny`,
//! made by `tests/reference/make_vision_fixtures.py`: a random two-block tower with bf16 weights,
//! run in f64 on two images). Every stage the fixture records is compared: the patch embedding, the
//! interpolated position embedding, each block's output and the merged tokens, for both images
//! together and for each image alone.

use std::collections::HashMap;
use std::path::PathBuf;

use sanmai_vision::positions::Grid;
use sanmai_vision::tower::{forward, forward_observed, Stage, Tensor, VisionConfig, VisionWeights};
use sanmai_vision::VisionError;

/// Absolute. The measured errors are below 1e-6 (f32 storage against transformers' f64); 1e-3 would
/// let the merger's exact GELU be swapped for the blocks' tanh one (a 5e-4 difference here).
const TOLERANCE: f64 = 1e-5;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_vision_tiny")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
        .unwrap()
}

fn config() -> VisionConfig {
    let v = serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
        .unwrap();
    VisionConfig::from_value(&v, "config.json").unwrap()
}

/// The checkpoint's `model.visual.*` tensors by their name in the tower, bf16 widened to f32.
fn tensors() -> HashMap<String, Tensor> {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::BF16, "{name}");
            let data = t
                .data()
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            let name = name.strip_prefix("model.visual.").unwrap().to_string();
            (name, (t.shape().to_vec(), data))
        })
        .collect()
}

fn weights(cfg: &VisionConfig) -> VisionWeights {
    let t = tensors();
    VisionWeights::load(cfg, |name| t.get(name).cloned()).unwrap()
}

/// Each image's grid and patch rows.
fn images(r: &serde_json::Value) -> Vec<(Grid, Vec<f32>)> {
    r["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|im| {
            let grid: Grid = serde_json::from_value(im["grid_thw"].clone()).unwrap();
            let pixels: Vec<f32> = std::fs::read(fixture().join(im["file"].as_str().unwrap()))
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (grid, pixels)
        })
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    serde_json::from_value(v.clone()).unwrap()
}

/// The largest absolute difference, asserted within [`TOLERANCE`].
fn compare(what: &str, got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let max = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0.0, f64::max);
    println!("{what}: max abs error {max:.3e} over {} values", want.len());
    assert!(
        max <= TOLERANCE,
        "{what}: max abs error {max:.3e} > {TOLERANCE:e}"
    );
    max
}

#[test]
fn every_stage_is_transformers() {
    let r = reference();
    let cfg = config();
    let w = weights(&cfg);
    let imgs = images(&r);
    let grids: Vec<Grid> = imgs.iter().map(|(g, _)| *g).collect();
    let pixels: Vec<f32> = imgs.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    let mut stages: Vec<(Stage, Vec<f32>)> = Vec::new();
    let merged = forward_observed(&cfg, &w, &pixels, &grids, |s, x| {
        stages.push((s, x.to_vec()))
    })
    .unwrap();
    let blocks = r["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), cfg.depth);
    assert_eq!(stages.len(), 2 + cfg.depth);
    for (stage, got) in &stages {
        let (what, want) = match stage {
            Stage::PatchEmbed => ("patch embedding".to_string(), floats(&r["patch_embed"])),
            Stage::PositionEmbed => ("position embedding".to_string(), floats(&r["pos_embeds"])),
            Stage::Block(i) => (format!("block {i}"), floats(&blocks[*i])),
        };
        compare(&what, got, &want);
    }
    let shape: [usize; 2] = serde_json::from_value(r["merger_shape"].clone()).unwrap();
    assert_eq!(shape[1], cfg.out_hidden_size);
    assert_eq!(merged.len(), shape[0] * shape[1]);
    compare("merger, both images", &merged, &floats(&r["merger"]));
}

#[test]
fn each_image_alone_merges_to_its_rows() {
    let r = reference();
    let cfg = config();
    let w = weights(&cfg);
    let want = floats(&r["merger"]);
    let mut row = 0;
    for (i, (grid, pixels)) in images(&r).iter().enumerate() {
        let tokens = grid.iter().product::<usize>() / cfg.merge_unit();
        let got = forward(&cfg, &w, pixels, &[*grid]).unwrap();
        let span = row * cfg.out_hidden_size..(row + tokens) * cfg.out_hidden_size;
        compare(&format!("merger, image {i} alone"), &got, &want[span]);
        row += tokens;
    }
    assert_eq!(row * cfg.out_hidden_size, want.len());
}

#[test]
fn missing_or_misshaped_weights_are_named() {
    let cfg = config();
    let t = tensors();
    let e = VisionWeights::load(&cfg, |name| {
        (name != "blocks.1.attn.qkv.bias").then(|| t[name].clone())
    })
    .unwrap_err();
    assert!(matches!(&e, VisionError::Weight { name, .. } if name == "blocks.1.attn.qkv.bias"));
    let e = e.to_string();
    assert!(
        e.contains("`blocks.1.attn.qkv.bias`") && e.contains("missing"),
        "{e}"
    );

    let e = VisionWeights::load(&cfg, |name| {
        let (shape, data) = t[name].clone();
        if name == "merger.linear_fc2.weight" {
            Some((vec![shape[1], shape[0]], data))
        } else {
            Some((shape, data))
        }
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`merger.linear_fc2.weight`") && e.contains("shape"),
        "{e}"
    );
}

#[test]
fn inputs_that_disagree_are_errors() {
    let r = reference();
    let cfg = config();
    let w = weights(&cfg);
    let (grid, pixels) = images(&r).remove(0);
    let e = forward(&cfg, &w, &pixels[1..], &[grid])
        .unwrap_err()
        .to_string();
    assert!(e.contains("pixel values"), "{e}");
    let e = forward(&cfg, &w, &pixels, &[[1, grid[1] * grid[2] / 3, 3]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("merge size"), "{e}");
}
