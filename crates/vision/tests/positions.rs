//! Patch and token positions against transformers 5.17 (`tests/fixtures/qwen3_5_vision_tiny`, made by
//! `tests/reference/make_vision_fixtures.py`): the tower's 2-D rotary positions, the interpolated
//! position embeddings (from the fixture's learned table) and the text model's 3-D positions of a
//! sequence with two images.

use std::path::PathBuf;

use sanmai_vision::positions::{interpolation, rope_index, rotary_positions, Grid};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_vision_tiny")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
        .unwrap()
}

fn grids(r: &serde_json::Value) -> Vec<Grid> {
    r["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|im| serde_json::from_value(im["grid_thw"].clone()).unwrap())
        .collect()
}

fn config() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap()
}

#[test]
fn rotary_positions_are_transformers() {
    let r = reference();
    let merge = config()["spatial_merge_size"].as_u64().unwrap() as usize;
    let got: Vec<Vec<u64>> = rotary_positions(&grids(&r), merge)
        .iter()
        .map(|p| p.iter().map(|&x| x as u64).collect())
        .collect();
    let want: Vec<Vec<u64>> = serde_json::from_value(r["rotary_position_ids"].clone()).unwrap();
    assert_eq!(got, want);
}

#[test]
fn interpolated_position_embeddings_are_transformers() {
    let r = reference();
    let cfg = config();
    let merge = cfg["spatial_merge_size"].as_u64().unwrap() as usize;
    let n = cfg["num_position_embeddings"].as_u64().unwrap() as usize;
    let side = (n as f64).sqrt() as usize;
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("model.visual.pos_embed.weight").unwrap();
    let dim = t.shape()[1];
    let table: Vec<f64> = t
        .data()
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
        .collect();
    let want: Vec<f64> = serde_json::from_value(r["pos_embeds"].clone()).unwrap();
    let taps = interpolation(&grids(&r), side, merge);
    assert_eq!(taps.len() * dim, want.len());
    let mut max = 0f64;
    for (p, tap) in taps.iter().enumerate() {
        for d in 0..dim {
            let v: f64 = (0..4)
                .map(|k| table[tap.index[k] * dim + d] * tap.weight[k] as f64)
                .sum();
            max = max.max((v - want[p * dim + d]).abs());
        }
    }
    // transformers' f32 weights times the f64 table, summed in f64: equal up to the sum's order.
    assert!(max < 1e-12, "max difference {max}");
}

#[test]
fn text_positions_around_images_are_transformers() {
    let r = reference();
    let merge = config()["spatial_merge_size"].as_u64().unwrap() as usize;
    let ids: Vec<u32> = serde_json::from_value(r["rope_index"]["input_ids"].clone()).unwrap();
    let image_token = 248056; // Qwen3.5's <|image_pad|>, as in the fixture's sequence
    let (pos, delta) = rope_index(&ids, image_token, &grids(&r), merge).unwrap();
    let want: Vec<Vec<i64>> = serde_json::from_value(r["rope_index"]["positions"].clone()).unwrap();
    assert_eq!(pos.to_vec(), want);
    assert_eq!(delta, r["rope_index"]["delta"].as_i64().unwrap());
    // A run that does not match its grid, and a grid without a run, are errors.
    let e = rope_index(&ids[..6], image_token, &grids(&r), merge)
        .unwrap_err()
        .to_string();
    assert!(e.contains("merges to"), "{e}");
    let e = rope_index(&[1, 2], image_token, &grids(&r), merge)
        .unwrap_err()
        .to_string();
    assert!(e.contains("more image grids"), "{e}");
}
