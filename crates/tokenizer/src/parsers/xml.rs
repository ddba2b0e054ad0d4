//! The grammar of one Qwen3 XML tool call:
//!
//! ```text
//! <tool_call> ws* <function=NAME> ( ws* <parameter=P> VALUE </parameter> )* ws* </function>
//! ws* </tool_call>
//! ```
//!
//! A `</parameter>` closes a value only when followed by whitespace and then `<parameter=` or
//! `</function>`; any other occurrence is part of the value. Names end at the first `>` and must
//! be [`valid_name`](super::schema::valid_name)s. Values lose one leading and one trailing
//! newline and are typed by [`convert_param`]. A repeated parameter keeps its first position
//! and its last value.

use serde_json::{Map, Value};

use super::schema::{convert_param, name_char, ToolSet, MAX_NAME_LEN};
use super::stream::{Grammar, Step};
use super::text::{expect, floor_boundary, skip_ws, Expect, TOOL_CLOSE, TOOL_OPEN};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum Stage {
    /// Before `<function=`.
    #[default]
    Open,
    /// Reading the function name.
    FunctionName,
    /// Between elements of the function body.
    Body,
    /// Reading a parameter name.
    ParamName,
    /// Reading a parameter value that starts at `start`.
    Value { name: String, start: usize },
    /// After `</function>`, before `</tool_call>`.
    Close,
}

/// Progress through one XML call; positions index the call's text.
#[derive(Debug, Default)]
pub(crate) struct XmlCall {
    stage: Stage,
    /// Everything before `pos` has been accepted.
    pos: usize,
    name: String,
    args: Map<String, Value>,
    /// Where the search for the current value's closing tag resumes.
    scan: usize,
}

/// The result of reading a name up to its `>`.
enum Name {
    /// More text needed.
    Partial,
    /// Not a valid name; the error is at this position.
    Invalid(usize),
    /// The name ends before the `>` at this position.
    Complete(usize),
}

fn read_name(text: &str, from: usize) -> Name {
    for (i, c) in text[from..].char_indices() {
        if c == '>' {
            return if i == 0 {
                Name::Invalid(from)
            } else {
                Name::Complete(from + i)
            };
        }
        if !name_char(c) || i + c.len_utf8() > MAX_NAME_LEN {
            return Name::Invalid(from + i);
        }
    }
    Name::Partial
}

impl Grammar for XmlCall {
    fn step(&mut self, text: &str, tools: &ToolSet) -> Step {
        if self.pos == 0 {
            self.pos = TOOL_OPEN.len();
        }
        loop {
            match std::mem::take(&mut self.stage) {
                Stage::Open => {
                    self.pos = skip_ws(text, self.pos);
                    match expect(&text[self.pos..], FUNCTION_OPEN) {
                        Expect::Match => {
                            self.pos += FUNCTION_OPEN.len();
                            self.stage = Stage::FunctionName;
                        }
                        Expect::Partial => {
                            self.stage = Stage::Open;
                            return Step::NeedMore;
                        }
                        Expect::Mismatch => return Step::Malformed { resume: self.pos },
                    }
                }
                Stage::FunctionName => match read_name(text, self.pos) {
                    Name::Partial => {
                        self.stage = Stage::FunctionName;
                        return Step::NeedMore;
                    }
                    Name::Invalid(at) => return Step::Malformed { resume: at },
                    Name::Complete(gt) => {
                        let name = &text[self.pos..gt];
                        if !tools.accepts(name) {
                            return Step::Malformed { resume: gt + 1 };
                        }
                        self.name = name.to_string();
                        self.pos = gt + 1;
                        self.stage = Stage::Body;
                    }
                },
                Stage::Body => {
                    self.pos = skip_ws(text, self.pos);
                    let rest = &text[self.pos..];
                    match (expect(rest, PARAM_OPEN), expect(rest, FUNCTION_CLOSE)) {
                        (Expect::Match, _) => {
                            self.pos += PARAM_OPEN.len();
                            self.stage = Stage::ParamName;
                        }
                        (_, Expect::Match) => {
                            self.pos += FUNCTION_CLOSE.len();
                            self.stage = Stage::Close;
                        }
                        (Expect::Partial, _) | (_, Expect::Partial) => {
                            self.stage = Stage::Body;
                            return Step::NeedMore;
                        }
                        _ => return Step::Malformed { resume: self.pos },
                    }
                }
                Stage::ParamName => match read_name(text, self.pos) {
                    Name::Partial => {
                        self.stage = Stage::ParamName;
                        return Step::NeedMore;
                    }
                    Name::Invalid(at) => return Step::Malformed { resume: at },
                    Name::Complete(gt) => {
                        let name = text[self.pos..gt].to_string();
                        self.pos = gt + 1;
                        self.scan = self.pos;
                        self.stage = Stage::Value {
                            name,
                            start: self.pos,
                        };
                    }
                },
                Stage::Value { name, start } => match self.find_value_end(text) {
                    Some(end) => {
                        let raw = &text[start..end];
                        let raw = raw.strip_prefix('\n').unwrap_or(raw);
                        let raw = raw.strip_suffix('\n').unwrap_or(raw);
                        let value = convert_param(raw, tools.param_schema(&self.name, &name));
                        self.args.insert(name, value);
                        self.pos = end + PARAM_CLOSE.len();
                        self.stage = Stage::Body;
                    }
                    None => {
                        self.stage = Stage::Value { name, start };
                        return Step::NeedMore;
                    }
                },
                Stage::Close => {
                    self.pos = skip_ws(text, self.pos);
                    match expect(&text[self.pos..], TOOL_CLOSE) {
                        Expect::Match => {
                            let arguments = Value::Object(std::mem::take(&mut self.args));
                            return Step::Done {
                                end: self.pos + TOOL_CLOSE.len(),
                                name: std::mem::take(&mut self.name),
                                arguments: arguments.to_string(),
                            };
                        }
                        Expect::Partial => {
                            self.stage = Stage::Close;
                            return Step::NeedMore;
                        }
                        Expect::Mismatch => return Step::Malformed { resume: self.pos },
                    }
                }
            }
        }
    }
}

impl XmlCall {
    /// The position of the `</parameter>` closing the current value, once it is known.
    fn find_value_end(&mut self, text: &str) -> Option<usize> {
        loop {
            let Some(rel) = text[self.scan..].find(PARAM_CLOSE) else {
                // A closing tag may still be arriving at the end of the text.
                let tail = text.len().saturating_sub(PARAM_CLOSE.len() - 1);
                self.scan = self.scan.max(floor_boundary(text, tail));
                return None;
            };
            let at = self.scan + rel;
            let next = skip_ws(text, at + PARAM_CLOSE.len());
            let rest = &text[next..];
            match (expect(rest, PARAM_OPEN), expect(rest, FUNCTION_CLOSE)) {
                (Expect::Match, _) | (_, Expect::Match) => return Some(at),
                (Expect::Partial, _) | (_, Expect::Partial) => {
                    self.scan = at;
                    return None;
                }
                _ => self.scan = at + 1,
            }
        }
    }
}
