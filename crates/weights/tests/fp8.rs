//! Block-scaled FP8 checkpoints (`quant_method: fp8`): a converted Linear's float8_e4m3fn `weight`
//! comes back as `fp8(q) · weight_scale_inv[block]` in f32; what is wrong with one is an error naming
//! the tensor or the field.

use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use sanmai_weights::fp8::fp8_e4m3_to_f32;
use sanmai_weights::{Checkpoint, Init, TensorSource, WeightError};

fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn config(dir: &Path, quant: serde_json::Value) {
    let cfg = serde_json::json!({"model_type": "qwen3_next", "quantization_config": quant});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

fn block_config() -> serde_json::Value {
    serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [2, 4], "modules_to_not_convert": ["lm_head"]})
}

/// A [3, 6] FP8 weight (scale grid [2, 2]: partial blocks at both edges) beside a bf16 one.
fn checkpoint(dir: &Path, scale_shape: Vec<usize>, with_scale: bool) -> (Vec<u8>, Vec<f32>) {
    let q: Vec<u8> = (0..18u8).map(|i| 0x30 + i).collect();
    let scales = vec![0.5f32, 2.0, -1.0, 4.0];
    let mut tensors = vec![
        (
            "model.layers.0.mlp.up_proj.weight",
            Dtype::F8_E4M3,
            vec![3, 6],
            q.clone(),
        ),
        (
            "lm_head.weight",
            Dtype::BF16,
            vec![2, 2],
            vec![0x80, 0x3f, 0, 0x40, 0, 0, 0x80, 0xbf],
        ),
    ];
    if with_scale {
        tensors.push((
            "model.layers.0.mlp.up_proj.weight_scale_inv",
            Dtype::F32,
            scale_shape,
            f32_bytes(&scales),
        ));
    }
    write(&dir.join("model.safetensors"), &tensors);
    (q, scales)
}

#[test]
fn fp8_weights_dequantise_per_block() {
    let tmp = tempfile::tempdir().unwrap();
    config(tmp.path(), block_config());
    let (q, scales) = checkpoint(tmp.path(), vec![2, 2], true);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let w = ckpt
        .tensor("model.layers.0.mlp.up_proj.weight", &[3, 6], Init::ZEROS)
        .unwrap()
        .into_f32();
    for r in 0..3 {
        for c in 0..6 {
            let want = fp8_e4m3_to_f32(q[r * 6 + c]) * scales[(r / 2) * 2 + c / 4];
            assert_eq!(w[r * 6 + c].to_bits(), want.to_bits(), "row {r} col {c}");
        }
    }
    // A module left unconverted reads as before.
    let head = ckpt
        .tensor("lm_head.weight", &[2, 2], Init::ZEROS)
        .unwrap()
        .into_f32();
    assert_eq!(head, [1.0, 2.0, 0.0, -1.0]);
}

