//! Loading a model directory: tokenizer.json, tokenizer_config.json, chat_template.jinja and
//! generation_config.json, and the errors that name the file and field at fault.

mod common;

use common::{byte_fallback_tokenizer_json, TempDir};
use sanmai_tokenizer::{Tokenizer, TokenizerError};
use serde_json::json;

fn model_dir(name: &str) -> (TempDir, u32) {
    let dir = TempDir::new(name);
    let (tok, size) = byte_fallback_tokenizer_json();
    dir.write("tokenizer.json", &tok.to_string());
    (dir, size)
}

#[test]
fn loads_tokens_template_and_eos_ids() {
    let (dir, size) = model_dir("full");
    let config = json!({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false},
        "pad_token": null,
        "added_tokens_decoder": {
            "0": {"content": "<unk>", "special": true},
            "1": {"content": "<s>", "special": true},
            "2": {"content": "</s>", "special": true},
            size.to_string(): {"content": "<|tool|>", "special": true},
            (size + 1).to_string(): {"content": "[[plain]]", "special": false}
        },
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"}
        ]
    });
    dir.write("tokenizer_config.json", &config.to_string());
    dir.write(
        "generation_config.json",
        r#"{"eos_token_id": [7, 2], "bos_token_id": 1}"#,
    );

    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("</s>"));
    assert_eq!(tok.pad_token(), None);
    // generation_config's ids first, the config's eos token already among them.
    assert_eq!(tok.eos_token_ids(), &[7, 2]);
    // Added tokens from tokenizer_config.json that tokenizer.json lacks get their ids.
    assert_eq!(tok.token_to_id("<|tool|>"), Some(size));
    assert_eq!(tok.token_to_id("[[plain]]"), Some(size + 1));
    assert!(tok.is_special(size));
    assert!(!tok.is_special(size + 1));
    assert_eq!(tok.vocab_size(), size as usize + 2);

    // add_special_tokens runs the BOS post-processor; special text is recognised either way.
    let ids = tok.encode("Hello<|tool|>", true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.last(), Some(&size));
    assert_eq!(
        tok.encode("Hello", false).unwrap(),
        vec![tok.token_to_id("▁Hello").unwrap()]
    );
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<s> Hello<|tool|>");

    let template = tok.chat_template().expect("template");
    let text = template
        .render(&tok.chat_request(json!([{"role": "user", "content": "hi"}])))
        .unwrap();
    assert_eq!(text, "<s>[user] hi\n");
}

#[test]
fn chat_template_jinja_wins_and_eos_can_be_a_single_id() {
    let (dir, _) = model_dir("jinja");
    dir.write(
        "tokenizer_config.json",
        r#"{"eos_token": "</s>", "chat_template": "from config"}"#,
    );
    dir.write("chat_template.jinja", "from file: {{ messages | length }}");
    dir.write("generation_config.json", r#"{"eos_token_id": 5}"#);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_token_ids(), &[5, 2]);
    let out = tok
        .chat_template()
        .unwrap()
        .render(&tok.chat_request(json!([{"role": "user", "content": "x"}])))
        .unwrap();
    assert_eq!(out, "from file: 1");
}

#[test]
fn tokenizer_json_alone_is_enough() {
    let (dir, size) = model_dir("bare");
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(tok.chat_template().is_none());
    assert!(tok.eos_token_ids().is_empty());
    assert_eq!(tok.vocab_size(), size as usize);
    assert_eq!(tok.id_to_token(3).as_deref(), Some("<0x00>"));
    assert!(tok.is_byte_piece(3));
    assert!(!tok.is_byte_piece(2));
}

fn load_err(files: &[(&str, &str)]) -> TokenizerError {
    let (dir, _) = model_dir("errors");
    for (name, text) in files {
        dir.write(name, text);
    }
    Tokenizer::from_dir(dir.path()).unwrap_err()
}

#[test]
fn errors_name_the_file_and_field() {
    let missing = TempDir::new("missing");
    let err = Tokenizer::from_dir(missing.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let err = load_err(&[("tokenizer_config.json", "{not json")]);
    assert!(matches!(err, TokenizerError::Json { .. }));
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

    let cases = [
        (
            ("tokenizer_config.json", r#"{"eos_token": 5}"#),
            "eos_token",
        ),
        (
            ("tokenizer_config.json", r#"{"eos_token": "<nope>"}"#),
            "eos_token",
        ),
        (
            ("tokenizer_config.json", r#"{"bos_token": {"id": 1}}"#),
            "bos_token",
        ),
        (
            ("tokenizer_config.json", r#"{"chat_template": 3}"#),
            "chat_template",
        ),
        (
            (
                "tokenizer_config.json",
                r#"{"added_tokens_decoder": {"9": {"content": "</s>"}}}"#,
            ),
            "added_tokens_decoder.9",
        ),
        (
            (
                "tokenizer_config.json",
                r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#,
            ),
            "added_tokens_decoder.x",
        ),
        (
            ("generation_config.json", r#"{"eos_token_id": "2"}"#),
            "eos_token_id",
        ),
        (
            ("generation_config.json", r#"{"eos_token_id": [2, -1]}"#),
            "eos_token_id",
        ),
    ];
    for ((file, text), field) in cases {
        let err = load_err(&[(file, text)]);
        let msg = err.to_string();
        assert!(
            msg.contains(file) && msg.contains(field),
            "{file} {text}: {msg}"
        );
    }

    let err = load_err(&[("chat_template.jinja", "{% for %}")]);
    assert!(matches!(err, TokenizerError::TemplateSyntax(_)), "{err}");

    let err = load_err(&[("tokenizer.json", "{\"model\": 3}")]);
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}
