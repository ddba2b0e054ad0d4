//! Splitting a model's output into `reasoning_content` and `content` at `<think>` … `</think>`.
//!
//! # What comes out
//!
//! The split follows the Qwen chat templates' own reading of an assistant turn (the templates
//! re-render history with `content.split('</think>')[0].rstrip('\n').split('<think>')[-1]
//! .lstrip('\n')` as the reasoning and `content.split('</think>')[-1].lstrip('\n')` as the
//! content), so that a response fed back as history renders exactly as the model produced it:
//!
//! - the tags are never emitted;
//! - newlines right after `<think>` (or at the start of the output when the prompt opened the
//!   block) and newlines right before `</think>` are dropped from the reasoning;
//! - newlines right after `</think>` are dropped from the content.
//!
//! `"<think>\nabc\n</think>\n\nhello"` therefore gives reasoning `"abc"` and content `"hello"`.
//! vLLM's `qwen3` reasoning parser returns the text between the tags untouched (`"\nabc\n"` and
//! `"\n\nhello"`); the stripped form is what the template would keep, and what clients display.
//!
//! A `<think>` tag is recognised only at the start of the output (after optional whitespace), or
//! repeated at the start of a block the prompt already opened; anywhere else it is plain text.
//! After `</think>` everything is content, tags included.
//!
//! Qwen3.5 models sometimes open a tool call without closing the reasoning block first. With the
//! implicit end enabled (the default), `<tool_call>` followed by optional whitespace and
//! `<function=` also ends the reasoning; that text starts the content, so the tool parser sees
//! the call. A bare `<tool_call>` mention inside reasoning stays reasoning.
//!
//! # Streaming
//!
//! [`ReasoningParser::feed`] holds back only what might still change meaning: a possible prefix of
//! a tag (`<thi`, `</th`, `<tool_call>` waiting for its `<function=`) and a run of newlines that
//! would be dropped if `</think>` followed. [`ReasoningParser::finish`] releases what is held.
//! The concatenated output is the same for every way of splitting the text into deltas.

use super::text::{expect, is_ws, partial_tag_start, run_start, skip_ws, Expect, TOOL_OPEN};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const FUNCTION_OPEN: &str = "<function=";

/// Whether a rendered prompt ends inside an open `<think>` block, so that the model's output
/// starts as reasoning (the Qwen3.5 template with thinking on ends its generation prompt with
/// `<think>\n`; with thinking off it ends with a closed, empty block).
pub fn prompt_opens_think(rendered_prompt: &str) -> bool {
    rendered_prompt
        .trim_end_matches(is_ws)
        .ends_with(THINK_OPEN)
}

/// Text split into reasoning and content; either may be empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningDelta {
    /// Text inside the reasoning block, tags removed.
    pub reasoning: String,
    /// Text outside it.
    pub content: String,
}

impl ReasoningDelta {
    /// True when both parts are empty.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }

    /// Appends another delta's parts to this one.
    pub fn append(&mut self, other: ReasoningDelta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Start of an output whose prompt did not open a block: a `<think>` may follow.
    Start,
    /// Inside the block; `fresh` until the first reasoning character (leading newlines and a
    /// repeated `<think>` are dropped while fresh).
    Reasoning { fresh: bool },
    /// After the block (or with none); `fresh` until the first content character.
    Content { fresh: bool },
}

/// Streaming `<think>` splitter for one response. See the module documentation for the rules.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    state: State,
    held: String,
    implicit_tool_call_end: bool,
}

/// Where the reasoning in a buffer ends, if it is known yet.
enum End {
    /// The block ends at `at`; the closing text is `skip` bytes long (0 for a tool call, whose
    /// text belongs to the content).
    Found { at: usize, skip: usize },
    /// No end yet; text from `hold` on might still be part of one.
    Undecided { hold: usize },
}

impl ReasoningParser {
    /// A parser for one response. `starts_in_reasoning` is true when the prompt already opened
    /// the block (see [`prompt_opens_think`]).
    pub fn new(starts_in_reasoning: bool) -> Self {
        let state = if starts_in_reasoning {
            State::Reasoning { fresh: true }
        } else {
            State::Start
        };
        ReasoningParser {
            state,
            held: String::new(),
            implicit_tool_call_end: true,
        }
    }

    /// Whether `<tool_call>` + `<function=` inside reasoning ends it (default true).
    pub fn with_implicit_tool_call_end(mut self, enabled: bool) -> Self {
        self.implicit_tool_call_end = enabled;
        self
    }

