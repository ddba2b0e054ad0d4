//! Quantized checkpoints: the packed fixture written by `tests/reference/quantize_fixture.py` unpacks to
//! exactly the integers the Python side quantised, dequantises to exactly its reference values, and the
//! dummy source produces packed weights for the Linears a quantization config targets.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use sanmai_config::{ModelConfig, QuantScheme};
use sanmai_weights::{Checkpoint, Dummy, Init, TensorSource, WeightError};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

#[test]
fn packed_fixture_matches_python_integers_and_values() {
    let dir = fixture("qwen3_5_moe_text_tiny_quant");
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert!(ckpt.quantization().is_some());
    let bytes = std::fs::read(dir.join("quant_reference.safetensors")).unwrap();
    let reference = SafeTensors::deserialize(&bytes).unwrap();
    let mut seen = [0usize; 9];
    let mut packed_bytes = 0;
    for (name, view) in reference.tensors() {
        let Some(module) = name.strip_suffix(".q") else {
            continue;
        };
        let shape = view.shape().to_vec();
        let weight = format!("{module}.weight");
        assert!(ckpt.contains(&weight), "{weight}");
        let p = ckpt
            .packed(&weight, &shape, Init::ZEROS)
            .unwrap()
            .unwrap_or_else(|| panic!("{weight} is not packed"));
        assert_eq!((p.out_features, p.in_features), (shape[0], shape[1]));
        seen[p.bits as usize] += 1;
        packed_bytes += p.packed_bytes().len();
        let expected_scheme = if module.contains("shared_expert.") {
            QuantScheme {
                bits: 6,
                group_size: 0,
            }
        } else if module.contains("experts.") {
            QuantScheme {
                bits: 4,
                group_size: 32,
            }
        } else {
            QuantScheme {
                bits: 8,
                group_size: 0,
            }
        };
        assert_eq!(p.scheme(), expected_scheme, "{module}");

        let want_q: Vec<i8> = view.data().iter().map(|&b| b as i8).collect();
        assert_eq!(p.unpack(), want_q, "{module}: unpacked integers differ");

        let deq = reference.tensor(&format!("{module}.dequant")).unwrap();
        let want: Vec<f32> = deq
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let got = ckpt
            .tensor(&weight, &shape, Init::ZEROS)
            .unwrap()
            .into_f32();
        assert_eq!(got, want, "{module}: dequantised values differ");
        assert_eq!(p.dequantize(), want, "{module}");
    }
    // 120 routed experts, 15 shared experts, 19 projections (GDN, attention, MTP, lm_head, embedding).
    assert_eq!((seen[4], seen[6], seen[8]), (120, 15, 19));
    eprintln!("packed words: {packed_bytes} bytes");

    // Unquantized tensors (router, in_proj_a, norms, mtp.fc) read as before.
    let plain = Checkpoint::open(&fixture("qwen3_5_moe_text_tiny")).unwrap();
    for (name, shape) in [
        ("model.layers.0.mlp.gate.weight", vec![8, 64]),
        ("model.layers.0.linear_attn.in_proj_a.weight", vec![4, 64]),
        ("mtp.fc.weight", vec![64, 128]),
        ("model.norm.weight", vec![64]),
    ] {
        assert!(ckpt.packed(name, &shape, Init::ZEROS).unwrap().is_none());
        assert_eq!(
            ckpt.tensor(name, &shape, Init::ZEROS).unwrap().to_f32(),
            plain.tensor(name, &shape, Init::ZEROS).unwrap().to_f32(),
            "{name}"
        );
    }
}

