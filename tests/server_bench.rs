//! `sanmai bench serve` against a real `sanmai serve` of the built-in model in two pipeline stages: the
//! run completes at one and at three requests in flight, and prints what the server counted during it,
//! the stage table with both stages busy included, in its text and its `--result-json`.

mod server_support;

use std::process::Command;

use serde_json::Value;
use server_support::ServerProc;

/// The rows of the printed stage table: stage, busy, idle and busy fraction.
fn stage_rows(text: &str) -> Vec<(String, f64, f64, f64)> {
    text.lines()
        .skip_while(|l| !l.contains("Pipeline Stages"))
        .skip(2)
        .take_while(|l| !l.starts_with("Pipeline overlap"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 4, "a stage row: {l:?}");
            let num = |i: usize| f[i].parse::<f64>().unwrap();
            (f[0].to_string(), num(1), num(2), num(3))
        })
        .collect()
}

/// Runs `sanmai bench serve --url SERVER ARGS`, which must succeed; returns its stdout.
fn bench_serve(s: &ServerProc, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sanmai"))
        .args(["bench", "serve", "--url", &s.base])
        .args(args)
        .output()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log()
    );
    text
}

#[test]
fn bench_serve_prints_the_stage_table_of_a_two_stage_server() {
    let s = ServerProc::start(&["--pipeline-parallel-size", "2", "--device", "cpu"]);
    let (prompts, gen_len) = (3, 6);
    for concurrency in [1, 3] {
        let result = std::env::temp_dir().join(format!(
            "sanmai-bench-serve-{}-{concurrency}.json",
            std::process::id()
        ));
        let (c, n, g) = (
            concurrency.to_string(),
            prompts.to_string(),
            gen_len.to_string(),
        );
        let text = bench_serve(
            &s,
            &[
                "--prompt-len",
                "16",
                "--concurrency",
                &c,
                "--num-prompts",
                &n,
                "--gen-len",
                &g,
                "--result-json",
                result.to_str().unwrap(),
            ],
        );
        let rows = stage_rows(&text);
        let stages: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(stages, ["0", "1"], "{text}");
        assert!(
            rows.iter().all(|r| r.1 > 0.0 && r.2 >= 0.0 && r.3 > 0.0),
            "{text}"
        );
        assert!(
            text.contains("Pipeline overlap (busy sum / wall):"),
            "{text}"
        );
        assert!(text.contains("Generation tokens:"), "{text}");

        let v: Value = serde_json::from_slice(&std::fs::read(&result).unwrap()).unwrap();
        let _ = std::fs::remove_file(&result);
        assert_eq!(v["concurrency"], concurrency, "{v}");
        assert_eq!(v["completed"], prompts, "{v}");
        assert_eq!(
            v["server_counters"]["generation_tokens"].as_f64(),
            Some((prompts * gen_len) as f64),
            "{v}"
        );
        let stages = v["pp_stages"].as_array().unwrap();
        assert_eq!(stages.len(), 2, "{v}");
        let window = v["metrics_window_s"].as_f64().unwrap();
        let mut busy_sum = 0.0;
        for (k, st) in stages.iter().enumerate() {
            assert_eq!(st["stage"], k.to_string(), "{v}");
            let busy = st["busy_s"].as_f64().unwrap();
            assert!(busy > 0.0, "{v}");
            assert!((st["busy_fraction"].as_f64().unwrap() - busy / window).abs() < 1e-9);
            busy_sum += busy;
        }
        let overlap = v["pp_overlap"].as_f64().unwrap();
        assert!((overlap - busy_sum / window).abs() < 1e-9, "{v}");
    }
}

#[test]
fn bench_serve_sends_token_ids_of_exact_length_to_a_model_without_a_tokenizer() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/qwen3_next_tiny"
    );
    let s = ServerProc::start(&["--model", fixture, "--device", "cpu"]);
    let text = bench_serve(
        &s,
        &["--prompt-len", "12", "--num-prompts", "2", "--gen-len", "3"],
    );
    // Two timed prompts and the warm-up, 12 tokens each, counted by the server.
    assert_eq!(s.metric("sanmai:prompt_tokens_total"), 36.0, "{text}");
    // Each token's arrival is timed although the chunks carry no text.
    let tpot: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Median TPOT (ms):"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("a median TPOT in {text}"));
    assert!(tpot > 0.0, "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_sanmai"))
        .args(["bench", "serve", "--url", &s.base, "--endpoint", "chat"])
        .output()
        .expect("the binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--endpoint completions"), "{err}");
}
