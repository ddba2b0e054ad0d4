//! Shared by the tests that run the committed transformers / PyTorch fixtures on the CPU backend:
//! where the fixtures live, their `reference.json`, a sequence's caches, and log-probabilities.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, SeqChunk};
use serde_json::Value;

/// Blocks each test sequence owns (sequence `i` of a model gets blocks `i·64 ..`).
pub const BLOCKS_PER_SEQ: usize = 64;

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

/// A sequence's caches: a state slot and a contiguous run of blocks.
pub struct Seq {
    pub state: usize,
    pub blocks: Vec<u32>,
}

pub fn new_seq(m: &Model<CpuBackend>, i: usize) -> Seq {
    let first = (i * BLOCKS_PER_SEQ) as u32;
    Seq {
        state: m.backend.alloc_state(),
        blocks: (first..first + BLOCKS_PER_SEQ as u32).collect(),
    }
}

/// The sequence's chunk of `len` tokens from `pos0`, as the step's only rows.
pub fn chunk(s: &Seq, len: usize, pos0: usize) -> SeqChunk<'_> {
    SeqChunk {
        start: 0,
        len,
        pos0,
        state: s.state,
        blocks: &s.blocks,
    }
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
