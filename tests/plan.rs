//! `sanmai plan` end to end: the 125B config on the 3x3090 preset, the refusals of budgets that do
//! not fit or name no card, and the plan the engine's start prints for the same flags.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn sanmai(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sanmai"))
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the binary runs")
}

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn path(rel: &str) -> String {
    repo(rel).to_str().unwrap().to_string()
}

fn ok_stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "sanmai failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The error line of a failed run.
fn error_of(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure");
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("Error:") || l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line in {err}"));
    line.to_string()
}

/// The `memory plan:` lines of a run's output (stdout or log).
fn plan_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.split_once("memory plan: ").map(|(_, r)| r.to_string()))
        .collect()
}

/// `GiB` numbers after `key` in `line` (e.g. `weights 21.04 GiB`).
fn gib_after(line: &str, key: &str) -> f64 {
    let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
    rest.trim_start()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("a number after {key} in {line}"))
}

#[test]
fn the_125b_config_on_three_3090s() {
    let cfg = path("configs/models/qwen4-exp-125b-a6b.json");
    let preset = path("configs/deploy/3x3090.toml");
    // The preset as it stands (its own 23.5GiB budget, the 262,144-token context with the QSA K/V
    // rows in pinned host memory, an even split).
    let out = sanmai(&["plan", "--config", &cfg, "--preset", &preset]);
    let text = ok_stdout(&out);
    println!("{text}");
    let lines = plan_lines(&text);
    assert_eq!(
        lines.len(),
        5,
        "three stages, the block arithmetic and the pinned bytes: {text}"
    );
    assert!(lines[4].starts_with("pinned host RAM: "), "{}", lines[4]);
    // Images on, as the reference deployment takes them: the tower on the first card, its blocks
    // in pinned host memory.
    assert!(gib_after(&lines[0], "vision tower") < 0.5, "{}", lines[0]);
    assert!(!lines[1].contains("vision tower"), "{}", lines[1]);
    assert!(
        lines[4].contains("and the vision tower's blocks (0.77 GiB)"),
        "{}",
        lines[4]
    );
    for (k, (line, layers)) in lines.iter().zip(["0..16", "16..32", "32..48"]).enumerate() {
        assert!(
            line.starts_with(&format!("stage {k} (layers {layers} on cuda:{k})")),
            "{line}"
        );
        assert!(
            line.ends_with("of 23.50 GiB (--gpu-memory-budget)"),
            "{line}"
        );
        let total = gib_after(line, "; ");
        assert!(total <= 23.5, "{line}");
        assert!(gib_after(line, "weights") > 10.0, "{line}");
        assert!(gib_after(line, "K/V blocks") > 0.0, "{line}");
        assert!(gib_after(line, "pinned host RAM") > 1.0, "{line}");
    }
    // The stages' weights add up to the whole model's: nothing is held twice.
    let whole = sanmai(&[
        "plan",
        "--config",
        &cfg,
        "--pipeline-parallel-size",
        "1",
        "--device",
        "cuda:0",
        "--gpu-memory-budget",
        "200GiB",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "512",
        "--max-model-len",
        "32768",
    ]);
    let whole = plan_lines(&ok_stdout(&whole));
    let sum: f64 = lines[..3].iter().map(|l| gib_after(l, "weights")).sum();
    let one = gib_after(&whole[0], "weights");
    assert!(
        (sum - one).abs() < 0.03,
        "stages {sum} GiB = whole {one} GiB"
    );
    // The same cards without the offload: the full 262,144-token context does not fit, refused with
    // the block arithmetic.
    let on_3090s = |more: &[&str]| {
        let mut args = vec![
            "plan",
            "--config",
            &cfg,
            "--pipeline-parallel-size",
            "3",
            "--gpu-memory-budget",
            "23.5GiB",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "256",
        ];
        args.extend_from_slice(more);
        error_of(&sanmai(&args))
    };
    let e = on_3090s(&[
        "--max-model-len",
        "262144",
        "--limit-mm-per-prompt",
        r#"{"image": 0}"#,
    ]);
    assert!(e.contains("--max-model-len"), "{e}");
    // With images on, the first card also holds the vision tower and its largest image: refused,
    // naming the image flags.
    let e = on_3090s(&["--max-model-len", "32768"]);
    assert!(
        e.contains("vision tower") && e.contains("--limit-mm-per-prompt"),
        "{e}"
    );
    let arithmetic = &lines[3];
    assert!(arithmetic.starts_with("K/V cache: "), "{arithmetic}");
    for key in [
        "blocks of 16 tokens",
        "bytes per block",
        "checkpoint",
        "-token request takes",
    ] {
        assert!(arithmetic.contains(key), "{key} in {arithmetic}");
    }
    let fit: usize = arithmetic
        .rsplit("so ")
        .next()
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("requests that fit in {arithmetic}"));
    assert!(fit >= 1, "{arithmetic}");
}

#[test]
fn budgets_that_do_not_fit_are_refused_in_one_line() {
    let cfg = path("configs/models/qwen4-exp-125b-a6b.json");
    let preset = path("configs/deploy/3x3090.toml");
    let e = error_of(&sanmai(&[
        "plan",
        "--config",
        &cfg,
        "--preset",
        &preset,
        "--gpu-memory-budget",
        "12GiB",
    ]));
    assert!(e.contains("does not fit --gpu-memory-budget"), "{e}");
    for k in 0..3 {
        assert!(e.contains(&format!("stage {k} (layers")), "{e}");
    }
    let e = error_of(&sanmai(&[
        "plan",
        "--config",
        &cfg,
        "--gpu-memory-budget",
        "lots",
    ]));
    assert!(e.contains("--gpu-memory-budget"), "{e}");
    // Without a GPU to ask, the budget must be given.
    let e = error_of(&sanmai(&[
        "plan",
        "--config",
        &cfg,
        "--pipeline-parallel-size",
        "3",
    ]));
    assert!(e.contains("--gpu-memory-budget"), "{e}");
}

