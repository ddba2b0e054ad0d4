//! Without a GPU: what `sanmai bench --config configs/models/qwen3-next-80b-a3b.json --load-format
//! dummy` loads, on a shrunken copy of that config (4 layers, 8 experts, a 512-token vocabulary; the
//! full hidden and expert widths) with its quantization: the loader hands every routed expert to the
//! backend packed INT4 g128, the shared experts INT6 gapless, the other Linears INT8 channel (the
//! router, `in_proj_ba` and the shared-expert gate stay dense), each in a shape the CUDA backend keeps
//! packed, at its packed size. Qwen3-Next's grouped `in_proj_qkvz` is re-laid out row by row in packed
//! form: its dequantised rows equal the dense re-layout.

use std::path::Path;

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_cuda::packed_fits;
use sanmai_model::{Mixer, Model};
use sanmai_weights::names::ungroup_qwen3_next;
use sanmai_weights::{Dummy, Init, TensorSource};

/// A shipped config: under the working directory (a copied test binary run from the repository
/// root), else next to this crate's sources.
fn config_path(name: &str) -> std::path::PathBuf {
    let rel = Path::new("configs/models").join(format!("{name}.json"));
    if rel.exists() {
        return rel;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

pub(crate) fn shrunken_80b() -> ModelConfig {
    let path = config_path("qwen3-next-80b-a3b");
    let mut cfg = ModelConfig::from_file(&path).unwrap();
    cfg.num_layers = 4;
    cfg.layer_types.truncate(4);
    cfg.ffn_types.truncate(4);
    cfg.vocab_size = 512;
    cfg.mtp_layers = 0;
    let moe = cfg.moe.as_mut().unwrap();
    moe.num_experts = 8;
    moe.top_k = 2;
    cfg
}

#[test]
fn qwen3_next_80b_dummy_loads_packed() {
    let cfg = shrunken_80b();
    let (h, m) = (cfg.hidden_size, cfg.moe.clone().unwrap());
    let src = Dummy::new(7).with_quantization(cfg.quantization.clone());
    let model = Model::load(cfg.clone(), &src, CpuBackend::default()).unwrap();
    let p = &model.packed;
    let find = |name: &str| {
        p.iter()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("{name} not packed: {p:?}"))
    };
    // A routed expert: gate|up [2I, H] and down [H, I], INT4 g128.
    let gu = find("model.layers.0.mlp.experts.gate_up_proj.3");
    assert_eq!((gu.bits, gu.group_size), (4, 128));
    assert_eq!(
        (gu.out_features, gu.in_features),
        (2 * m.intermediate_size, h)
    );
    assert_eq!(
        gu.bytes,
        2 * m.intermediate_size * (h / 8 + h / 128) * 4,
        "words and scales"
    );
    let dn = find("model.layers.0.mlp.experts.down_proj.3");
    assert_eq!((dn.bits, dn.group_size, dn.out_features), (4, 128, h));
    assert_eq!(
        dn.bytes,
        h * (m.intermediate_size / 8 + m.intermediate_size / 128) * 4
    );
    let experts = p.iter().filter(|x| x.name.contains("mlp.experts.")).count();
    assert_eq!(experts, 4 * 8 * 2, "every expert of every layer packed");
    // The shared expert INT6 gapless, per-row scales.
    let sh = find("model.layers.1.mlp.shared_expert.gate_up_proj");
    assert_eq!((sh.bits, sh.group_size), (6, 0));
    assert_eq!(
        sh.bytes,
        2 * m.shared_intermediate_size * (h / 32 * 6 + 1) * 4
    );
    // INT8 projections, the lm_head included; the router and in_proj_ba stay dense.
    assert_eq!(find("model.layers.3.self_attn.o_proj.weight").bits, 8);
    assert_eq!(find("model.layers.0.linear_attn.in_proj_qkv").bits, 8);
    assert_eq!(find("model.layers.0.linear_attn.out_proj.weight").bits, 8);
    assert_eq!(find("lm_head.weight").bits, 8);
    assert_eq!(find("model.embed_tokens.weight").bits, 8);
    for dense in [
        "mlp.gate.weight",
        "in_proj_b",
        "in_proj_a",
        "shared_expert_gate",
    ] {
        assert!(
            !p.iter().any(|x| x.name.contains(dense)),
            "{dense} should stay dense"
        );
    }
    // The CUDA backend keeps every one of them packed (their shapes fit the packed kernels), so its
    // weight_bytes for each is the packed size above.
    for x in p {
        assert!(
            packed_fits(x.bits, x.group_size, x.in_features),
            "{} would be dequantised on the GPU",
            x.name
        );
        assert_eq!(
            x.bytes,
            4 * x.out_features
                * (sanmai_weights::quant::words_per_row(x.bits, x.in_features)
                    + sanmai_weights::quant::scale_cols(x.group_size, x.in_features))
        );
    }
    let total: usize = p.iter().map(|x| x.bytes).sum();
    println!(
        "PACKED check=plan config=qwen3-next-80b-a3b(4 layers, 8 experts, vocab 512) packed_tensors={} packed_bytes={total}",
        p.len()
    );

    // The grouped in_proj_qkvz, re-laid out in packed form, holds the dense re-layout's values.
    let g = &cfg.gdn;
    let init = Init::std((h as f32).powf(-0.5));
    let pre = "model.layers.0.linear_attn.";
    let qkvz = src
        .tensor(
            &format!("{pre}in_proj_qkvz.weight"),
            &[2 * g.key_dim() + 2 * g.value_dim(), h],
            init,
        )
        .unwrap()
        .into_f32();
    let ba = src
        .tensor(
            &format!("{pre}in_proj_ba.weight"),
            &[2 * g.num_v_heads, h],
            init,
        )
        .unwrap()
        .into_f32();
    let want = ungroup_qwen3_next(g, h, &qkvz, &ba);
    let Mixer::Gdn(w) = &model.layers[0].mixer else {
        panic!("layer 0 is a GDN layer");
    };
    assert!(w.in_proj_qkv.data == want.qkv, "in_proj_qkv rows");
    assert!(w.in_proj_z.data == want.z, "in_proj_z rows");
    assert!(w.in_proj_b.data == want.b, "in_proj_b rows");
    assert!(w.in_proj_a.data == want.a, "in_proj_a rows");
}

/// The full-size qwen4_exp config, shrunken the same way (4 layers with QSA, PLE and hyper-connections,
/// 8 experts, a 512-token vocabulary): routed experts INT4 g128 (fused gate|up and down), shared experts
/// INT6 gapless, projections, hyper-connection `down`/`up`, lm_head and embedding INT8; the indexer, the
/// PLE projections, `inject` and the router dense.
#[test]
fn qwen4_exp_125b_dummy_loads_packed() {
    let path = config_path("qwen4-exp-125b-a6b");
    let mut cfg = ModelConfig::from_file(&path).unwrap();
    cfg.num_layers = 4;
    cfg.layer_types.truncate(4);
    cfg.ffn_types.truncate(4);
    cfg.vocab_size = 512;
    cfg.mtp_layers = 0;
    let moe = cfg.moe.as_mut().unwrap();
    moe.num_experts = 8;
    moe.top_k = 2;
    let (h, m) = (cfg.hidden_size, cfg.moe.clone().unwrap());
    let src = Dummy::new(7).with_quantization(cfg.quantization.clone());
    let model = Model::load_with_ple(
        cfg,
        &src,
        CpuBackend::default(),
        Some(sanmai_model::PleSource::Zeros),
    )
    .unwrap();
    let p = &model.packed;
    let find = |name: &str| {
        p.iter()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("{name} not packed: {p:?}"))
    };
    let gu = find("model.layers.0.mlp.experts.gate_up_proj.3");
    assert_eq!((gu.bits, gu.group_size), (4, 128));
    assert_eq!(
        (gu.out_features, gu.in_features),
        (2 * m.intermediate_size, h)
    );
    let experts = p.iter().filter(|x| x.name.contains("mlp.experts.")).count();
    assert_eq!(experts, 4 * 8 * 2, "every expert of every layer packed");
    assert_eq!(
        find("model.layers.1.mlp.shared_expert.gate_up_proj").bits,
        6
    );
    assert_eq!(find("lm_head.weight").bits, 8);
    assert_eq!(find("model.embed_tokens.weight").bits, 8);
    assert!(p
        .iter()
        .any(|x| x.name.contains("hc_attn.down") && x.bits == 8));
    for dense in ["mlp.gate.weight", "indexer", ".ple.", "inject"] {
        assert!(
            !p.iter().any(|x| x.name.contains(dense)),
            "{dense} should stay dense"
        );
    }
    for x in p {
        assert!(
            packed_fits(x.bits, x.group_size, x.in_features),
            "{} would be dequantised on the GPU",
            x.name
        );
    }
}
