//! Shared by the tests that run the committed transformers / PyTorch fixtures on the CPU backend:
//! where the fixtures live, their `reference.json`, and log-probabilities.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The fixture directory `name` under `tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A fixture's `reference.json`.
pub fn reference(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

/// Log-softmax of a logits row, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON array of numbers or nulls.
pub fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array().unwrap().iter().map(Value::as_f64).collect()
}

/// The first index of the largest value.
pub fn argmax(row: &[f64]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}
