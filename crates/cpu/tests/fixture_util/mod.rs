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

/// Every MTP case of a fixture's `reference`: the draft head's log-probabilities at each listed
/// position are within `tol` of transformers'. Returns how many cases there were.
pub fn check_mtp_drafts(
    name: &str,
    m: &sanmai_model::Model<sanmai_cpu::CpuBackend>,
    reference: &Value,
    tol: f64,
) -> usize {
    use sanmai_model::Backend;
    let prompts = reference["prompts"].as_array().unwrap();
    let cases = reference["mtp"].as_array().unwrap();
    for (ci, case) in cases.iter().enumerate() {
        let prompt = ids(&prompts[case["prompt_index"].as_u64().unwrap() as usize]["ids"]);
        let seq = crate::step_util::new_seq(m, ci);
        let (_, cols, data) = crate::step_util::draft_logits(m, &seq, &prompt);
        for (i, pos) in case["positions"].as_array().unwrap().iter().enumerate() {
            let t = pos.as_u64().unwrap() as usize;
            let want = floats(&case["draft_logprobs"][i]);
            let got = log_softmax(&data[t * cols..(t + 1) * cols]);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w.unwrap()).abs())
                .fold(0.0, f64::max);
            eprintln!("{name} MTP position {t}: max draft logprob error {worst:.1e}");
            assert!(
                worst < tol,
                "{name} MTP position {t}: draft logprob off by {worst}"
            );
        }
        m.backend.free_state(seq.state);
    }
    cases.len()
}
