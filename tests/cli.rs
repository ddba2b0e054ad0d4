//! The `sanmai` binary end to end: `generate` on a transformers fixture and on the built-in model, and the
//! errors bad input gets.

mod server_support;

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;
use server_support::{sanmai, stderr};

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "sanmai failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints one JSON object")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Prompt `i` of a fixture's `reference.json`, and its token ids as `--prompt-ids` takes them.
fn reference_prompt(dir: &Path, i: usize) -> (Value, String) {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompt = reference["prompts"][i].clone();
    let ids: Vec<String> = prompt["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    (prompt, ids.join(","))
}

#[test]
fn generate_json_matches_the_transformers_reference() {
    let dir = fixture("qwen3_next_tiny");
    let (p, ids) = reference_prompt(&dir, 1);
    let out = sanmai(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "--max-tokens",
        "8",
        "--echo",
        "--logprobs",
        "3",
        "--json",
    ]);
    let got = json_of(&out);
    assert_eq!(got["prompt_ids"], p["ids"]);
    assert_eq!(
        got["ids"].as_array().unwrap()[..],
        p["greedy_ids"].as_array().unwrap()[..8]
    );
    let plp = got["prompt_logprobs"].as_array().unwrap();
    assert!(plp[0].is_null());
    for (g, w) in plp
        .iter()
        .zip(p["prompt_logprobs"].as_array().unwrap())
        .skip(1)
    {
        assert!((g.as_f64().unwrap() - w.as_f64().unwrap()).abs() < 1e-3);
    }
    for (i, (lp, tops)) in got["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(got["top_logprobs"].as_array().unwrap())
        .enumerate()
    {
        let want = p["greedy_logprobs"][i].as_f64().unwrap();
        assert!((lp.as_f64().unwrap() - want).abs() < 1e-3);
        let tops = tops.as_array().unwrap();
        assert_eq!(tops.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(tops[0]["id"], got["ids"][i]);
    }
}

#[test]
fn builtin_model_generates_text_with_the_real_vocabulary() {
    let out = sanmai(&[
        "generate",
        "--prompt",
        "Hello there",
        "--chat",
        "--max-tokens",
        "12",
        "--json",
    ]);
    let got = json_of(&out);
    let prompt = got["prompt_ids"].as_array().unwrap();
    // `<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n` in the Qwen3.5 vocabulary.
    assert_eq!(prompt[0], 248045);
    assert!(prompt.contains(&Value::from(248046u32)));
    let ids = got["ids"].as_array().unwrap();
    assert!(!ids.is_empty() && ids.len() <= 12);
    assert!(
        ids.iter().all(|id| id.as_u64().unwrap() < 248_077),
        "padding ids are never sampled"
    );
    // Same seed, same output.
    let again = json_of(&sanmai(&[
        "generate",
        "--prompt",
        "Hello there",
        "--chat",
        "--max-tokens",
        "12",
        "--json",
    ]));
    assert_eq!(again["ids"], got["ids"]);
    let sampled = |seed: u64| {
        json_of(&sanmai(&[
            "generate",
            "--prompt",
            "Hi",
            "--max-tokens",
            "16",
            "--temperature",
            "1.5",
            "--seed",
            &seed.to_string(),
            "--json",
            "--ignore-eos",
        ]))["ids"]
            .clone()
    };
    assert_eq!(sampled(5), sampled(5));
    // The trained model is confident: a seed changes the draw somewhere among a few seeds.
    let first = sampled(5);
    assert!(
        (6..12).any(|seed| sampled(seed) != first),
        "six other seeds drew the same 16 tokens"
    );
}

/// The qwen4_exp fixture with every block on (QSA, PLE with its table, hyper-connections) through the
/// engine: prefill in 16-token chunks (PLE n-grams across chunk boundaries) and decode give the
/// reference's greedy tokens.
#[test]
fn qwen4_exp_with_every_block_generates_the_reference_tokens() {
    let dir = fixture("qwen4_exp_all_tiny");
    let (case, ids) = reference_prompt(&dir, 1);
    let greedy = case["greedy_ids"].as_array().unwrap();
    let d = dir.to_str().unwrap();
    let max = greedy.len().to_string();
    let out = json_of(&sanmai(&[
        "generate",
        "--model",
        d,
        "--ple-table",
        d,
        "--prompt-ids",
        &ids,
        "--max-tokens",
        &max,
        "--ignore-eos",
        "--max-num-batched-tokens",
        "16",
        "--json",
    ]));
    assert_eq!(out["ids"].as_array().unwrap(), greedy);
    let err = stderr(&sanmai(&["generate", "--model", d, "--prompt-ids", "1"]));
    assert!(err.contains("--ple-table"), "{err}");
}

/// `sanmai bench` on dummy weights of the tiny qwen4_exp config (every block on, PLE rows zero without a
/// table) prints its figures and the roofline line for each prompt length and batch size.
#[test]
fn bench_prints_speeds_and_the_roofline() {
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen4-exp-tiny.json");
    let out = sanmai(&[
        "bench",
        "--load-format",
        "dummy",
        "--config",
        cfg.to_str().unwrap(),
        "--batch",
        "1,3",
        "--prompt-len",
        "40,24",
        "--gen-len",
        "4",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| Some((l.split(':').next()?, l.split("prompt ").nth(1)?)))
        .filter(|(b, _)| b.starts_with("batch "))
        .collect();
    let order: Vec<String> = runs
        .iter()
        .map(|(b, p)| format!("{b} {}", p.split(' ').next().unwrap()))
        .collect();
    assert_eq!(
        order,
        ["batch 1 40", "batch 3 40", "batch 1 24", "batch 3 24"],
        "{text}"
    );
    // The timed decode steps follow the untimed warm-up and graph-recording ones; the roofline's
    // context is the middle of the timed ones.
    assert_eq!(
        text.matches("(4 steps after 2 untimed)").count(),
        4,
        "{text}"
    );
    assert!(
        text.contains("at context 44 ") && text.contains("at context 28 "),
        "{text}"
    );
    assert_eq!(text.matches("roofline:").count(), 4, "{text}");
    assert!(text.contains("distinct experts per MoE layer"), "{text}");
    // Pipeline stages are measured through the server.
    let err = stderr(&sanmai(&[
        "bench",
        "--load-format",
        "dummy",
        "--config",
        cfg.to_str().unwrap(),
        "--pipeline-parallel-size",
        "2",
    ]));
    assert!(
        err.contains("--pipeline-parallel-size 2") && err.contains("sanmai bench serve"),
        "{err}"
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let err = stderr(&sanmai(&["generate", "--max-tokens", "2"]));
    assert!(err.contains("give a prompt"), "{err}");
    let err = stderr(&sanmai(&["generate", "--prompt-ids", "1,2,999999"]));
    assert!(
        err.contains("999999") && err.contains("outside the vocabulary"),
        "{err}"
    );
    let err = stderr(&sanmai(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt-ids",
        "1",
    ]));
    assert!(err.contains("/nonexistent/model/config.json"), "{err}");
    let err = stderr(&sanmai(&["generate", "--prompt", "x", "--top-p", "0"]));
    assert!(err.contains("top_p"), "{err}");
    let err = stderr(&sanmai(&[
        "generate",
        "--model",
        fixture("qwen3_next_tiny").to_str().unwrap(),
        "--prompt",
        "text needs a tokenizer",
    ]));
    assert!(err.contains("--prompt-ids"), "{err}");
    let err = stderr(&sanmai(&[
        "generate",
        "--prompt-ids",
        "1",
        "--device",
        "tpu",
    ]));
    assert!(err.contains("--device tpu"), "{err}");
}

#[test]
fn switch_flags_parse_and_cuda_ones_warn_on_the_cpu() {
    // The random built-in model: two tokens whatever they are.
    let out = sanmai(&[
        "generate",
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "2",
        "--json",
        "--cuda-graphs",
        "--no-cuda-graphs",
        "--no-pdl",
        "--no-ple-prefetch",
        "--ple-prefetch",
    ]);
    assert_eq!(json_of(&out)["ids"].as_array().unwrap().len(), 2);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no effect on the CPU")
            && err.contains("--no-cuda-graphs")
            && err.contains("--no-pdl"),
        "{err}"
    );
    assert!(
        !err.contains("\"--cuda-graphs\""),
        "the later flag overrides: {err}"
    );
}
