//! Checkpoint loading: single and sharded files, dtype conversion, and the errors a broken checkpoint gives.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use sanmai_config::ModelConfig;
use sanmai_weights::names::{ungroup_qwen3_next, Scope};
use sanmai_weights::{Checkpoint, Dummy, Init, TensorSource, WeightError};

fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
        .collect()
}

#[test]
fn reads_bf16_f16_f32_and_names_errors() {
    let dir = tempfile::tempdir().unwrap();
    let vals = [1.0f32, -2.5, 0.375, 1024.0, -0.0, 3.0];
    let f16b: Vec<u8> = vals
        .iter()
        .flat_map(|x| f16::from_f32(*x).to_le_bytes())
        .collect();
    let f32b: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
    write(
        &dir.path().join("model.safetensors"),
        &[
            ("a", Dtype::BF16, vec![2, 3], bf16_bytes(&vals)),
            ("b", Dtype::F16, vec![6], f16b),
            ("c", Dtype::F32, vec![3, 2], f32b),
            ("ints", Dtype::I32, vec![2], vec![0; 8]),
            (
                "conv",
                Dtype::F32,
                vec![3, 1, 2],
                vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
        ],
    );
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.tensor("a", &[2, 3], Init::ZEROS).unwrap().to_f32(), vals);
    assert_eq!(ck.tensor("b", &[6], Init::ZEROS).unwrap().to_f32(), vals);
    assert_eq!(ck.tensor("c", &[3, 2], Init::ZEROS).unwrap().to_f32(), vals);
    // A conv weight stored [c, 1, k] is accepted where [c, k] is asked for, and vice versa.
    assert_eq!(
        ck.tensor("conv", &[3, 2], Init::ZEROS).unwrap().to_f32(),
        vals
    );

    let err = ck.tensor("a", &[3, 2], Init::ZEROS).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor `a` has shape [2, 3], expected [3, 2]"
    );
    let err = ck.tensor("nope", &[1], Init::ZEROS).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor `nope` is missing from the checkpoint"
    );
    let err = ck.tensor("ints", &[2], Init::ZEROS).unwrap_err();
    assert!(matches!(err, WeightError::DType { .. }), "{err}");
    assert!(
        err.to_string().contains("`ints`") && err.to_string().contains("i32"),
        "{err}"
    );
}

#[test]
fn truncated_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write(&path, &[("a", Dtype::F32, vec![64], vec![0; 256])]);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [bytes.len() - 1, bytes.len() - 200, 20, 4] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = Checkpoint::open(dir.path())
            .err()
            .expect("a truncated file must not open");
        assert!(err.to_string().contains("model.safetensors"), "{err}");
    }
}

#[test]
fn sharded_checkpoint_follows_the_index() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("part-1.safetensors"),
        &[("x", Dtype::BF16, vec![2], bf16_bytes(&[1.0, 2.0]))],
    );
    write(
        &dir.path().join("part-2.safetensors"),
        &[("y", Dtype::BF16, vec![1], bf16_bytes(&[3.0]))],
    );
    let index =
        r#"{"metadata":{},"weight_map":{"x":"part-1.safetensors","y":"part-2.safetensors"}}"#;
    std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.tensor("x", &[2], Init::ZEROS).unwrap().to_f32(),
        [1.0, 2.0]
    );
    assert_eq!(ck.tensor("y", &[1], Init::ZEROS).unwrap().to_f32(), [3.0]);

    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"x":"gone.safetensors"}}"#,
    )
    .unwrap();
    let err = Checkpoint::open(dir.path()).err().unwrap().to_string();
    assert!(err.contains("gone.safetensors"), "{err}");
}

fn tiny_next_config() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type":"qwen3_next","vocab_size":16,"hidden_size":2,"num_hidden_layers":1,
            "num_attention_heads":1,"num_key_value_heads":1,"head_dim":8,"intermediate_size":4,
            "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":1,"linear_value_head_dim":2,
            "num_experts":2,"num_experts_per_tok":1,"moe_intermediate_size":1}"#,
        "config.json",
    )
    .unwrap()
}

