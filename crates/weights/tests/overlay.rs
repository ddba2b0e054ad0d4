//! `Overlay`: tensors under the prefix come from the overlay source and all others from the base
//! (values, shapes, `contains`, packed forms), and every error names the source and the tensor.

use std::path::Path;

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};
use sanmai_config::QuantConfig;
use sanmai_weights::{Checkpoint, Dummy, Init, Overlay, TensorSource, WeightError};

fn write(path: &Path, tensors: &[(&str, Vec<usize>, f32)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, shape, v)| {
            let n: usize = shape.iter().product();
            (0..n)
                .flat_map(|_| bf16::from_f32(*v).to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            (
                name.to_string(),
                TensorView::new(Dtype::BF16, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A base checkpoint and an MTP checkpoint that both hold `model.norm.weight` and `mtp.fc.weight`,
/// with different values (base: 1 and 2, MTP: 9 and 3), and one tensor the other lacks.
fn sources(dir: &Path) -> Overlay {
    write(
        &dir.join("base/model.safetensors"),
        &[
            ("model.norm.weight", vec![4], 1.0),
            ("mtp.fc.weight", vec![4, 8], 2.0),
            ("mtp.norm.weight", vec![4], 5.0),
        ],
    );
    write(
        &dir.join("mtp/model.safetensors"),
        &[
            ("model.norm.weight", vec![4], 9.0),
            ("mtp.fc.weight", vec![4, 8], 3.0),
            ("model.embed_tokens.weight", vec![16, 4], 7.0),
        ],
    );
    let base = Checkpoint::open(&dir.join("base")).unwrap();
    let mtp = Checkpoint::open(&dir.join("mtp")).unwrap();
    Overlay::new(
        "mtp.",
        Box::new(base),
        "the main checkpoint BASE",
        Box::new(mtp),
        "the MTP checkpoint MTP",
    )
}

#[test]
fn routes_by_prefix_with_values_and_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let o = sources(dir.path());
    assert_eq!(o.prefix(), "mtp.");
    let norm = o.tensor("model.norm.weight", &[4], Init::ZEROS).unwrap();
    assert_eq!(norm.shape, vec![4]);
    assert_eq!(norm.to_f32(), vec![1.0; 4], "model.* comes from the base");
    let fc = o.tensor("mtp.fc.weight", &[4, 8], Init::ZEROS).unwrap();
    assert_eq!(fc.shape, vec![4, 8]);
    assert_eq!(fc.to_f32(), vec![3.0; 32], "mtp.* comes from the overlay");
    // A [1, n] tensor read as [n] (size-1 dims are layout) goes through unchanged.
    assert!(o.tensor("model.norm.weight", &[1, 4], Init::ZEROS).is_ok());

    assert!(o.contains("model.norm.weight"));
    assert!(o.contains("mtp.fc.weight"));
    // Each name is asked of its own source only: the base's `mtp.norm.weight` and the overlay's
    // embedding are not visible.
    assert!(!o.contains("mtp.norm.weight"));
    assert!(!o.contains("model.embed_tokens.weight"));
    assert!(o.routes_to_overlay("mtp.layers.0.mlp.gate.weight"));
    assert!(!o.routes_to_overlay("model.mtp.x"));
    assert_eq!(o.source_name("mtp.x"), "the MTP checkpoint MTP");
    assert_eq!(o.source_name("lm_head.weight"), "the main checkpoint BASE");
    // Unquantized tensors have no packed form on either side.
    assert!(o
        .packed("mtp.fc.weight", &[4, 8], Init::ZEROS)
        .unwrap()
        .is_none());
    assert!(o
        .packed("model.norm.weight", &[4], Init::ZEROS)
        .unwrap()
        .is_none());
}

#[test]
fn errors_name_the_source_and_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let o = sources(dir.path());
    let msg = |e: WeightError| e.to_string();

    // Missing from the overlay even though the base has it.
    let e = msg(o.tensor("mtp.norm.weight", &[4], Init::ZEROS).unwrap_err());
    assert!(
        e.contains("the MTP checkpoint MTP")
            && e.contains("`mtp.norm.weight`")
            && e.contains("missing"),
        "{e}"
    );
    // Missing from the base even though the overlay has it.
    let e = msg(o
        .tensor("model.embed_tokens.weight", &[16, 4], Init::ZEROS)
        .unwrap_err());
    assert!(
        e.contains("the main checkpoint BASE") && e.contains("`model.embed_tokens.weight`"),
        "{e}"
    );
    // Wrong shapes, on each side.
    let e = msg(o.tensor("mtp.fc.weight", &[8, 4], Init::ZEROS).unwrap_err());
    assert!(
        e.contains("the MTP checkpoint MTP")
            && e.contains("`mtp.fc.weight`")
            && e.contains("[8, 4]")
            && e.contains("[4, 8]"),
        "{e}"
    );
    let e = msg(o
        .tensor("model.norm.weight", &[5], Init::ZEROS)
        .unwrap_err());
    assert!(
        e.contains("the main checkpoint BASE") && e.contains("`model.norm.weight`"),
        "{e}"
    );
}

#[test]
fn packed_tensors_come_from_their_own_source() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("base/model.safetensors"),
        &[(
            "model.layers.0.mlp.experts.0.up_proj.weight",
            vec![32, 64],
            0.5,
        )],
    );
    let quant = QuantConfig::from_value(
        &serde_json::json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"experts": {
                "targets": ["re:.*mlp\\.experts\\..*"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                            "strategy": "group", "group_size": 128}}}
        }),
        "config.json",
    )
    .unwrap();
    let o = Overlay::new(
        "mtp.",
        Box::new(Checkpoint::open(&dir.path().join("base")).unwrap()),
        "base",
        Box::new(Dummy::new(1).with_quantization(Some(quant))),
        "mtp",
    );
    let name = "mtp.layers.0.mlp.experts.0.up_proj.weight";
    let p = o
        .packed(name, &[32, 64], Init::std(0.1))
        .unwrap()
        .expect("the overlay's expert is packed");
    assert_eq!((p.bits, p.group_size), (4, 128));
    assert_eq!((p.out_features, p.in_features), (32, 64));
    // The same name under the base's prefix is the base's unquantized weight.
    let base = "model.layers.0.mlp.experts.0.up_proj.weight";
    assert!(o.packed(base, &[32, 64], Init::ZEROS).unwrap().is_none());
    assert_eq!(
        o.tensor(base, &[32, 64], Init::ZEROS).unwrap().to_f32(),
        vec![0.5; 32 * 64]
    );
    // A packed read of a missing base tensor is `None` (unquantized), and the tensor read names it.
    let e = o
        .tensor("model.absent.weight", &[2, 2], Init::ZEROS)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("base: ") && e.contains("`model.absent.weight`"),
        "{e}"
    );
}
