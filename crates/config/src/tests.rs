use super::*;

fn parse(text: &str) -> Result<ModelConfig> {
    ModelConfig::from_json_str(text, "config.json")
}

fn repo_config(name: &str) -> ModelConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs/models")
        .join(name);
    ModelConfig::from_file(&path).unwrap()
}

#[test]
fn qwen3_next_flat_rope_fields() {
    let c = repo_config("qwen3-next-80b-a3b.json");
    assert_eq!(c.arch, Arch::Qwen3Next);
    assert_eq!(c.num_layers, 48);
    assert_eq!(c.num_attention_layers(), 12);
    assert_eq!(c.layer_types[3], LayerType::FullAttention);
    assert_eq!(c.layer_types[0], LayerType::LinearAttention);
    assert!(c.ffn_types.iter().all(|f| *f == FfnType::Moe));
    assert_eq!(c.rope.theta, 1e7);
    assert_eq!(c.rope.rot_dim, 64);
    assert_eq!(c.rope.scaling, RopeScaling::None);
    assert_eq!(c.gdn.conv_dim(), 2 * 16 * 128 + 32 * 128);
    assert_eq!(c.moe.as_ref().unwrap().top_k, 10);
    assert_eq!(c.mtp_layers, 1);
    assert_eq!(c.eos_token_ids, vec![151645]);
    assert_eq!(c.weight_prefix, "model.");
}

#[test]
fn qwen3_5_moe_wrapper_reads_text_config() {
    let c = repo_config("qwen3.5-35b-a3b.json");
    assert_eq!(c.arch, Arch::Qwen35Moe);
    assert_eq!(c.weight_prefix, "model.language_model.");
    assert_eq!(c.vocab_size, 248320);
    assert_eq!(c.rope.mrope_section, Some([11, 11, 10]));
    assert!(c.rope.mrope_interleaved);
    assert_eq!(c.mtp_layers, 1);
    assert!(c.moe.as_ref().unwrap().norm_topk_prob);
}

#[test]
fn builtin_config_parses() {
    let c = repo_config("builtin.json");
    assert_eq!(c.arch, Arch::Qwen35Moe);
    assert!(c.vision.is_some(), "the built-in model has a vision tower");
    assert_eq!(c.eos_token_ids, vec![248046, 248044]);
    assert!(c.tie_word_embeddings);
}