#[test]
fn qwen3_next_grouped_projections_are_ungrouped() {
    // hidden = 1 column per row; each row's value is a label naming what it is.
    let cfg = tiny_next_config();
    let g = &cfg.gdn; // Hk = 2, Hv = 4 (r = 2), dk = 1, dv = 2
    let mut qkvz = Vec::new();
    let mut ba = Vec::new();
    for grp in 0..2 {
        let g10 = grp as f32 * 1000.0;
        qkvz.push(g10 + 100.0); // q_g
        qkvz.push(g10 + 200.0); // k_g
        qkvz.extend([g10 + 300.0, g10 + 301.0, g10 + 302.0, g10 + 303.0]); // v of heads 2g, 2g+1 (dv = 2 each)
        qkvz.extend([g10 + 400.0, g10 + 401.0, g10 + 402.0, g10 + 403.0]); // z
        ba.extend([g10 + 500.0, g10 + 501.0, g10 + 600.0, g10 + 601.0]); // b (r), a (r)
    }
    let p = ungroup_qwen3_next(g, 1, &qkvz, &ba);
    assert_eq!(
        p.qkv,
        [
            100.0, 1100.0, 200.0, 1200.0, 300.0, 301.0, 302.0, 303.0, 1300.0, 1301.0, 1302.0,
            1303.0
        ]
    );
    assert_eq!(
        p.z,
        [400.0, 401.0, 402.0, 403.0, 1400.0, 1401.0, 1402.0, 1403.0]
    );
    assert_eq!(p.b, [500.0, 501.0, 1500.0, 1501.0]);
    assert_eq!(p.a, [600.0, 601.0, 1600.0, 1601.0]);
}

#[test]
fn per_expert_and_fused_experts_agree() {
    let cfg = tiny_next_config(); // hidden 2, inter 1, 2 experts
    let per: HashMap<&str, Vec<f32>> = HashMap::from([
        (
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            vec![1.0, 2.0],
        ),
        (
            "model.layers.0.mlp.experts.0.up_proj.weight",
            vec![3.0, 4.0],
        ),
        (
            "model.layers.0.mlp.experts.0.down_proj.weight",
            vec![5.0, 6.0],
        ),
        (
            "model.layers.0.mlp.experts.1.gate_proj.weight",
            vec![7.0, 8.0],
        ),
        (
            "model.layers.0.mlp.experts.1.up_proj.weight",
            vec![9.0, 10.0],
        ),
        (
            "model.layers.0.mlp.experts.1.down_proj.weight",
            vec![11.0, 12.0],
        ),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let shapes = |n: &str| {
        if n.ends_with("down_proj.weight") {
            vec![2, 1]
        } else {
            vec![1, 2]
        }
    };
    let tensors: Vec<_> = per
        .iter()
        .map(|(n, v)| (*n, Dtype::BF16, shapes(n), bf16_bytes(v)))
        .collect();
    write(&dir.path().join("model.safetensors"), &tensors);
    let a = Checkpoint::open(dir.path()).unwrap();

    let dir2 = tempfile::tempdir().unwrap();
    write(
        &dir2.path().join("model.safetensors"),
        &[
            (
                "model.layers.0.mlp.experts.gate_up_proj",
                Dtype::BF16,
                vec![2, 2, 2],
                bf16_bytes(&[1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 9.0, 10.0]),
            ),
            (
                "model.layers.0.mlp.experts.down_proj",
                Dtype::BF16,
                vec![2, 2, 1],
                bf16_bytes(&[5.0, 6.0, 11.0, 12.0]),
            ),
        ],
    );
    let b = Checkpoint::open(dir2.path()).unwrap();
    let ea = Scope::layer(&a, &cfg, 0).experts(2, 1).unwrap();
    let eb = Scope::layer(&b, &cfg, 0).experts(2, 1).unwrap();
    for (x, y) in ea.iter().zip(&eb) {
        assert_eq!(x.gate_up, y.gate_up);
        assert_eq!(x.down, y.down);
    }
    assert_eq!(ea[1].gate_up, [7.0, 8.0, 9.0, 10.0]);
}

#[test]
fn dummy_is_deterministic_with_the_asked_statistics() {
    let d = Dummy::new(7);
    let a = d
        .tensor("w", &[1000, 300], Init::std(0.5))
        .unwrap()
        .to_f32();
    let b = Dummy::new(7)
        .tensor("w", &[1000, 300], Init::std(0.5))
        .unwrap()
        .to_f32();
    let c = Dummy::new(7)
        .tensor("v", &[1000, 300], Init::std(0.5))
        .unwrap()
        .to_f32();
    assert_eq!(a, b);
    assert_ne!(a, c);
    let n = a.len() as f64;
    let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!(
        mean.abs() < 0.01 && (std - 0.5).abs() < 0.01,
        "mean {mean} std {std}"
    );
    assert!(d
        .tensor("o", &[4], Init::ONES)
        .unwrap()
        .to_f32()
        .iter()
        .all(|&x| x == 1.0));
}
