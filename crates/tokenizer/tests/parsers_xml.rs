//! The Qwen3 XML tool-call parser on hand-written model outputs: typed parameters, several
//! calls, content around them, malformed calls as content, and streaming at every split point.

mod common;

use common::tool_stream;
use sanmai_tokenizer::parsers::{
    tool_parser, ParsedOutput, ToolCallIds, ToolEvent, ToolFormat, ToolParser,
};
use serde_json::{json, Value};

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "write_file", "parameters": {
            "type": "object", "properties": {
                "path": {"type": "string"}, "content": {"type": "string"},
                "mode": {"type": "integer"}, "append": {"type": "boolean"},
                "ratio": {"type": "number"}, "meta": {"type": "object"},
                "tags": {"type": "array"}, "note": {"type": ["string", "null"]}}}}}),
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}}}}}),
    ]
}

const TWO_CALLS: &str = "I'll write the file.\n\n<tool_call>\n<function=write_file>\n\
<parameter=path>\n/tmp/a.rs\n</parameter>\n<parameter=content>\nfn main() {\n    \
if a < b && c > d { println!(\"</parameter> is literal\"); }\n}\n\n</parameter>\n\
<parameter=mode>\n644\n</parameter>\n<parameter=append>\nfalse\n</parameter>\n\
<parameter=ratio>\n0.5\n</parameter>\n<parameter=meta>\n{\"owner\": \"me\", \"nested\": \
{\"k\": [1, 2]}}\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n\
<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n\
<function=get_weather>\n<parameter=city>\nZürich 🌧\n</parameter>\n<parameter=days>\n3\n\
</parameter>\n</function>\n</tool_call>\n";

fn parse(text: &str) -> ParsedOutput {
    ToolFormat::Qwen3Xml.parse_complete_with_ids(text, &tools(), ToolCallIds::seeded(9))
}

/// Start, Arguments and End of a call are never split across feeds: one feed's events.
fn calls_whole(events: &[ToolEvent]) {
    let starts = events
        .iter()
        .filter(|e| matches!(e, ToolEvent::Start { .. }));
    let ends = events.iter().filter(|e| matches!(e, ToolEvent::End { .. }));
    assert_eq!(starts.count(), ends.count());
}

/// Streaming `text` split at every char boundary (in two pieces) and one char at a time gives
/// the events of the whole text, and each call's events arrive together and complete.
fn check_every_split(text: &str) {
    tool_stream::check_every_split(ToolFormat::Qwen3Xml, &tools(), 9, text, calls_whole);
}

/// `text` is content, whole and at every split.
fn check_is_content(text: &str) {
    tool_stream::check_is_content(ToolFormat::Qwen3Xml, &tools(), 9, text, calls_whole);
}

#[test]
fn two_calls_with_typed_parameters() {
    let out = parse(TWO_CALLS);
    assert_eq!(out.content.as_deref(), Some("I'll write the file."));
    assert_eq!(out.tool_calls.len(), 2);
    let write = &out.tool_calls[0];
    assert_eq!(write.name, "write_file");
    assert!(write.id.starts_with("call_") && write.id.len() == 29);
    assert_eq!(
        write.arguments,
        r#"{"path":"/tmp/a.rs","content":"fn main() {\n    if a < b && c > d { println!(\"</parameter> is literal\"); }\n}\n","mode":644,"append":false,"ratio":0.5,"meta":{"owner":"me","nested":{"k":[1,2]}},"tags":["a","b"],"note":null}"#
    );
    let weather = &out.tool_calls[1];
    assert_eq!(weather.name, "get_weather");
    assert_eq!(weather.arguments, r#"{"city":"Zürich 🌧","days":3}"#);
    assert_ne!(weather.id, write.id);
}

#[test]
fn streaming_matches_whole_text_at_every_split() {
    check_every_split(TWO_CALLS);
    check_every_split("Before <tool_call> after, <tool_ca and <tool_call>\n<function=nope>\n</function>\n</tool_call> tail");
    check_every_split("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n\nThat was it.\n");
    check_every_split("<tool_call>\n<function=get_weather>\n<parameter=city>\nunterminated");
}

#[test]
fn content_streams_as_it_arrives() {
    let mut parser = ToolFormat::Qwen3Xml.parser(&tools(), ToolCallIds::seeded(1));
    assert_eq!(
        parser.feed("Hello wor"),
        vec![ToolEvent::Content("Hello wor".into())]
    );
    // A possible tag and the whitespace before it are held back.
    assert_eq!(
        parser.feed("ld \n<tool"),
        vec![ToolEvent::Content("ld".into())]
    );
    assert_eq!(
        parser.feed("box>"),
        vec![ToolEvent::Content(" \n<toolbox>".into())]
    );
    assert_eq!(parser.feed("<tool_call>\n<function=get_weather>"), vec![]);
    let events = parser.feed("\n</function>\n</tool_call>");
    assert!(matches!(&events[0], ToolEvent::Start { index: 0, name, .. } if name == "get_weather"));
    assert_eq!(
        events[1],
        ToolEvent::Arguments {
            index: 0,
            fragment: "{}".into()
        }
    );
    assert_eq!(events[2], ToolEvent::End { index: 0 });
    assert_eq!(parser.finish(), vec![]);
}

#[test]
fn text_without_calls_is_untouched() {
    let text = "Plain answer with <b>tags</b>, a < b, and trailing space \n";
    let out = parse(text);
    assert_eq!(out.content.as_deref(), Some(text));
    assert!(out.tool_calls.is_empty());
    assert_eq!(parse(""), ParsedOutput::default());
}

#[test]
fn text_after_a_call_keeps_its_separation() {
    let text = "A\n\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>\n\nB";
    let out = parse(text);
    assert_eq!(out.content.as_deref(), Some("A\n\nB"));
    assert_eq!(out.tool_calls.len(), 1);
}

#[test]
fn malformed_calls_are_content() {
    let cases = [
        // Unterminated at the end of the response.
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
        // Missing </function>.
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        // A function the request did not offer.
        "<tool_call>\n<function=delete_everything>\n</function>\n</tool_call>",
        // A name with a space, an empty name.
        "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        // Stray text in the body, no <function=> at all.
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",
        // Missing </parameter>.
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    ];
    for text in cases {
        check_is_content(text);
    }
}

#[test]
fn a_bad_call_does_not_hide_a_good_one() {
    let text = "<tool_call>\n<function=unknown_fn>\n</function>\n</tool_call>\n\
<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
    let out = parse(text);
    assert_eq!(
        out.content.as_deref(),
        Some("<tool_call>\n<function=unknown_fn>\n</function>\n</tool_call>")
    );
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].arguments, r#"{"days":2}"#);
    check_every_split(text);
}