#[test]
fn the_engine_start_prints_the_plan_sanmai_plan_prints() {
    same_plan_at_start("tests/fixtures/qwen3_next_tiny/config.json", &[], 3);
}

/// With the QSA K/V rows in pinned host memory: the pinned bytes and the row cache are planned as
/// the server then allocates them.
#[test]
fn the_offloaded_plan_is_the_plan_the_engine_starts_with() {
    let planned = same_plan_at_start(
        "tests/fixtures/qwen4_exp_qsa_tiny/config.json",
        &["--qsa-kv-offload", "--qsa-row-cache-rows", "64"],
        4,
    );
    // The fixture's attention layers are on the second stage.
    assert!(planned[1].contains("QSA row cache"), "{planned:?}");
    assert!(
        planned[2].contains("QSA K/V rows in pinned host memory"),
        "{planned:?}"
    );
    assert!(planned[3].starts_with("pinned host RAM: "), "{planned:?}");
}

/// `sanmai plan` and the start of `sanmai generate` on two CPU stages of the config `rel` with
/// `extra` flags print the same `lines` plan lines (the RAM available, read when each prints, aside).
fn same_plan_at_start(rel: &str, extra: &[&str], lines: usize) -> Vec<String> {
    let cfg = path(rel);
    let flags = [
        "--config",
        &cfg,
        "--device",
        "cpu",
        "--pipeline-parallel-size",
        "2",
        "--gpu-memory-budget",
        "48MiB",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
    ];
    let flags = [&flags[..], extra].concat();
    let planned = plan_lines(&ok_stdout(&sanmai(&[&["plan"][..], &flags[..]].concat())));
    let run = sanmai(
        &[
            &[
                "generate",
                "--load-format",
                "dummy",
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "2",
            ][..],
            &flags[..],
        ]
        .concat(),
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let started = plan_lines(&String::from_utf8_lossy(&run.stderr));
    let ram_aside = |lines: &[String]| -> Vec<String> {
        lines
            .iter()
            .map(|l| l.split("; MemAvailable now").next().unwrap().to_string())
            .collect()
    };
    assert_eq!(planned.len(), lines, "{planned:?}");
    assert_eq!(ram_aside(&planned), ram_aside(&started));
    planned
}

/// `--speculative-config` with a `"model"` directory: the MTP head is counted as that directory's
/// config quantizes it. Qwen3.5-35B-A3B in bf16 with its head's 256 routed experts in INT4 groups
/// of 128 (what `sanmai quantize --mtp-int4` writes): 256 · 3 · 2048 · 512 weights at half a byte
/// instead of two, plus an f32 scale per 128 on the device: 1.102 GiB less on the last stage.
#[test]
fn an_mtp_directory_counts_its_own_quantization() {
    let cfg = path("configs/models/qwen3.5-35b-a3b.json");
    let dir = std::env::temp_dir().join(format!("sanmai-plan-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    config["quantization_config"] = serde_json::json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"mtp_routed_experts": {
            "targets": [r"re:mtp\.layers\.\d+\.mlp\.experts\.(\d+\.)?(gate|up|down|gate_up)_proj$"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128}
        }},
        "ignore": ["mtp.fc"],
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let weights = |spec: &str| {
        let out = sanmai(&[
            "plan",
            "--config",
            &cfg,
            "--gpu-memory-budget",
            "200GiB",
            "--max-model-len",
            "8192",
            "--speculative-config",
            spec,
        ]);
        gib_after(&plan_lines(&ok_stdout(&out))[0], "weights")
    };
    let plain = weights(r#"{"method": "mtp", "num_speculative_tokens": 1}"#);
    let int4 = weights(&format!(
        r#"{{"method": "mtp", "num_speculative_tokens": 1, "model": "{}"}}"#,
        dir.display()
    ));
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        (plain - int4 - 1.102).abs() < 0.011,
        "{plain} GiB with the head in bf16, {int4} with its experts in INT4"
    );
}

#[test]
fn the_vision_tower_streamed_from_host_memory_is_planned_there() {
    let cfg = path("configs/models/qwen3.5-35b-a3b.json");
    let plan = |more: &[&str]| {
        let mut args = vec![
            "plan",
            "--config",
            &cfg,
            "--device",
            "cuda:0",
            "--gpu-memory-budget",
            "120GiB",
        ];
        args.extend_from_slice(more);
        plan_lines(&ok_stdout(&sanmai(&args)))
    };
    let resident = plan(&[]);
    let streamed = plan(&["--vit-on-host"]);
    // 857.6 MiB of weights and a 16 MP image's activations against two block slots of 29.1 MiB.
    let tower = |lines: &[String]| gib_after(&lines[0], "vision tower");
    assert!(
        tower(&resident) - tower(&streamed) > 0.7,
        "{resident:?} {streamed:?}"
    );
    let last = streamed.last().unwrap();
    assert!(
        last.starts_with("pinned host RAM: 0.77 GiB")
            && last.contains("for the vision tower's blocks (0.77 GiB)"),
        "{last}"
    );
    assert!(!resident.iter().any(|l| l.starts_with("pinned host RAM")));
}
