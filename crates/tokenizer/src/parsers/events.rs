//! What a tool-call parser emits: the events of a streamed response, and the whole-response
//! result they assemble into.

/// One step of a streamed response, in output order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside tool calls (including malformed tool-call text).
    Content(String),
    /// A tool call begins. `index` counts calls from 0 within the response.
    Start {
        index: usize,
        id: String,
        name: String,
    },
    /// A piece of the call's arguments; the pieces of one index concatenate to a JSON object.
    Arguments { index: usize, fragment: String },
    /// The call is complete.
    End { index: usize },
}

/// One complete tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_…` id.
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments as a compact JSON object string.
    pub arguments: String,
}

/// A whole response split into content and tool calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// Text outside tool calls; `None` when there is none.
    pub content: Option<String>,
    /// The tool calls in order.
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedOutput {
    /// Assembles the events of a whole response (as returned by `feed`s and `finish`).
    pub fn from_events(events: impl IntoIterator<Item = ToolEvent>) -> Self {
        let mut content = String::new();
        let mut tool_calls: Vec<ToolCall> = Vec::new();
        for event in events {
            match event {
                ToolEvent::Content(text) => content.push_str(&text),
                ToolEvent::Start { index, id, name } => {
                    // Indices are dense and in order; place defensively all the same.
                    while tool_calls.len() <= index {
                        tool_calls.push(ToolCall {
                            id: String::new(),
                            name: String::new(),
                            arguments: String::new(),
                        });
                    }
                    tool_calls[index].id = id;
                    tool_calls[index].name = name;
                }
                ToolEvent::Arguments { index, fragment } => {
                    if let Some(call) = tool_calls.get_mut(index) {
                        call.arguments.push_str(&fragment);
                    }
                }
                ToolEvent::End { .. } => {}
            }
        }
        ParsedOutput {
            content: (!content.is_empty()).then_some(content),
            tool_calls,
        }
    }
}