#[test]
fn unknown_name_is_content_as_soon_as_it_is_read() {
    let mut parser = ToolFormat::Qwen3Xml.parser(&tools(), ToolCallIds::seeded(1));
    assert_eq!(parser.feed("<tool_call>\n<function=rm_rf"), vec![]);
    assert_eq!(
        parser.feed(">\n"),
        vec![ToolEvent::Content("<tool_call>\n<function=rm_rf>".into())]
    );
}

#[test]
fn values_are_typed_by_schema_or_guessed() {
    let text = "<tool_call>\n<function=write_file>\n<parameter=mode>\nnot a number\n\
</parameter>\n<parameter=append>\nTRUE\n</parameter>\n<parameter=meta>\n{broken\n</parameter>\n\
<parameter=path>\n\n  two leading newlines, one stays\n\n</parameter>\n\
<parameter=extra>\n[1, {\"x\": null}]\n</parameter>\n<parameter=extra2>\nfree text\n</parameter>\n\
<parameter=note>\nNone\n</parameter>\n</function>\n</tool_call>";
    let out = parse(text);
    let args: Value = serde_json::from_str(&out.tool_calls[0].arguments).unwrap();
    assert_eq!(
        args,
        json!({"mode": "not a number", "append": true, "meta": "{broken",
            "path": "\n  two leading newlines, one stays\n", "extra": [1, {"x": null}],
            "extra2": "free text", "note": null})
    );
}

#[test]
fn without_tools_any_name_is_accepted_and_values_are_guessed() {
    let text = "<tool_call>\n<function=anything>\n<parameter=n>\n12\n</parameter>\n\
<parameter=s>\nhi\n</parameter>\n</function>\n</tool_call>";
    let out = ToolFormat::Qwen3Xml.parse_complete(text, &[]);
    assert_eq!(out.tool_calls[0].name, "anything");
    assert_eq!(out.tool_calls[0].arguments, r#"{"n":12,"s":"hi"}"#);
}

#[test]
fn parsers_by_name_and_template_detection() {
    for (name, format) in [
        ("qwen3_xml", ToolFormat::Qwen3Xml),
        ("qwen3_coder", ToolFormat::Qwen3Xml),
        ("Qwen3-Coder", ToolFormat::Qwen3Xml),
        ("hermes", ToolFormat::Qwen3Json),
        ("qwen3_json", ToolFormat::Qwen3Json),
    ] {
        assert_eq!(ToolFormat::from_name(name), Ok(format));
    }
    assert!(ToolFormat::from_name("mistral").is_err());
    assert!(tool_parser("llama3_json", &[], ToolCallIds::seeded(0)).is_err());
    let mut parser: Box<dyn ToolParser> =
        tool_parser("qwen3_coder", &tools(), ToolCallIds::seeded(0)).unwrap();
    assert_eq!(parser.feed("hi"), vec![ToolEvent::Content("hi".into())]);

    let qwen35 = include_str!("../data/qwen3_5_chat_template.jinja");
    let qwen3 = include_str!("fixtures/qwen3_chat_template.jinja");
    assert_eq!(
        sanmai_tokenizer::parsers::detect_from_template(qwen35),
        ToolFormat::Qwen3Xml
    );
    assert_eq!(
        sanmai_tokenizer::parsers::detect_from_template(qwen3),
        ToolFormat::Qwen3Json
    );
}
