//! A chat choice's generated text → what the client sees: reasoning (`<think>` … `</think>`), content and
//! tool calls, through the tokenizer crate's streaming parsers. The same [`ChatOutput`] serves streamed
//! and whole responses, so both give the same split.

use sanmai_tokenizer::parsers::{
    ReasoningDelta, ReasoningParser, ToolCallIds, ToolEvent, ToolParser,
};
use serde_json::Value;

pub use sanmai_tokenizer::parsers::ToolFormat;

/// One piece of a choice's output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    /// A tool call begins (its arguments follow).
    ToolStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolArguments {
        index: usize,
        fragment: String,
    },
}

/// A tool-call parser of `format` for a request's `tools`.
pub fn tool_parser(format: ToolFormat, tools: &[Value]) -> Box<dyn ToolParser> {
    format.parser(tools, ToolCallIds::random())
}

/// The parsers of one chat choice.
pub struct ChatOutput {
    reasoning: ReasoningParser,
    tools: Option<Box<dyn ToolParser>>,
    tool_calls: usize,
}

impl ChatOutput {
    /// `starts_in_reasoning`: the rendered prompt opened a `<think>` block; `tools`: the parser for
    /// tool calls, `None` when tools are not offered (or `tool_choice` is `none`).
    pub fn new(starts_in_reasoning: bool, tools: Option<Box<dyn ToolParser>>) -> ChatOutput {
        ChatOutput {
            reasoning: ReasoningParser::new(starts_in_reasoning),
            tools,
            tool_calls: 0,
        }
    }

    /// Feeds newly generated text; returns what can be shown now.
    pub fn feed(&mut self, text: &str) -> Vec<Delta> {
        if text.is_empty() {
            return Vec::new();
        }
        let split = self.reasoning.feed(text);
        let mut out = Vec::new();
        self.route(split, &mut out);
        out
    }

    /// Ends the choice: releases everything held back.
    pub fn finish(&mut self) -> Vec<Delta> {
        let split = self.reasoning.finish();
        let mut out = Vec::new();
        self.route(split, &mut out);
        if let Some(tools) = &mut self.tools {
            let events = tools.finish();
            push_events(events, &mut out, &mut self.tool_calls);
        }
        out
    }

    /// Whether any tool call was emitted.
    pub fn has_tool_calls(&self) -> bool {
        self.tool_calls > 0
    }

    fn route(&mut self, split: ReasoningDelta, out: &mut Vec<Delta>) {
        if !split.reasoning.is_empty() {
            out.push(Delta::Reasoning(split.reasoning));
        }
        if split.content.is_empty() {
            return;
        }
        match &mut self.tools {
            None => push_content(out, split.content),
            Some(tools) => {
                let events = tools.feed(&split.content);
                push_events(events, out, &mut self.tool_calls);
            }
        }
    }
}

fn push_events(events: Vec<ToolEvent>, out: &mut Vec<Delta>, calls: &mut usize) {
    for ev in events {
        match ev {
            ToolEvent::Content(text) => push_content(out, text),
            ToolEvent::Start { index, id, name } => {
                *calls += 1;
                out.push(Delta::ToolStart { index, id, name });
            }
            ToolEvent::Arguments { index, fragment } => {
                out.push(Delta::ToolArguments { index, fragment })
            }
            ToolEvent::End { .. } => {}
        }
    }
}

fn push_content(out: &mut Vec<Delta>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(Delta::Content(prev)) = out.last_mut() {
        prev.push_str(&text);
    } else {
        out.push(Delta::Content(text));
    }
}

/// A whole choice assembled from its deltas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    pub reasoning: String,
    pub content: String,
    /// `(id, name, arguments)` per call.
    pub tool_calls: Vec<(String, String, String)>,
}

impl Message {
    pub fn push(&mut self, delta: Delta) {
        match delta {
            Delta::Reasoning(s) => self.reasoning.push_str(&s),
            Delta::Content(s) => self.content.push_str(&s),
            Delta::ToolStart { index, id, name } => {
                while self.tool_calls.len() <= index {
                    self.tool_calls
                        .push((String::new(), String::new(), String::new()));
                }
                self.tool_calls[index].0 = id;
                self.tool_calls[index].1 = name;
            }
            Delta::ToolArguments { index, fragment } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.2.push_str(&fragment);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(out: &mut ChatOutput, pieces: &[&str]) -> Message {
        let mut m = Message::default();
        for p in pieces {
            for d in out.feed(p) {
                m.push(d);
            }
        }
        for d in out.finish() {
            m.push(d);
        }
        m
    }

    #[test]
    fn reasoning_then_content() {
        let mut o = ChatOutput::new(false, None);
        let m = run(&mut o, &["<th", "ink>\nplan", " it\n</think>\n\nHel", "lo"]);
        assert_eq!(m.reasoning, "plan it");
        assert_eq!(m.content, "Hello");
        assert!(!o.has_tool_calls());
        let mut o = ChatOutput::new(true, None);
        let m = run(&mut o, &["why", "</think>", "ok"]);
        assert_eq!((m.reasoning.as_str(), m.content.as_str()), ("why", "ok"));
    }

    #[test]
    fn tool_calls_split_from_content_in_both_formats() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
        ];
        let xml = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        let json_call = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";
        for (format, text) in [
            (ToolFormat::Qwen3Xml, xml),
            (ToolFormat::Qwen3Json, json_call),
        ] {
            let mut o = ChatOutput::new(false, Some(tool_parser(format, &tools)));
            let pieces: Vec<String> = text.chars().map(|c| c.to_string()).collect();
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let m = run(&mut o, &pieces);
            assert!(o.has_tool_calls());
            assert_eq!(m.content, "Checking.");
            assert_eq!(m.tool_calls.len(), 1);
            let (id, name, args) = &m.tool_calls[0];
            assert!(id.starts_with("call_"));
            assert_eq!(name, "get_weather");
            let args: Value = serde_json::from_str(args).unwrap();
            assert_eq!(args, json!({"city": "Paris", "days": 3}));
        }
    }

    #[test]
    fn without_a_tool_parser_tool_text_is_content() {
        let mut o = ChatOutput::new(false, None);
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let m = run(&mut o, &[text]);
        assert_eq!(m.content, text);
        assert!(m.tool_calls.is_empty());
    }
}
