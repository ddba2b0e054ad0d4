//! The format-independent half of tool-call parsing: scanning content for `<tool_call>`,
//! holding back what might still be a tag, handing each call's text to a format grammar and
//! turning its verdict into events.

use serde_json::Value;

use super::events::ToolEvent;
use super::ids::ToolCallIds;
use super::schema::ToolSet;
use super::text::{is_ws, partial_tag_start, run_start, TOOL_OPEN};

/// A grammar's verdict on the text of one call so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Not decided yet.
    NeedMore,
    /// A valid call spans `..end` of the text.
    Done {
        end: usize,
        name: String,
        arguments: String,
    },
    /// Not a valid call: `..resume` of the text is content, scanning resumes at `resume`
    /// (always past the opening `<tool_call>`).
    Malformed { resume: usize },
}

/// One tool-call format. A grammar instance parses one call; `step` is called with the call's
/// text (starting with `<tool_call>`) each time more of it arrives, the text only ever growing,
/// and may keep its progress between calls. Its verdict must depend on the text alone: once
/// `Done` or `Malformed` for some text, the same for any longer text, and `NeedMore` only
/// while a longer text could still decide either way.
pub(crate) trait Grammar: Default {
    fn step(&mut self, text: &str, tools: &ToolSet) -> Step;
}

/// Streaming state shared by the tool parsers.
#[derive(Debug)]
pub(crate) struct Engine<G> {
    tools: ToolSet,
    ids: ToolCallIds,
    /// Content mode: text not emitted yet. Call mode: the call's text from `<tool_call>`.
    pending: String,
    /// Whitespace just before the current call: dropped if it parses, emitted if not.
    lead: String,
    /// The current call's grammar, while inside one.
    call: Option<G>,
    /// Nothing but whitespace has followed the last valid call (dropped if the response
    /// ends here).
    after_call: bool,
    next_index: usize,
}

impl<G: Grammar> Engine<G> {
    pub(crate) fn new(tools: &[Value], ids: ToolCallIds) -> Self {
        Engine {
            tools: ToolSet::new(tools),
            ids,
            pending: String::new(),
            lead: String::new(),
            call: None,
            after_call: false,
            next_index: 0,
        }
    }

    pub(crate) fn feed(&mut self, delta: &str) -> Vec<ToolEvent> {
        self.pending.push_str(delta);
        let mut out = Vec::new();
        self.drive(&mut out, false);
        out
    }

    pub(crate) fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        self.drive(&mut out, true);
        out
    }

    fn drive(&mut self, out: &mut Vec<ToolEvent>, eof: bool) {
        loop {
            if let Some(call) = self.call.as_mut() {
                match call.step(&self.pending, &self.tools) {
                    Step::NeedMore => {
                        if eof {
                            // An unterminated call: all of it is content.
                            let mut text = std::mem::take(&mut self.lead);
                            text.push_str(&self.pending);
                            push_content(out, &text);
                            self.pending.clear();
                            self.call = None;
                        }
                        return;
                    }
                    Step::Done {
                        end,
                        name,
                        arguments,
                    } => {
                        let index = self.next_index;
                        self.next_index += 1;
                        let id = self.ids.next_id();
                        out.push(ToolEvent::Start { index, id, name });
                        out.push(ToolEvent::Arguments {
                            index,
                            fragment: arguments,
                        });
                        out.push(ToolEvent::End { index });
                        self.lead.clear();
                        self.pending.drain(..end);
                        self.call = None;
                        self.after_call = true;
                    }
                    Step::Malformed { resume } => {
                        let mut text = std::mem::take(&mut self.lead);
                        text.push_str(&self.pending[..resume]);
                        push_content(out, &text);
                        self.after_call = false;
                        self.pending.drain(..resume);
                        self.call = None;
                    }
                }
            } else {
                if let Some(at) = self.pending.find(TOOL_OPEN) {
                    let ws = run_start(&self.pending, at, is_ws);
                    if ws > 0 {
                        self.after_call = false;
                    }
                    push_content(out, &self.pending[..ws]);
                    self.lead = self.pending[ws..at].to_string();
                    self.pending.drain(..at);
                    self.call = Some(G::default());
                    continue;
                }
                let emit = if eof {
                    if self.after_call && self.pending.trim_start_matches(is_ws).is_empty() {
                        // Whitespace after the last call.
                        self.pending.clear();
                        return;
                    }
                    self.pending.len()
                } else {
                    let hold = partial_tag_start(&self.pending, TOOL_OPEN);
                    run_start(&self.pending, hold, is_ws)
                };
                if emit > 0 {
                    self.after_call = false;
                }
                push_content(out, &self.pending[..emit]);
                self.pending.drain(..emit);
                return;
            }
        }
    }
}

/// Appends content, merging it with a directly preceding content event.
fn push_content(out: &mut Vec<ToolEvent>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolEvent::Content(last)) = out.last_mut() {
        last.push_str(text);
    } else {
        out.push(ToolEvent::Content(text.to_string()));
    }
}