#[test]
fn what_is_wrong_with_an_fp8_weight_is_named() {
    let name = "model.layers.0.mlp.up_proj.weight";
    // No scale.
    let tmp = tempfile::tempdir().unwrap();
    config(tmp.path(), block_config());
    checkpoint(tmp.path(), vec![2, 2], false);
    let e = Checkpoint::open(tmp.path())
        .unwrap()
        .tensor(name, &[3, 6], Init::ZEROS)
        .unwrap_err();
    assert!(
        matches!(&e, WeightError::Missing { name } if name.ends_with("up_proj.weight_scale_inv")),
        "{e}"
    );
    // A scale grid of the wrong shape (per-tensor instead of per block).
    let tmp = tempfile::tempdir().unwrap();
    config(tmp.path(), block_config());
    checkpoint(tmp.path(), vec![4], true);
    let e = Checkpoint::open(tmp.path())
        .unwrap()
        .tensor(name, &[3, 6], Init::ZEROS)
        .unwrap_err();
    match &e {
        WeightError::Shape {
            name,
            expected,
            found,
        } => {
            assert!(name.ends_with("weight_scale_inv"), "{e}");
            assert_eq!(
                (expected.as_slice(), found.as_slice()),
                (&[2, 2][..], &[4][..])
            );
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    // FP8 bytes without an fp8 quantization_config.
    let tmp = tempfile::tempdir().unwrap();
    checkpoint(tmp.path(), vec![2, 2], true);
    let e = Checkpoint::open(tmp.path())
        .unwrap()
        .tensor(name, &[3, 6], Init::ZEROS)
        .unwrap_err()
        .to_string();
    assert!(e.contains(name) && e.contains("fp8"), "{e}");
    // An unsupported format is refused when the checkpoint opens, naming the field.
    let tmp = tempfile::tempdir().unwrap();
    let mut q = block_config();
    q["fmt"] = "e5m2".into();
    config(tmp.path(), q);
    checkpoint(tmp.path(), vec![2, 2], true);
    let e = Checkpoint::open(tmp.path()).err().unwrap().to_string();
    assert!(
        e.contains("config.json") && e.contains("fmt") && e.contains("e5m2"),
        "{e}"
    );
}

/// A backend that consumes FP8 gets a converted Linear from `packed`: its bytes (here a row of 6 is
/// not whole words, so copied into padded rows), the block scales repeated per row and column group,
/// and the same values `tensor` gives; a module left unconverted is not packed.
#[test]
fn fp8_weights_come_packed_with_their_scales_per_row() {
    let tmp = tempfile::tempdir().unwrap();
    config(tmp.path(), block_config());
    let (q, scales) = checkpoint(tmp.path(), vec![2, 2], true);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    let p = ckpt
        .packed(name, &[3, 6], Init::ZEROS)
        .unwrap()
        .expect("an FP8 Linear comes packed");
    assert!(p.fp8 && p.bits == 8);
    assert_eq!((p.out_features, p.in_features, p.group_size), (3, 6, 4));
    // Row r, group g: scale_inv[r / 2, g].
    assert_eq!(p.scales, [0.5, 2.0, 0.5, 2.0, -1.0, 4.0]);
    let words = p.words();
    for r in 0..3 {
        for c in 0..6 {
            let byte = (words[r * 2 + c / 4] >> (8 * (c % 4))) as u8;
            assert_eq!(byte, q[r * 6 + c], "row {r} col {c}");
        }
    }
    let dense = ckpt.tensor(name, &[3, 6], Init::ZEROS).unwrap().into_f32();
    let same = p
        .dequantize()
        .iter()
        .zip(&dense)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "packed values equal the dequantised tensor");
    assert_eq!(dense[7], fp8_e4m3_to_f32(q[7]) * scales[0]);
    assert!(ckpt
        .packed("lm_head.weight", &[2, 2], Init::ZEROS)
        .unwrap()
        .is_none());
}

/// `--load-format dummy` with an FP8 config: every converted Linear is FP8 blocks (rounding it
/// again changes nothing; it is not the plain random weight), of its shape; a module the config
/// keeps and a norm come out as without FP8.
#[test]
fn dummy_weights_of_an_fp8_config_are_fp8_blocks() {
    use sanmai_config::Fp8Config;
    use sanmai_weights::{fp8::round_blocks, Dummy, TensorData};
    let cfg = Fp8Config {
        block: [4, 8],
        not_converted: vec!["lm_head".into()],
    };
    let fp8 = Dummy::new(5).with_fp8(Some(cfg.clone()));
    let plain = Dummy::new(5);
    let init = Init::Random {
        mean: 0.0,
        std: 0.02,
    };
    let values = |d: &Dummy, name: &str, shape: &[usize]| {
        let t = d.tensor(name, shape, init).unwrap();
        assert_eq!(t.shape, shape);
        match t.data {
            TensorData::F32(v) => v,
            _ => panic!("{name}: f32 values expected"),
        }
    };
    for (name, shape) in [
        ("model.layers.0.mlp.gate_proj.weight", vec![12, 20]),
        ("model.layers.0.mlp.experts.gate_up_proj", vec![3, 10, 16]),
    ] {
        let got = values(&fp8, name, &shape);
        let mut again = got.clone();
        round_blocks(&mut again, &shape, &cfg);
        assert_eq!(again, got, "{name}: FP8 blocks");
        assert_ne!(got, values(&plain, name, &shape), "{name}: rounded");
    }
    for (name, shape) in [
        ("lm_head.weight", vec![12, 20]),
        ("model.norm.weight", vec![20]),
    ] {
        assert_eq!(
            values(&fp8, name, &shape),
            values(&plain, name, &shape),
            "{name}"
        );
    }
}
