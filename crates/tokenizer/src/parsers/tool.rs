//! The tool-call parser interface: the [`ToolParser`] trait with its two implementations (Qwen3
//! XML and Qwen3/Hermes JSON), which emit [`ToolEvent`]s.

use serde_json::Value;

use super::events::ToolEvent;
use super::ids::ToolCallIds;
use super::json::JsonCall;
use super::stream::Engine;
use super::xml::XmlCall;

/// A streaming tool-call parser for one response.
///
/// Guarantees, for both formats:
///
/// - **No broken calls.** A call's `Start`, `Arguments` and `End` are emitted together, in the
///   `feed` (or `finish`) that reads its closing `</tool_call>`, and only when the whole call
///   parsed: the function name is well formed and (when tools were given) one of the tools, and
///   the body is complete and valid. Nothing emitted is ever taken back, so the streamed result
///   equals [`super::ParsedOutput::from_events`] of the same text fed in one piece, for every split.
/// - **Malformed calls are content.** Text from `<tool_call>` that cannot be a valid call is
///   emitted verbatim as `Content` as soon as that is certain (an unknown name once its `>` is
///   read, stray text between tags once read), or at `finish()` (an unterminated call).
///   Scanning for the next `<tool_call>` resumes where the error was found.
/// - **Content streams.** Text outside calls is emitted as it arrives, holding back only a
///   possible prefix of `<tool_call>` and a trailing whitespace run. Whitespace right before a
///   valid call, and whitespace after the last valid call at the end of the response, is
///   dropped: `"Let me check.\n\n<tool_call>…</tool_call>\n"` gives the content
///   `"Let me check."`; text after a call keeps its leading whitespace.
/// - Arguments of a call come as one fragment: a compact JSON object with keys in the order
///   the model wrote them.
pub trait ToolParser: Send {
    /// Feeds the next piece of content text; returns the events it completes.
    fn feed(&mut self, delta: &str) -> Vec<ToolEvent>;
    /// Ends the response; returns held-back text (and unfinished calls) as content.
    fn finish(&mut self) -> Vec<ToolEvent>;
}

/// A [`ToolParser`] that runs the streaming [`Engine`] over one format's grammar: the struct, its
/// `new` and the trait's methods, the same for every format.
macro_rules! engine_tool_parser {
    ($(#[$doc:meta])* $name:ident, $grammar:ty) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name {
            engine: Engine<$grammar>,
        }

        impl $name {
            /// A parser for one response; `tools` is the request's OpenAI `tools` array (empty: any
            /// well-formed function name is accepted).
            pub fn new(tools: &[Value], ids: ToolCallIds) -> Self {
                $name {
                    engine: Engine::new(tools, ids),
                }
            }
        }

        impl ToolParser for $name {
            fn feed(&mut self, delta: &str) -> Vec<ToolEvent> {
                self.engine.feed(delta)
            }

            fn finish(&mut self) -> Vec<ToolEvent> {
                self.engine.finish()
            }
        }
    };
}

engine_tool_parser!(
    /// Parser for the Qwen3.5 / Qwen3-Coder XML format:
    /// `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n…</function>\n</tool_call>`.
    ///
    /// Parameter values are typed by the tool's JSON schema (see [`super::ToolFormat::Qwen3Xml`];
    /// with no `tools`, without a schema). A `</parameter>` ends a value only when whitespace and
    /// then `<parameter=` or `</function>` follow it, so values may contain that text, newlines and
    /// `<` freely.
    XmlToolParser,
    XmlCall
);

engine_tool_parser!(
    /// Parser for the Qwen3 / Hermes JSON format:
    /// `<tool_call>\n{"name": "…", "arguments": {…}}\n</tool_call>`.
    ///
    /// The object must be valid JSON with a string `name`; `arguments` (or `parameters`) may be an
    /// object, a string holding a JSON object, or absent/null (`{}`). Anything else is content.
    JsonToolParser,
    JsonCall
);
