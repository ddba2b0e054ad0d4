//! Turning a model's generated text into OpenAI `reasoning_content`, `content` and `tool_calls`,
//! streamed (text deltas in, events out) or for whole responses.
//!
//! The server runs the [`ReasoningParser`] first and feeds only its `content` to a
//! [`ToolParser`], so tool calls inside reasoning are not parsed:
//!
//! ```
//! use sanmai_tokenizer::parsers::{
//!     prompt_opens_think, ParsedOutput, ReasoningParser, ToolCallIds, ToolFormat,
//! };
//!
//! let prompt = "<|im_start|>assistant\n<think>\n";
//! let mut reasoning = ReasoningParser::new(prompt_opens_think(prompt));
//! let mut tools = ToolFormat::Qwen3Xml.parser(&[], ToolCallIds::seeded(1));
//! let mut events = Vec::new();
//! for delta in ["Need the weather.\n</think>\n\n", "<tool_call>\n<function=weather>\n",
//!               "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"] {
//!     let split = reasoning.feed(delta);
//!     events.extend(tools.feed(&split.content));
//! }
//! events.extend(tools.feed(&reasoning.finish().content));
//! events.extend(tools.finish());
//! let out = ParsedOutput::from_events(events);
//! assert_eq!(out.content, None);
//! assert_eq!(out.tool_calls[0].name, "weather");
//! assert_eq!(out.tool_calls[0].arguments, r#"{"city":"Paris"}"#);
//! ```
//!
//! See [`reasoning`] for the `<think>` rules and [`ToolParser`] for the streaming guarantees.

mod events;
mod ids;
mod json;
pub mod reasoning;
mod schema;
mod stream;
mod text;
mod tool;
mod xml;

pub use events::{ParsedOutput, ToolCall, ToolEvent};
pub use ids::ToolCallIds;
pub use reasoning::{prompt_opens_think, ReasoningDelta, ReasoningParser};
pub use tool::{JsonToolParser, ToolParser, XmlToolParser};

use serde_json::Value;

/// Errors from choosing a parser.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParserError {
    /// The tool-call parser name is not one of the known ones.
    #[error("unknown tool-call parser {0:?} (known: qwen3_xml, qwen3_coder, hermes, qwen3_json)")]
    UnknownToolParser(String),
}

/// The tool-call formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    /// Qwen3.5 / Qwen3-Coder XML (`<function=NAME>` with `<parameter=P>` values typed by the
    /// tool's JSON schema). Names `qwen3_xml`, `qwen3_coder`.
    Qwen3Xml,
    /// Qwen3 / Hermes JSON (`{"name": …, "arguments": …}` inside `<tool_call>`). Names
    /// `hermes`, `qwen3_json`.
    Qwen3Json,
}

impl ToolFormat {
    /// The format for a parser name (case-insensitive; `-` may stand for `_`).
    pub fn from_name(name: &str) -> Result<Self, ParserError> {
        match name.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "qwen3_xml" | "qwen3_coder" => Ok(ToolFormat::Qwen3Xml),
            "hermes" | "qwen3_json" => Ok(ToolFormat::Qwen3Json),
            _ => Err(ParserError::UnknownToolParser(name.to_string())),
        }
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Qwen3Xml => "qwen3_xml",
            ToolFormat::Qwen3Json => "qwen3_json",
        }
    }

    /// A streaming parser for one response. `tools` is the request's OpenAI `tools` array;
    /// when it is non-empty, calls to other function names are content.
    pub fn parser(self, tools: &[Value], ids: ToolCallIds) -> Box<dyn ToolParser> {
        match self {
            ToolFormat::Qwen3Xml => Box::new(XmlToolParser::new(tools, ids)),
            ToolFormat::Qwen3Json => Box::new(JsonToolParser::new(tools, ids)),
        }
    }

    /// Parses a whole response, with random tool-call ids.
    pub fn parse_complete(self, text: &str, tools: &[Value]) -> ParsedOutput {
        self.parse_complete_with_ids(text, tools, ToolCallIds::random())
    }

    /// Parses a whole response with the given ids; the same as feeding `text` in one piece to
    /// [`ToolFormat::parser`] and calling `finish`.
    pub fn parse_complete_with_ids(
        self,
        text: &str,
        tools: &[Value],
        ids: ToolCallIds,
    ) -> ParsedOutput {
        let mut parser = self.parser(tools, ids);
        let mut events = parser.feed(text);
        events.extend(parser.finish());
        ParsedOutput::from_events(events)
    }
}

/// The tool-call format a chat template teaches: XML when it mentions `<function=`, else JSON.
pub fn detect_from_template(chat_template_source: &str) -> ToolFormat {
    if chat_template_source.contains("<function=") {
        ToolFormat::Qwen3Xml
    } else {
        ToolFormat::Qwen3Json
    }
}

/// A streaming tool-call parser chosen by name (see [`ToolFormat::from_name`]).
pub fn tool_parser(
    name: &str,
    tools: &[Value],
    ids: ToolCallIds,
) -> Result<Box<dyn ToolParser>, ParserError> {
    Ok(ToolFormat::from_name(name)?.parser(tools, ids))
}
