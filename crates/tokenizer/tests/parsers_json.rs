//! The Qwen3 / Hermes JSON tool-call parser on hand-written model outputs.

mod common;

use common::tool_stream;
use sanmai_tokenizer::parsers::{ParsedOutput, ToolCallIds, ToolEvent, ToolFormat};
use serde_json::{json, Value};

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "now", "parameters": {}}}),
    ]
}

fn parse(text: &str) -> ParsedOutput {
    ToolFormat::Qwen3Json.parse_complete_with_ids(text, &tools(), ToolCallIds::seeded(3))
}

/// Every two-piece split and the one-char-at-a-time feed give the whole text's events.
fn check_every_split(text: &str) {
    tool_stream::check_every_split(ToolFormat::Qwen3Json, &tools(), 3, text, |_| {});
}

/// `text` is content, whole and at every split.
fn check_is_content(text: &str) {
    tool_stream::check_is_content(ToolFormat::Qwen3Json, &tools(), 3, text, |_| {});
}

const CALLS: &str = "Let me look that up.\n<tool_call>\n{\"name\": \"search\", \"arguments\": \
{\"q\": \"tags like </tool_call> and {braces}\", \"n\": 3, \"opts\": {\"exact\": true, \
\"langs\": [\"en\", \"日本語\"]}}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \
\"arguments\": {}}\n</tool_call>";

#[test]
fn calls_with_nested_arguments() {
    let out = parse(CALLS);
    assert_eq!(out.content.as_deref(), Some("Let me look that up."));
    assert_eq!(out.tool_calls.len(), 2);
    assert_eq!(out.tool_calls[0].name, "search");
    assert_eq!(
        out.tool_calls[0].arguments,
        r#"{"q":"tags like </tool_call> and {braces}","n":3,"opts":{"exact":true,"langs":["en","日本語"]}}"#
    );
    assert_eq!(out.tool_calls[1].name, "now");
    assert_eq!(out.tool_calls[1].arguments, "{}");
    check_every_split(CALLS);
}

#[test]
fn argument_variants() {
    // Arguments as a JSON string, under `parameters`, and absent.
    let text = "<tool_call>\n{\"name\": \"search\", \"arguments\": \"{\\\"q\\\": \\\"x\\\"}\"}\n\
</tool_call><tool_call>{\"parameters\": {\"q\": \"y\"}, \"name\": \"search\"}</tool_call>\
<tool_call>{\"name\": \"now\"}</tool_call>";
    let out = parse(text);
    let args: Vec<&str> = out
        .tool_calls
        .iter()
        .map(|c| c.arguments.as_str())
        .collect();
    assert_eq!(args, [r#"{"q":"x"}"#, r#"{"q":"y"}"#, "{}"]);
    assert_eq!(out.content, None);
    check_every_split(text);
}

#[test]
fn malformed_calls_are_content() {
    let cases = [
        // Invalid JSON (single quotes, trailing comma).
        "<tool_call>\n{'name': 'search', 'arguments': {}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": 1,}}\n</tool_call>",
        // Unknown function, name not a string, arguments not an object.
        "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": 5, \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"search\", \"arguments\": [1]}\n</tool_call>",
        // Not an object; two objects; unterminated object; no closing tag.
        "<tool_call>\n[\"search\"]\n</tool_call>",
        "<tool_call>\n{\"name\": \"now\"}\n{\"name\": \"now\"}\n</tool_call>",
        "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}\n",
        "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n",
    ];
    for text in cases {
        check_is_content(text);
    }
}

#[test]
fn invalid_json_is_content_as_soon_as_the_object_closes() {
    let mut parser = ToolFormat::Qwen3Json.parser(&tools(), ToolCallIds::seeded(3));
    assert_eq!(parser.feed("<tool_call>\n{\"name\": nope"), vec![]);
    assert_eq!(
        parser.feed("}\n"),
        vec![ToolEvent::Content("<tool_call>\n{\"name\": nope}".into())]
    );
    assert_eq!(parser.finish(), vec![ToolEvent::Content("\n".into())]);
}

#[test]
fn ids_follow_the_generator() {
    let mut n = 0;
    let ids = ToolCallIds::from_fn(move || {
        n += 1;
        format!("call_{n}")
    });
    let out = ToolFormat::Qwen3Json.parse_complete_with_ids(CALLS, &tools(), ids);
    assert_eq!(out.tool_calls[0].id, "call_1");
    assert_eq!(out.tool_calls[1].id, "call_2");
}