#[test]
fn packed_shape_mismatch_names_the_tensor() {
    let ckpt = Checkpoint::open(&fixture("qwen3_5_moe_text_tiny_quant")).unwrap();
    let name = "model.layers.0.linear_attn.out_proj.weight";
    match ckpt.tensor(name, &[96, 64], Init::ZEROS) {
        Err(WeightError::Shape { name: n, found, .. }) => {
            assert_eq!(n, name);
            assert_eq!(found, vec![64, 96]);
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    assert!(matches!(
        ckpt.tensor("model.layers.0.nothing.weight", &[1, 2], Init::ZEROS),
        Err(WeightError::Missing { .. })
    ));
}

#[test]
fn packed_checkpoint_without_quantization_config_is_an_error() {
    let src = fixture("qwen3_5_moe_text_tiny_quant");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let e = ckpt
        .tensor("lm_head.weight", &[1024, 64], Init::ZEROS)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lm_head.weight") && e.contains("quantization_config"),
        "{e}"
    );
}

#[test]
fn dummy_weights_come_packed_for_targeted_linears() {
    let path = fixture("qwen3_5_moe_text_tiny_quant").join("config.json");
    let cfg = ModelConfig::from_file(&path).unwrap();
    let d = Dummy::new(3).with_quantization(cfg.quantization.clone());
    let init = Init::std(0.05);
    // A fused 3-D expert tensor is packed row-wise over all experts.
    let fused = "model.layers.0.mlp.experts.gate_up_proj";
    let f = d.packed(fused, &[8, 64, 64], init).unwrap().unwrap();
    assert_eq!((f.bits, f.out_features, f.in_features), (4, 8 * 64, 64));
    let expert = "model.layers.0.mlp.experts.3.down_proj.weight";
    let p = d.packed(expert, &[64, 32], init).unwrap().unwrap();
    assert_eq!(
        p.scheme(),
        QuantScheme {
            bits: 4,
            group_size: 32
        }
    );
    assert_eq!(p.nbytes(), 4 * (64 * 4 + 64));
    // `tensor` returns exactly the dequantised packed values, the same on every call.
    let t = d.tensor(expert, &[64, 32], init).unwrap().into_f32();
    assert_eq!(t, p.dequantize());
    let shared = "model.layers.1.mlp.shared_expert.down_proj.weight";
    assert_eq!(d.packed(shared, &[64, 48], init).unwrap().unwrap().bits, 6);
    assert_eq!(
        d.packed("model.embed_tokens.weight", &[1024, 64], init)
            .unwrap()
            .unwrap()
            .bits,
        8
    );
    for (name, shape) in [
        ("model.layers.0.mlp.gate.weight", vec![8, 64]),
        ("model.layers.0.input_layernorm.weight", vec![64]),
        ("model.layers.0.linear_attn.conv1d.weight", vec![160, 1, 4]),
    ] {
        assert!(d.packed(name, &shape, init).unwrap().is_none(), "{name}");
    }
    // Without a quantization config nothing is packed.
    assert!(Dummy::new(3)
        .packed(expert, &[64, 32], init)
        .unwrap()
        .is_none());
}

#[test]
fn dummy_bytes_of_the_full_size_qwen3_next_mix() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/qwen3-next-80b-a3b.json");
    let cfg = ModelConfig::from_file(&path).unwrap();
    let d = Dummy::new(1).with_quantization(cfg.quantization.clone());
    let init = Init::std(0.02);
    let bytes =
        |name: &str, shape: &[usize]| d.packed(name, shape, init).unwrap().map(|p| p.nbytes());
    // One routed expert's gate: 512 × 2048 INT4 g128 = 256 words and 16 scales a row.
    assert_eq!(
        bytes(
            "model.layers.0.mlp.experts.9.gate_proj.weight",
            &[512, 2048]
        ),
        Some(512 * (256 + 16) * 4)
    );
    // Shared expert down: 2048 × 512 INT6 gapless = 96 words and 1 scale a row.
    assert_eq!(
        bytes(
            "model.layers.5.mlp.shared_expert.down_proj.weight",
            &[2048, 512]
        ),
        Some(2048 * (96 + 1) * 4)
    );
    // Attention output: 2048 × 4096 INT8 channel = 1024 words and 1 scale a row.
    assert_eq!(
        bytes("model.layers.3.self_attn.o_proj.weight", &[2048, 4096]),
        Some(2048 * (1024 + 1) * 4)
    );
    assert_eq!(
        bytes("model.layers.0.linear_attn.in_proj_ba.weight", &[64, 2048]),
        None
    );
    assert_eq!(bytes("model.layers.0.mlp.gate.weight", &[512, 2048]), None);
}
