//! Chat templates rendered with minijinja against Jinja2 renderings made the way transformers
//! does it (fixture written by `tests/reference/make_template_fixtures.py`): byte-identical.

use sanmai_tokenizer::builtin::BUILTIN_CHAT_TEMPLATE;
use sanmai_tokenizer::{ChatTemplate, ContentFormat, RenderRequest, TokenizerError};
use serde_json::Value;

fn template(name: &str) -> ChatTemplate {
    let source = match name {
        "qwen3_5" => BUILTIN_CHAT_TEMPLATE,
        "qwen3" => include_str!("fixtures/qwen3_chat_template.jinja"),
        "features" => include_str!("fixtures/features_chat_template.jinja"),
        other => panic!("unknown template {other}"),
    };
    ChatTemplate::new(source).expect("template compiles")
}

fn request(value: &Value) -> RenderRequest {
    RenderRequest {
        messages: value["messages"].clone(),
        tools: match &value["tools"] {
            Value::Null => None,
            tools => Some(tools.clone()),
        },
        add_generation_prompt: value["add_generation_prompt"].as_bool().unwrap_or(false),
        kwargs: value["kwargs"].as_object().cloned().unwrap_or_default(),
        bos_token: value["bos_token"].as_str().map(String::from),
        eos_token: value["eos_token"].as_str().map(String::from),
    }
}

#[test]
fn renders_byte_identical_to_jinja2() {
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/chat_templates.json")).expect("fixture");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 30);
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let template = template(case["template"].as_str().expect("template"));
        let result = template.render(&request(&case["request"]));
        match (case.get("expected").and_then(Value::as_str), result) {
            (Some(want), Ok(got)) => {
                if got != want {
                    failures.push(format!("{name}:\n--- want\n{want}\n--- got\n{got}\n---"));
                }
            }
            (Some(_), Err(e)) => failures.push(format!("{name}: unexpected error {e}")),
            (None, Ok(got)) => failures.push(format!("{name}: rendered {got:?}, Jinja2 failed")),
            (None, Err(e)) => {
                if let Some(msg) = case["error"].as_str() {
                    match e {
                        TokenizerError::TemplateRaised(got) if got == msg => {}
                        other => failures.push(format!("{name}: want raise {msg:?}, got {other}")),
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn content_formats_are_detected_for_the_qwen_templates() {
    assert_eq!(template("qwen3_5").content_format(), ContentFormat::OpenAi);
    assert_eq!(template("qwen3").content_format(), ContentFormat::String);
}
