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
    assert_eq!(c.arch, Arch::Qwen35MoeText);
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
