//! `sanmai quantize --mtp-int4` on the tiny fixtures and the INT4 head served through
//! `--speculative-config`'s `model`: the written checkpoint holds only the `mtp.*` tensors, the routed
//! experts packed (INT4, group 128) within half a scale step of the bf16 weights (or clipped at the
//! end of the code range), everything else byte for byte; the model loader reads it through an
//! `Overlay`; `sanmai generate` with the INT4 head drafting prints the greedy tokens it prints
//! without speculative decoding; and the refusals name the flag, key, path or tensor.

mod server_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use sanmai_config::ModelConfig;
use sanmai_cpu::{CpuBackend, CpuWeight};
use sanmai_model::{Ffn, Model};
use sanmai_weights::{Checkpoint, Init, Overlay, TensorSource};
use serde_json::Value;
use server_support::{completion, sanmai, stderr, ServerProc};

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "sanmai failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fresh directory path under the system temp dir, removed when dropped.
struct Tmp(PathBuf);

impl Tmp {
    fn new(name: &str) -> Tmp {
        let p = std::env::temp_dir().join(format!(
            "sanmai-quantize-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        Tmp(p)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Quantizes `fixture`'s MTP head into a new temp dir; returns it and the command's report.
fn quantize(fixture_name: &str, tag: &str) -> (Tmp, String) {
    let out = Tmp::new(tag);
    let report = ok(&sanmai(&[
        "quantize",
        "--mtp-int4",
        fixture(fixture_name).to_str().unwrap(),
        out.path(),
    ]));
    (out, report)
}

/// The weight names `ckpt` answers for (a packed triplet as its `X.weight`).
fn logical_names(ckpt: &Checkpoint) -> BTreeSet<String> {
    ckpt.names()
        .map(|n| {
            ["_packed", "_scale", "_shape"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n)
                .to_string()
        })
        .collect()
}

/// Checks each packed weight of `out` against the bf16 weight of `base`: per element within half a
/// scale step, or clipped to the end of the code range (the clip search may pick a scale below
/// max|w|/7). Returns the packed names.
fn check_packed_against_bf16(base: &Checkpoint, out: &Checkpoint) -> Vec<String> {
    let mut packed = Vec::new();
    for name in logical_names(out) {
        let shape = base.shape(&name).unwrap().to_vec();
        let Some(p) = out.packed(&name, &shape, Init::ZEROS).unwrap() else {
            // Kept as is: the same bytes.
            let a = base.tensor(&name, &shape, Init::ZEROS).unwrap();
            let b = out.tensor(&name, &shape, Init::ZEROS).unwrap();
            assert_eq!(a.dtype(), b.dtype(), "{name}");
            assert_eq!(a.to_f32(), b.to_f32(), "{name} was not copied as is");
            continue;
        };
        assert_eq!((p.bits, p.group_size), (4, 128), "{name}");
        let k = *shape.last().unwrap();
        assert_eq!(p.in_features, k);
        assert_eq!(p.out_features * k, shape.iter().product::<usize>());
        let w = base.tensor(&name, &shape, Init::ZEROS).unwrap().to_f32();
        let q = p.unpack();
        let d = p.dequantize();
        // The reader's dequantised values are the ones `Checkpoint::tensor` gives.
        assert_eq!(out.tensor(&name, &shape, Init::ZEROS).unwrap().to_f32(), d);
        let sc = p.scale_cols();
        for r in 0..p.out_features {
            let row = &w[r * k..(r + 1) * k];
            for (g, group) in row.chunks(128).enumerate() {
                let s = p.scales[r * sc + g];
                let amax = group.iter().fold(0f32, |m, x| m.max(x.abs()));
                // The clip search's range: max|w|·c/7 for c in 0.80..=1.00 (scales stored as bf16).
                assert!(
                    s <= amax / 7.0 * 1.01 && s >= amax * 0.8 / 7.0 * 0.99,
                    "{name} row {r} group {g}: scale {s} for max|w| {amax}"
                );
                for j in 0..group.len() {
                    let i = r * k + g * 128 + j;
                    let err = (w[i] - d[i]).abs();
                    let clipped = (q[i] == 7 && w[i] > 7.0 * s) || (q[i] == -8 && w[i] < -8.0 * s);
                    assert!(
                        err <= s / 2.0 * (1.0 + 1e-6) || clipped,
                        "{name}[{r}, {}]: {} became {} (scale {s}, code {})",
                        g * 128 + j,
                        w[i],
                        d[i],
                        q[i]
                    );
                }
            }
        }
        packed.push(name);
    }
    packed
}

fn reference_ids(dir: &Path) -> (String, Vec<Value>) {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let p = &reference["prompts"][1];
    let ids: Vec<String> = p["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    (ids.join(","), p["greedy_ids"].as_array().unwrap().clone())
}

/// `sanmai generate --json` on `dir` (greedy, 16 tokens) with `extra` flags: the token ids.
fn generate(dir: &Path, prompt_ids: &str, extra: &[&str]) -> Vec<Value> {
    let mut args = vec![
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        prompt_ids,
        "--max-tokens",
        "16",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let v: Value = serde_json::from_str(&ok(&sanmai(&args))).expect("one JSON object");
    v["ids"].as_array().unwrap().clone()
}

fn spec(k: usize, model: Option<&str>) -> String {
    match model {
        Some(m) => format!(r#"{{"method": "mtp", "num_speculative_tokens": {k}, "model": "{m}"}}"#),
        None => format!(r#"{{"method": "mtp", "num_speculative_tokens": {k}}}"#),
    }
}

fn cpu(w: &CpuWeight) -> &[f32] {
    &w.data
}

#[test]
fn qwen3_next_head_quantizes_loads_and_drafts() {
    let dir = fixture("qwen3_next_tiny");
    let (out, report) = quantize("qwen3_next_tiny", "next");
    assert!(
        report.contains("41 MTP tensors") && report.contains("24 routed-expert Linears to INT4"),
        "{report}"
    );
    let mut files: Vec<String> = std::fs::read_dir(&out.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["config.json", "model.safetensors"]);

    // The checkpoint: only the MTP tensors, the 24 routed-expert weights packed.
    let base = Checkpoint::open(&dir).unwrap();
    let q = Checkpoint::open(&out.0).unwrap();
    let mtp_names: BTreeSet<String> = base
        .names()
        .filter(|n| n.starts_with("mtp."))
        .map(str::to_string)
        .collect();
    assert_eq!(logical_names(&q), mtp_names);
    let packed = check_packed_against_bf16(&base, &q);
    assert_eq!(packed.len(), 24, "{packed:?}");
    assert!(packed
        .iter()
        .all(|n| n.starts_with("mtp.layers.0.mlp.experts.") && n.ends_with("_proj.weight")));
    // The layout `quant.rs` reads: int32 words [out, in/8], scales [out, ceil(in/128)], shape [out, in].
    assert_eq!(
        q.shape("mtp.layers.0.mlp.experts.3.gate_proj.weight_packed"),
        Some(&[32, 8][..])
    );
    assert_eq!(
        q.shape("mtp.layers.0.mlp.experts.3.down_proj.weight_scale"),
        Some(&[64, 1][..])
    );
    assert_eq!(
        q.shape("mtp.layers.0.mlp.experts.3.down_proj.weight_shape"),
        Some(&[2][..])
    );

    // config.json: the fixture's, plus a quantization_config that targets the experts alone.
    let cfg_in: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut cfg_out: Value =
        serde_json::from_str(&std::fs::read_to_string(out.0.join("config.json")).unwrap()).unwrap();
    let quant = cfg_out
        .as_object_mut()
        .unwrap()
        .remove("quantization_config")
        .unwrap();
    assert_eq!(cfg_out, cfg_in);
    let ignore = quant["ignore"].as_array().unwrap();
    for m in [
        "mtp.fc",
        "mtp.layers.0.mlp.gate",
        "mtp.layers.0.mlp.shared_expert_gate",
        "mtp.layers.0.self_attn.q_proj",
    ] {
        assert!(ignore.contains(&Value::from(m)), "{m} not in {ignore:?}");
    }
    let parsed = ModelConfig::from_file(&out.0.join("config.json"))
        .unwrap()
        .quantization
        .unwrap();
    let scheme = |m: &str| parsed.scheme_for(m).map(|s| (s.bits, s.group_size));
    assert_eq!(scheme("mtp.layers.0.mlp.experts.7.up_proj"), Some((4, 128)));
    assert_eq!(scheme("mtp.layers.0.mlp.shared_expert.up_proj"), None);
    assert_eq!(scheme("mtp.fc"), None);
    assert_eq!(scheme("model.layers.0.mlp.experts.7.up_proj"), None);

    // The model loader through the overlay: the MTP experts arrive packed and dequantise to the
    // checkpoint's values; every other weight is the bf16 checkpoint's.
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(cfg.mtp_layers, 1);
    let overlay = Overlay::new(
        "mtp.",
        Box::new(Checkpoint::open(&dir).unwrap()),
        "main",
        Box::new(Checkpoint::open(&out.0).unwrap()),
        "mtp",
    );
    let m4 = Model::load(cfg.clone(), &overlay, CpuBackend::new()).unwrap();
    let m16 = Model::load(cfg.clone(), &base, CpuBackend::new()).unwrap();
    assert!(m16.packed.is_empty());
    assert_eq!(m4.packed.len(), 16, "8 experts' gate|up and down");
    for p in &m4.packed {
        assert!(
            p.name.starts_with("mtp.layers.0.mlp.experts.") && (p.bits, p.group_size) == (4, 128),
            "{}",
            p.name
        );
    }
    let (h4, h16) = (m4.mtp.as_ref().unwrap(), m16.mtp.as_ref().unwrap());
    assert_eq!(cpu(&h4.fc), cpu(&h16.fc));
    assert_eq!(cpu(&h4.norm), cpu(&h16.norm));
    assert_eq!(
        cpu(m4.lm_head.as_ref().unwrap()),
        cpu(m16.lm_head.as_ref().unwrap())
    );
    let (Ffn::Moe(e4), Ffn::Moe(e16)) = (&h4.layer.ffn, &h16.layer.ffn) else {
        panic!("the MTP layer is MoE");
    };
    assert_eq!(cpu(&e4.router), cpu(&e16.router));
    let (s4, s16) = (e4.shared.as_ref().unwrap(), e16.shared.as_ref().unwrap());
    assert_eq!(cpu(&s4.gate_up), cpu(&s16.gate_up));
    let deq = |name: &str, shape: &[usize]| q.tensor(name, shape, Init::ZEROS).unwrap().to_f32();
    let mut worst = 0f32;
    for (x, (a, b)) in e4.experts.iter().zip(&e16.experts).enumerate() {
        let p = format!("mtp.layers.0.mlp.experts.{x}.");
        let mut gate_up = deq(&format!("{p}gate_proj.weight"), &[32, 64]);
        gate_up.extend(deq(&format!("{p}up_proj.weight"), &[32, 64]));
        assert_eq!(cpu(&a.gate_up), gate_up, "expert {x} gate|up");
        assert_eq!(
            cpu(&a.down),
            deq(&format!("{p}down_proj.weight"), &[64, 32])
        );
        for (u, v) in cpu(&a.gate_up).iter().zip(cpu(&b.gate_up)) {
            worst = worst.max((u - v).abs());
        }
        assert_ne!(cpu(&a.gate_up), cpu(&b.gate_up), "expert {x} is quantized");
    }
    assert!(worst > 0.0, "the experts are quantized");
    drop((m4, m16));

    // Serving: greedy decoding with the INT4 head drafting (K = 2, and K = 1) gives the tokens of
    // decoding without speculation, and of the bf16 head drafting.
    let (ids, greedy) = reference_ids(&dir);
    let plain = generate(&dir, &ids, &[]);
    assert_eq!(plain[..8], greedy[..8]);
    let int4 = spec(2, Some(out.path()));
    assert_eq!(
        generate(&dir, &ids, &["--speculative-config", &int4]),
        plain
    );
    let int4_k1 = spec(1, Some(out.path()));
    assert_eq!(
        generate(&dir, &ids, &["--speculative-config", &int4_k1]),
        plain
    );
    let bf16 = spec(2, None);
    assert_eq!(
        generate(&dir, &ids, &["--speculative-config", &bf16]),
        plain
    );
}

#[test]
fn fused_expert_head_of_the_multimodal_wrapper() {
    // qwen3_5_moe keeps its text model under `text_config` and its routed experts as fused 3-D
    // `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I].
    let dir = fixture("qwen3_5_moe_tiny");
    let (out, report) = quantize("qwen3_5_moe_tiny", "fused");
    assert!(
        report.contains("2 routed-expert Linears to INT4"),
        "{report}"
    );
    let base = Checkpoint::open(&dir).unwrap();
    let q = Checkpoint::open(&out.0).unwrap();
    let packed = check_packed_against_bf16(&base, &q);
    assert_eq!(
        packed,
        [
            "mtp.layers.0.mlp.experts.down_proj",
            "mtp.layers.0.mlp.experts.gate_up_proj"
        ]
    );
    assert_eq!(
        q.shape("mtp.layers.0.mlp.experts.gate_up_proj_packed"),
        Some(&[8, 64, 8][..])
    );
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.0.join("config.json")).unwrap()).unwrap();
    assert!(cfg["quantization_config"].is_object());
    assert!(cfg["text_config"].get("quantization_config").is_none());

    let (ids, _) = reference_ids(&dir);
    let plain = generate(&dir, &ids, &[]);
    let int4 = spec(2, Some(out.path()));
    assert_eq!(
        generate(&dir, &ids, &["--speculative-config", &int4]),
        plain
    );
}

#[test]
fn refusals_name_the_flag_key_path_or_tensor() {
    let next = fixture("qwen3_next_tiny");
    let next = next.to_str().unwrap();
    // A checkpoint without an MTP head.
    let no_mtp = fixture("qwen4_exp_hc_tiny");
    let no_mtp = no_mtp.to_str().unwrap();
    let out = Tmp::new("refused");
    let e = stderr(&sanmai(&["quantize", "--mtp-int4", no_mtp, out.path()]));
    assert!(
        e.contains(no_mtp) && e.contains("has no MTP tensors (mtp.*)"),
        "{e}"
    );
    assert!(!out.0.exists(), "nothing is left behind");
    // MTP weights that are already quantized.
    let quant = fixture("qwen3_5_moe_text_tiny_quant");
    let e = stderr(&sanmai(&[
        "quantize",
        "--mtp-int4",
        quant.to_str().unwrap(),
        out.path(),
    ]));
    assert!(e.contains("_packed`") && e.contains("quantized"), "{e}");
    assert!(!out.0.exists());
    // OUT exists and holds something.
    std::fs::create_dir_all(&out.0).unwrap();
    std::fs::write(out.0.join("keep.txt"), "x").unwrap();
    let e = stderr(&sanmai(&["quantize", "--mtp-int4", next, out.path()]));
    assert!(e.contains(out.path()) && e.contains("not empty"), "{e}");
    assert_eq!(
        std::fs::read_to_string(out.0.join("keep.txt")).unwrap(),
        "x"
    );
    // A missing DIR, and no --mtp-int4.
    let fresh = Tmp::new("never-written");
    let e = stderr(&sanmai(&[
        "quantize",
        "--mtp-int4",
        "/nonexistent/ckpt",
        fresh.path(),
    ]));
    assert!(e.contains("DIR /nonexistent/ckpt"), "{e}");
    let e = stderr(&sanmai(&["quantize", next, fresh.path()]));
    assert!(e.contains("--mtp-int4"), "{e}");
    assert!(!fresh.0.exists());

    // --speculative-config's `model`.
    let gen = |spec: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "2",
            "--speculative-config",
            spec,
        ];
        args.extend_from_slice(extra);
        stderr(&sanmai(&args))
    };
    let e = gen(&spec(2, Some("/nonexistent/mtp-int4")), &["--model", next]);
    assert!(
        e.contains("--speculative-config")
            && e.contains("`model`")
            && e.contains("/nonexistent/mtp-int4")
            && e.contains("no such directory"),
        "{e}"
    );
    let e = gen(r#"{"method": "mtp", "model": 3}"#, &["--model", next]);
    assert!(e.contains("`model` must be the path of a directory"), "{e}");
    let e = gen(r#"{"method": "mtp", "draft": "x"}"#, &["--model", next]);
    assert!(
        e.contains("unknown key `draft`") && e.contains("model"),
        "{e}"
    );
    // Random weights with a real head.
    let (q, _) = quantize("qwen3_next_tiny", "dummy");
    let e = gen(
        &spec(1, Some(q.path())),
        &["--model", next, "--load-format", "dummy"],
    );
    assert!(
        e.contains("`model`") && e.contains(q.path()) && e.contains("--load-format dummy"),
        "{e}"
    );
    // A `model` directory without MTP tensors.
    let e = gen(&spec(1, Some(no_mtp)), &["--model", next]);
    assert!(
        e.contains("`model`") && e.contains(no_mtp) && e.contains("has no MTP tensors"),
        "{e}"
    );
    // A head of another architecture: the tensor it lacks is named, with the MTP checkpoint.
    let qsa = fixture("qwen4_exp_qsa_tiny");
    let e = gen(
        &spec(1, Some(q.path())),
        &["--model", qsa.to_str().unwrap()],
    );
    assert!(
        e.contains(&format!("the MTP checkpoint {}: tensor `mtp.", q.path()))
            && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn server_drafts_with_the_int4_head() {
    let dir = fixture("qwen3_next_tiny");
    let (out, _) = quantize("qwen3_next_tiny", "serve");
    let (ids, _) = reference_ids(&dir);
    let prompt: Vec<u32> = ids.split(',').map(|x| x.parse().unwrap()).collect();
    let body = completion(
        serde_json::json!(prompt),
        serde_json::json!({"max_tokens": 24, "temperature": 0, "ignore_eos": true, "logprobs": 0}),
    );
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--model",
            dir.to_str().unwrap(),
            "--device",
            "cpu",
            "--served-model-name",
            "sanmai-demo",
        ];
        args.extend_from_slice(extra);
        let s = ServerProc::start(&args);
        let (status, v) = s.post("/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        (s, v["choices"][0]["logprobs"]["tokens"].clone())
    };
    let (_, plain) = run(&[]);
    // The INT4 head and the checkpoint's bf16 head both draft; the tokens are those without drafts.
    // (The fixture's random weights make the heads' drafts a guess: acceptance is reported, not
    // asserted.)
    for (what, config) in [("INT4", spec(2, Some(out.path()))), ("bf16", spec(2, None))] {
        let (s, drafted) = run(&["--speculative-config", &config]);
        assert_eq!(drafted, plain, "{what} head");
        let drafts = s.metric("sanmai:spec_decode_num_drafts_total");
        let tokens = s.metric("sanmai:spec_decode_num_draft_tokens_total");
        let accepted = s.metric("sanmai:spec_decode_num_accepted_tokens_total");
        eprintln!("{what} head: {drafts} drafts, {tokens} draft tokens, {accepted} accepted");
        assert!(
            drafts > 0.0 && tokens >= drafts && tokens <= 2.0 * drafts,
            "{what} head: {drafts} drafts, {tokens} draft tokens"
        );
        assert_eq!(
            s.log().contains("the MTP head's tensors come from"),
            what == "INT4"
        );
    }
}
