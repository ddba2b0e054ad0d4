//! Streaming a tool-call parser over pieces of a response, the check that every split of a text
//! gives the events of the whole, and the check that a malformed call is content.

use sanmai_tokenizer::parsers::{ParsedOutput, ToolCallIds, ToolEvent, ToolFormat};
use serde_json::Value;

/// Feeds `pieces` to a fresh `format` parser (call ids seeded with `seed`) and returns all its
/// events; `each_feed` sees the events of every `feed` call.
pub fn stream_with(
    format: ToolFormat,
    tools: &[Value],
    seed: u64,
    pieces: &[&str],
    mut each_feed: impl FnMut(&[ToolEvent]),
) -> Vec<ToolEvent> {
    let mut parser = format.parser(tools, ToolCallIds::seeded(seed));
    let mut events = Vec::new();
    for piece in pieces {
        let fed = parser.feed(piece);
        each_feed(&fed);
        events.extend(fed);
    }
    events.extend(parser.finish());
    events
}

/// [`stream_with`] without a look at each feed.
pub fn stream(format: ToolFormat, tools: &[Value], seed: u64, pieces: &[&str]) -> Vec<ToolEvent> {
    stream_with(format, tools, seed, pieces, |_| {})
}

/// Merges adjacent content events, so runs split differently compare equal.
pub fn coalesce(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::new();
    for event in events {
        match (out.last_mut(), event) {
            (Some(ToolEvent::Content(last)), ToolEvent::Content(text)) => last.push_str(&text),
            (_, event) => out.push(event),
        }
    }
    out
}

/// Streaming `text` whole is what `parse_complete_with_ids` gives, and split at every char
/// boundary (in two pieces) and one char at a time it gives the whole text's events (adjacent
/// content merged). `each_feed` sees the events of every feed of the char-by-char run.
pub fn check_every_split(
    format: ToolFormat,
    tools: &[Value],
    seed: u64,
    text: &str,
    each_feed: impl FnMut(&[ToolEvent]),
) {
    let whole = coalesce(stream(format, tools, seed, &[text]));
    assert_eq!(
        ParsedOutput::from_events(whole.clone()),
        format.parse_complete_with_ids(text, tools, ToolCallIds::seeded(seed))
    );
    for (at, _) in text.char_indices().skip(1) {
        let events = stream(format, tools, seed, &[&text[..at], &text[at..]]);
        assert_eq!(coalesce(events), whole, "split at byte {at} of {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    let events = stream_with(format, tools, seed, &pieces, each_feed);
    assert_eq!(coalesce(events), whole, "char by char: {text:?}");
}

/// `text` (a malformed call) parses to no call and itself as content, and [`check_every_split`]
/// holds for it.
pub fn check_is_content(
    format: ToolFormat,
    tools: &[Value],
    seed: u64,
    text: &str,
    each_feed: impl FnMut(&[ToolEvent]),
) {
    let out = format.parse_complete_with_ids(text, tools, ToolCallIds::seeded(seed));
    assert!(out.tool_calls.is_empty(), "{text:?} gave {out:?}");
    assert_eq!(out.content.as_deref(), Some(text));
    check_every_split(format, tools, seed, text, each_feed);
}