#[test]
fn missing_field_is_named() {
    let err =
        parse(r#"{"model_type":"qwen3_next","vocab_size":10,"num_hidden_layers":2}"#).unwrap_err();
    assert_eq!(
        err.to_string(),
        "config.json: field `hidden_size` is missing"
    );
    let err = parse(r#"{"model_type":"qwen3_5_moe"}"#).unwrap_err();
    assert_eq!(
        err.to_string(),
        "config.json: field `text_config` is missing"
    );
    let err = parse(r#"{"model_type":"qwen3_5_moe","text_config":{"vocab_size":10}}"#).unwrap_err();
    assert_eq!(
        err.to_string(),
        "config.json: field `text_config.hidden_size` is missing"
    );
}

const SMALL: &str = r#""vocab_size":100,"hidden_size":32,"num_hidden_layers":4,"num_attention_heads":2,
    "num_key_value_heads":1,"head_dim":16,"intermediate_size":64,"linear_num_key_heads":1,
    "linear_num_value_heads":2,"linear_key_head_dim":8,"linear_value_head_dim":8"#;

const PLE_BLOCK: &str = r#""ple":{"orders":[2,3],"heads":2,"row_dim":8,"seed":0,"layer_ids":[1],
    "table_sizes":[[7,11],[13,17]],"conv_kernel":4,"conv_dilation":3,"eos_token_id":1}"#;

#[test]
fn qwen4_exp_extension_blocks_parse_independently() {
    let text = format!(r#"{{"model_type":"qwen4_exp",{SMALL}}}"#);
    let c = parse(&text).unwrap();
    assert_eq!(c.arch, Arch::Qwen4Exp);
    assert!(c.qsa.is_none() && c.ple.is_none() && c.hyper_connections.is_none());

    let qsa = r#""qsa":{"index_n_heads":4,"index_head_dim":16,"index_rope_dim":8,"index_topk":32}"#;
    let c = parse(&format!(r#"{{"model_type":"qwen4_exp",{SMALL},{qsa}}}"#)).unwrap();
    let q = c.qsa.unwrap();
    assert_eq!(
        (
            q.index_n_heads,
            q.index_head_dim,
            q.index_rope_dim,
            q.index_topk
        ),
        (4, 16, 8, 32)
    );
    assert_eq!(q.index_entry_bytes(), 18);
    assert!(c.ple.is_none() && c.hyper_connections.is_none());

    let hc = r#""hyper_connections":{"num_streams":4,"rank":8}"#;
    let c = parse(&format!(r#"{{"model_type":"qwen4_exp",{SMALL},{hc}}}"#)).unwrap();
    assert_eq!(c.hyper_connections.unwrap().num_streams, 4);

    let c = parse(&format!(
        r#"{{"model_type":"qwen4_exp",{SMALL},{PLE_BLOCK}}}"#
    ))
    .unwrap();
    let p = c.ple.unwrap();
    assert_eq!(p.layer_ids, vec![1]);
    assert_eq!(p.flat_sizes(), vec![7, 11, 13, 17]);

    // Other architectures ignore the blocks.
    let c = parse(&format!(
        r#"{{"model_type":"qwen3_5_moe_text",{SMALL},{hc}}}"#
    ))
    .unwrap();
    assert!(c.hyper_connections.is_none());
}

#[test]
fn qwen4_exp_bad_blocks_are_named() {
    let cases = [
        (
            r#""qsa":{"index_n_heads":4,"index_head_dim":16,"index_rope_dim":9,"index_topk":32}"#,
            "qsa.index_rope_dim",
        ),
        (
            r#""qsa":{"index_n_heads":4,"index_head_dim":16,"index_rope_dim":8}"#,
            "qsa.index_topk",
        ),
        (
            r#""hyper_connections":{"num_streams":0,"rank":8}"#,
            "hyper_connections.num_streams",
        ),
        (r#""ple":{"orders":[2]}"#, "ple"),
    ];
    for (block, field) in cases {
        let err = parse(&format!(r#"{{"model_type":"qwen4_exp",{SMALL},{block}}}"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("`{field}`")), "{err}");
    }
    let bad_layer = PLE_BLOCK.replace(r#""layer_ids":[1]"#, r#""layer_ids":[4]"#);
    let err = parse(&format!(
        r#"{{"model_type":"qwen4_exp",{SMALL},{bad_layer}}}"#
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`ple.layer_ids`") && err.contains("layer 4"),
        "{err}"
    );
}

#[test]
fn unknown_fields_ignored_and_wrong_types_named() {
    let text = format!(r#"{{"model_type":"qwen3_5_moe_text",{SMALL},"something_new":[1,2]}}"#);
    let c = parse(&text).unwrap();
    assert!(c.moe.is_none());
    assert!(c.ffn_types.iter().all(|f| *f == FfnType::Dense));
    let text = format!(r#"{{"model_type":"qwen3_5_moe_text",{SMALL},"rms_norm_eps":"small"}}"#);
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("`rms_norm_eps`"), "{err}");
}

#[test]
fn unsupported_model_type_and_rope_type_are_named() {
    let err = parse(r#"{"model_type":"llama"}"#).unwrap_err().to_string();
    assert!(err.contains("`llama` is not served"), "{err}");
    let text = format!(
        r#"{{"model_type":"qwen3_next",{SMALL},"rope_scaling":{{"rope_type":"longrope","factor":2}}}}"#
    );
    let err = parse(&text).unwrap_err().to_string();
    assert!(
        err.contains("rope_scaling.rope_type") && err.contains("longrope"),
        "{err}"
    );
}

#[test]
fn yarn_matches_transformers_formula() {
    // Qwen's recommended long-context setting: factor 4 over 32k, on a 128-dim head with full rotation.
    let text = format!(
        r#"{{"model_type":"qwen3_next",{SMALL},"head_dim":128,"partial_rotary_factor":1.0,"rope_theta":1000000,
        "rope_scaling":{{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}}}}"#
    );
    let c = parse(&text).unwrap();
    let f = c.rope.inv_freq();
    assert_eq!(f.len(), 64);
    // transformers: attention_factor = 0.1·ln(4) + 1
    assert!((c.rope.attention_factor() - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
    // low = floor(128·ln(32768/(32·2π)) / (2·ln 1e6)) = floor(23.25) = 23 → extrapolated (unscaled) below it;
    // high = ceil(128·ln(32768/(2π)) / (2·ln 1e6)) = ceil(39.6) = 40 → fully interpolated (÷4) from it.
    let plain = |j: usize| 1.0 / 1e6f64.powf(2.0 * j as f64 / 128.0);
    assert!((f[0] as f64 - plain(0)).abs() < 1e-7);
    assert!((f[23] as f64 - plain(23)).abs() / plain(23) < 1e-6);
    assert!((f[40] as f64 - plain(40) / 4.0).abs() / plain(40) < 1e-6);
    assert!((f[63] as f64 - plain(63) / 4.0).abs() / plain(63) < 1e-6);
    let ramp = (30.0 - 23.0) / (40.0 - 23.0);
    let mid = plain(30) / 4.0 * ramp + plain(30) * (1.0 - ramp);
    assert!((f[30] as f64 - mid).abs() / mid < 1e-6);
}

#[test]
fn rope_parameters_win_over_flat_fields() {
    let text = format!(
        r#"{{"model_type":"qwen3_5_moe_text",{SMALL},"rope_theta":5.0,
        "rope_parameters":{{"rope_type":"default","rope_theta":100.0,"partial_rotary_factor":0.5}}}}"#
    );
    let c = parse(&text).unwrap();
    assert_eq!(c.rope.theta, 100.0);
    assert_eq!(c.rope.rot_dim, 8);
}

#[test]
fn qwen4_exp_full_size_config() {
    let c = repo_config("qwen4-exp-125b-a6b.json");
    assert_eq!(c.arch, Arch::Qwen4Exp);
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.num_layers),
        (248320, 2560, 48)
    );
    assert_eq!((c.num_attention_layers(), c.num_gdn_layers()), (12, 36));
    assert_eq!((c.attention.num_heads, c.attention.num_kv_heads), (24, 2));
    assert_eq!(c.attention.head_dim, 256);
    assert_eq!((c.gdn.num_k_heads, c.gdn.num_v_heads), (16, 48));
    // GDN state per layer: 48·128·128 f32 = 3,145,728 B; conv 3·10240 bf16 = 61,440 B.
    assert_eq!(
        c.gdn.num_v_heads * c.gdn.k_head_dim * c.gdn.v_head_dim * 4,
        3_145_728
    );
    assert_eq!((c.gdn.conv_kernel - 1) * c.gdn.conv_dim() * 2, 61_440);
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.intermediate_size),
        (512, 10, 640)
    );
    assert_eq!(moe.shared_intermediate_size, 640);
    let q = c.qsa.as_ref().unwrap();
    assert_eq!(
        (q.index_n_heads, q.index_head_dim, q.index_topk),
        (16, 64, 2048)
    );
    assert_eq!(q.index_entry_bytes(), 66);
    let p = c.ple.as_ref().unwrap();
    assert_eq!(p.num_tables(), 16);
    let bytes: u64 = p.flat_sizes().iter().sum::<u64>() * p.row_bytes() as u64;
    assert!((bytes as f64 / (1u64 << 30) as f64 - 95.37).abs() < 0.01);
    let hc = c.hyper_connections.as_ref().unwrap();
    assert_eq!((hc.num_streams, hc.rank), (4, 256));
    assert_eq!(c.mtp_layers, 1);
    assert_eq!(c.max_position_embeddings, 262144);
    assert!(c.quantization.is_some());
}

#[test]
fn qwen4_exp_tiny_config_has_every_block() {
    let c = repo_config("qwen4-exp-tiny.json");
    assert_eq!(c.arch, Arch::Qwen4Exp);
    assert!(c.qsa.is_some() && c.ple.is_some() && c.hyper_connections.is_some());
    assert_eq!(c.mtp_layers, 1);
}

#[test]
fn qwen4_exp_full_size_quantization_follows_the_spec_mix() {
    let c = repo_config("qwen4-exp-125b-a6b.json");
    let q = c.quantization.as_ref().unwrap();
    let scheme = |m: &str| q.scheme_for(m).map(|s| (s.bits, s.group_size));
    let l = "model.layers.3.";
    assert_eq!(
        scheme(&format!("{l}mlp.experts.7.gate_proj")),
        Some((4, 128))
    );
    assert_eq!(
        scheme(&format!("{l}mlp.experts.511.down_proj")),
        Some((4, 128))
    );
    assert_eq!(
        scheme(&format!("{l}mlp.shared_expert.up_proj")),
        Some((6, 0))
    );
    assert!(q
        .scheme_for(&format!("{l}mlp.shared_expert.up_proj"))
        .unwrap()
        .gapless());
    for m in [
        "self_attn.q_proj",
        "self_attn.o_proj",
        "hc_attn.down",
        "hc_ffn.up",
    ] {
        assert_eq!(scheme(&format!("{l}{m}")), Some((8, 0)), "{m}");
    }
    let g = "model.layers.0.linear_attn.";
    assert_eq!(scheme(&format!("{g}in_proj_qkv")), Some((8, 0)));
    assert_eq!(scheme(&format!("{g}out_proj")), Some((8, 0)));
    assert_eq!(scheme("lm_head"), Some((8, 0)));
    assert_eq!(scheme("model.embed_tokens"), Some((8, 0)));
    for m in [
        "model.layers.0.linear_attn.in_proj_b",
        "model.layers.0.linear_attn.in_proj_a",
        "model.layers.3.mlp.gate",
        "model.layers.3.mlp.shared_expert_gate",
        "model.layers.3.hc_attn.inject",
        "model.layers.3.self_attn.indexer.wq",
        "model.layers.3.self_attn.indexer.weights_proj",
        "model.layers.1.ple.value",
        "model.layers.1.ple.key.2",
        "mtp.fc",
    ] {
        assert_eq!(scheme(m), None, "{m} stays bf16");
    }
}

#[test]
fn ple_config_errors_name_the_field() {
    let base = serde_json::json!({
        "orders": [2, 3], "heads": 2, "row_dim": 4, "seed": 0, "layer_ids": [1],
        "table_sizes": [[7, 5], [3, 2]], "conv_kernel": 4, "conv_dilation": 3, "eos_token_id": 1
    });
    let err_field = |patch: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        patch(&mut v);
        match PleConfig::from_block(&v) {
            Err(PleConfigError { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    };
    assert_eq!(
        err_field(&|v| {
            v.as_object_mut().unwrap().remove("heads");
        }),
        "heads"
    );
    assert_eq!(
        err_field(&|v| v["row_dim"] = serde_json::json!(0)),
        "row_dim"
    );
    assert_eq!(
        err_field(&|v| v["table_sizes"] = serde_json::json!([[7, 5]])),
        "table_sizes"
    );
    assert_eq!(
        err_field(&|v| v["table_sizes"][1] = serde_json::json!([3])),
        "table_sizes[1]"
    );
    assert_eq!(
        err_field(&|v| v["table_sizes"][1][0] = serde_json::json!(0)),
        "table_sizes[1][0]"
    );
    assert_eq!(
        err_field(&|v| v["orders"][1] = serde_json::json!("x")),
        "orders[1]"
    );
    assert_eq!(
        err_field(&|v| v["eos_token_id"] = serde_json::json!(1.5)),
        "eos_token_id"
    );
    assert_eq!(err_field(&|v| v["seed"] = serde_json::json!(-1)), "seed");
    let whole = serde_json::json!({"text_config": {"ple": base.clone()}});
    assert_eq!(
        PleConfig::from_model_config(&whole).unwrap().num_tables(),
        4
    );
    assert!(matches!(
        PleConfig::from_model_config(&serde_json::json!({"hidden_size": 4})),
        Err(PleConfigError { field, .. }) if field == "ple"
    ));
}

/// A `quantization_config` with `quant_method: fp8` is the FP8 block config, not a compressed-tensors
/// one; other methods are refused naming the field.
#[test]
fn fp8_quantization_config_is_read_by_its_method() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/qwen3-next-80b-a3b.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]});
    let c = ModelConfig::from_value(&v, "config.json").unwrap();
    assert!(c.quantization.is_none());
    assert_eq!(c.fp8.as_ref().unwrap().block, [128, 128]);
    v["quantization_config"]["activation_scheme"] = "static".into();
    let e = ModelConfig::from_value(&v, "config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("quantization_config.activation_scheme"), "{e}");
    v["quantization_config"] = serde_json::json!({"quant_method": "awq"});
    let e = ModelConfig::from_value(&v, "config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("quant_method") && e.contains("awq"), "{e}");
}

#[test]
fn vision_spec_of_the_wrapper() {
    let c = repo_config("qwen3.5-35b-a3b.json");
    let v = c.vision.as_ref().expect("the wrapper has a vision_config");
    assert_eq!(v.image_token_id, 248056);
    assert_eq!(v.video_token_id, 248057);
    assert_eq!(
        (v.vision_start_token_id, v.vision_end_token_id),
        (248053, 248054)
    );
    assert_eq!(v.config["depth"], 27);
    assert_eq!(v.config["out_hidden_size"], 2048);
    // Text-only configs carry none.
    assert!(repo_config("qwen3-next-80b-a3b.json").vision.is_none());
}

#[test]
fn vision_token_ids_default_and_are_checked() {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/qwen3.5-35b-a3b.json"),
    )
    .unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    let top = v.as_object_mut().unwrap();
    top.remove("image_token_id");
    top.insert("vision_end_token_id".into(), 7.into());
    let c = ModelConfig::from_value(&v, "config.json").unwrap();
    let s = c.vision.unwrap();
    assert_eq!((s.image_token_id, s.vision_end_token_id), (248056, 7));

    v["image_token_id"] = "pad".into();
    let e = ModelConfig::from_value(&v, "config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`image_token_id`"), "{e}");
    v["image_token_id"] = 5.into();
    v["vision_config"] = 3.into();
    let e = ModelConfig::from_value(&v, "config.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`vision_config`"), "{e}");
}