    /// True while the parser is inside the reasoning block (or may still enter one).
    pub fn in_reasoning(&self) -> bool {
        !matches!(self.state, State::Content { .. })
    }

    /// Feeds the next piece of generated text; returns what can be emitted now.
    pub fn feed(&mut self, delta: &str) -> ReasoningDelta {
        self.held.push_str(delta);
        self.drive(false)
    }

    /// Ends the response and returns everything still held back.
    pub fn finish(&mut self) -> ReasoningDelta {
        self.drive(true)
    }

    /// Splits a whole response at once (same result as `feed(text)` then `finish()`).
    pub fn parse_complete(starts_in_reasoning: bool, text: &str) -> ReasoningDelta {
        let mut parser = ReasoningParser::new(starts_in_reasoning);
        let mut out = parser.feed(text);
        out.append(parser.finish());
        out
    }

    fn drive(&mut self, eof: bool) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        loop {
            match self.state {
                State::Start => {
                    let at = skip_ws(&self.held, 0);
                    match expect(&self.held[at..], THINK_OPEN) {
                        Expect::Match => {
                            self.held.drain(..at + THINK_OPEN.len());
                            self.state = State::Reasoning { fresh: true };
                        }
                        Expect::Partial if !eof => return out,
                        _ => self.state = State::Content { fresh: false },
                    }
                }
                State::Reasoning { fresh: true } => {
                    let newlines = self.held.len() - self.held.trim_start_matches('\n').len();
                    self.held.drain(..newlines);
                    if self.held.is_empty() {
                        return out;
                    }
                    match expect(&self.held, THINK_OPEN) {
                        Expect::Match => {
                            self.held.drain(..THINK_OPEN.len());
                        }
                        Expect::Partial if !eof => return out,
                        _ => self.state = State::Reasoning { fresh: false },
                    }
                }
                State::Reasoning { fresh: false } => match self.find_end() {
                    End::Found { at, skip } => {
                        let keep = run_start(&self.held, at, |c| c == '\n');
                        out.reasoning.push_str(&self.held[..keep]);
                        self.held.drain(..at + skip);
                        self.state = State::Content { fresh: true };
                    }
                    End::Undecided { hold } => {
                        let emit = if eof {
                            self.held.len()
                        } else {
                            run_start(&self.held, hold, |c| c == '\n')
                        };
                        out.reasoning.push_str(&self.held[..emit]);
                        self.held.drain(..emit);
                        return out;
                    }
                },
                State::Content { fresh } => {
                    if fresh {
                        let newlines = self.held.len() - self.held.trim_start_matches('\n').len();
                        self.held.drain(..newlines);
                        if self.held.is_empty() {
                            return out;
                        }
                        self.state = State::Content { fresh: false };
                    }
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// Looks for the end of the reasoning block in the held text.
    fn find_end(&self) -> End {
        let s = self.held.as_str();
        let mut hold = partial_tag_start(s, THINK_CLOSE);
        let mut found = s.find(THINK_CLOSE).map(|at| (at, THINK_CLOSE.len()));
        if self.implicit_tool_call_end {
            hold = hold.min(partial_tag_start(s, TOOL_OPEN));
            let mut from = 0;
            while let Some(rel) = s[from..].find(TOOL_OPEN) {
                let at = from + rel;
                if found.is_some_and(|(end, _)| end < at) {
                    break;
                }
                let next = skip_ws(s, at + TOOL_OPEN.len());
                match expect(&s[next..], FUNCTION_OPEN) {
                    Expect::Match => {
                        found = Some((at, 0));
                        break;
                    }
                    Expect::Partial => {
                        hold = hold.min(at);
                        break;
                    }
                    Expect::Mismatch => from = at + 1,
                }
            }
        }
        match found {
            Some((at, skip)) if at < hold => End::Found { at, skip },
            _ => End::Undecided { hold },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_text_split() {
        let out = ReasoningParser::parse_complete(false, "<think>\nabc\n</think>\n\nhello");
        assert_eq!(out.reasoning, "abc");
        assert_eq!(out.content, "hello");
        let out = ReasoningParser::parse_complete(true, "abc\n</think>\n\nhello");
        assert_eq!(out.reasoning, "abc");
        assert_eq!(out.content, "hello");
    }

    #[test]
    fn prompt_detection() {
        assert!(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_think(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_think("<|im_start|>assistant\n"));
    }
}
