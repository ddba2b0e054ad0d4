//! Reasoning then tool calls, as the server runs them: the reasoning parser's content feeds the
//! tool parser, streamed at every split point, and a long streamed argument.

use sanmai_tokenizer::parsers::{
    ParsedOutput, ReasoningParser, ToolCallIds, ToolEvent, ToolFormat,
};
use serde_json::{json, Value};
use std::time::Instant;

fn tools() -> Vec<Value> {
    vec![json!({"type": "function", "function": {"name": "run",
        "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string"}, "timeout": {"type": "integer"}}}}})]
}

/// Runs both parsers over `pieces`; returns (reasoning, parsed content and calls).
fn pipeline(format: ToolFormat, starts: bool, pieces: &[&str]) -> (String, ParsedOutput) {
    let mut reasoning = ReasoningParser::new(starts);
    let mut tools = format.parser(&tools(), ToolCallIds::seeded(5));
    let mut thought = String::new();
    let mut events: Vec<ToolEvent> = Vec::new();
    for piece in pieces {
        let split = reasoning.feed(piece);
        thought.push_str(&split.reasoning);
        events.extend(tools.feed(&split.content));
    }
    let split = reasoning.finish();
    thought.push_str(&split.reasoning);
    events.extend(tools.feed(&split.content));
    events.extend(tools.finish());
    (thought, ParsedOutput::from_events(events))
}

fn check_every_split(format: ToolFormat, starts: bool, text: &str) -> (String, ParsedOutput) {
    let whole = pipeline(format, starts, &[text]);
    for (at, _) in text.char_indices().skip(1) {
        let out = pipeline(format, starts, &[&text[..at], &text[at..]]);
        assert_eq!(out, whole, "split at {at}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(pipeline(format, starts, &pieces), whole, "char by char");
    whole
}

#[test]
fn reasoning_then_xml_call() {
    let text = "The user wants `ls`. A call looks like <tool_call>...\n</think>\n\n\
Running it.\n\n<tool_call>\n<function=run>\n<parameter=cmd>\nls -la | grep '<x>'\n\
</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>";
    let (thought, out) = check_every_split(ToolFormat::Qwen3Xml, true, text);
    assert_eq!(
        thought,
        "The user wants `ls`. A call looks like <tool_call>..."
    );
    assert_eq!(out.content.as_deref(), Some("Running it."));
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(
        out.tool_calls[0].arguments,
        r#"{"cmd":"ls -la | grep '<x>'","timeout":30}"#
    );
}

#[test]
fn call_inside_closed_reasoning_is_not_parsed() {
    let text =
        "<think>\nMaybe <tool_call>\n{\"name\": \"run\", \"arguments\": {}}\n</tool_call>?\n\
</think>\n\nNo call needed.";
    let (thought, out) = check_every_split(ToolFormat::Qwen3Json, false, text);
    assert!(thought.contains("\"name\": \"run\""));
    assert_eq!(out.content.as_deref(), Some("No call needed."));
    assert!(out.tool_calls.is_empty());
}

#[test]
fn unclosed_reasoning_ending_in_a_call() {
    let text = "Need to run it.\n<tool_call>\n<function=run>\n<parameter=cmd>\npwd\n</parameter>\n\
</function>\n</tool_call>";
    let (thought, out) = check_every_split(ToolFormat::Qwen3Xml, true, text);
    assert_eq!(thought, "Need to run it.");
    assert_eq!(out.content, None);
    assert_eq!(out.tool_calls[0].name, "run");
    assert_eq!(out.tool_calls[0].arguments, r#"{"cmd":"pwd"}"#);
}

#[test]
fn long_argument_streams_in_linear_time() {
    // 512 KiB of code in one parameter, fed 4 bytes at a time (131k feeds): a parser that
    // rescanned the whole call per feed would do ~3.4e10 byte steps.
    let line = "    if a < b { return \"</parameter>\"; } // é\n";
    let body: String = line.repeat((512 << 10) / line.len());
    let text = format!(
        "<tool_call>\n<function=run>\n<parameter=cmd>\n{body}</parameter>\n</function>\n</tool_call>"
    );
    let mut pieces = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let mut end = (at + 4).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        pieces.push(&text[at..end]);
        at = end;
    }
    let start = Instant::now();
    let (_, out) = pipeline(ToolFormat::Qwen3Xml, false, &pieces);
    let elapsed = start.elapsed();
    let args: Value = serde_json::from_str(&out.tool_calls[0].arguments).unwrap();
    assert_eq!(
        args["cmd"].as_str().unwrap(),
        body.strip_suffix('\n').unwrap()
    );
    eprintln!(
        "{} feeds of a {} byte call: {elapsed:?}",
        pieces.len(),
        text.len()
    );
}
