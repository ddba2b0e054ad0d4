//! The grammar of one Qwen3 / Hermes JSON tool call:
//!
//! ```text
//! <tool_call> ws* {"name": "NAME", "arguments": {…}} ws* </tool_call>
//! ```
//!
//! The object's extent is found by matching braces and brackets outside JSON strings, so the
//! values may contain `</tool_call>`; then it must parse as JSON with a string `name` the tools
//! accept and an `arguments` (or `parameters`) that is an object, a string holding a JSON
//! object, or absent/null (no arguments). The arguments are re-serialised compactly in the
//! model's key order.

use serde_json::Value;

use super::schema::ToolSet;
use super::stream::{Grammar, Step};
use super::text::{expect, skip_ws, Expect, TOOL_CLOSE, TOOL_OPEN};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Stage {
    /// Before the object.
    #[default]
    Open,
    /// Inside the object that starts at `start`.
    Object { start: usize },
    /// After the object, before `</tool_call>`.
    Close,
}

/// Progress through one JSON call; positions index the call's text.
#[derive(Debug, Default)]
pub(crate) struct JsonCall {
    stage: Stage,
    pos: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    call: Option<(String, String)>,
}

impl Grammar for JsonCall {
    fn step(&mut self, text: &str, tools: &ToolSet) -> Step {
        if self.pos == 0 {
            self.pos = TOOL_OPEN.len();
        }
        loop {
            match self.stage {
                Stage::Open => {
                    self.pos = skip_ws(text, self.pos);
                    match text.as_bytes().get(self.pos) {
                        None => return Step::NeedMore,
                        Some(b'{') => self.stage = Stage::Object { start: self.pos },
                        Some(_) => return Step::Malformed { resume: self.pos },
                    }
                }
                Stage::Object { start } => {
                    let Some(end) = self.scan_object(text) else {
                        return Step::NeedMore;
                    };
                    match decode_call(&text[start..end], tools) {
                        Some(call) => {
                            self.call = Some(call);
                            self.pos = end;
                            self.stage = Stage::Close;
                        }
                        None => return Step::Malformed { resume: end },
                    }
                }
                Stage::Close => {
                    self.pos = skip_ws(text, self.pos);
                    return match expect(&text[self.pos..], TOOL_CLOSE) {
                        Expect::Match => {
                            let (name, arguments) = self.call.take().unwrap_or_default();
                            Step::Done {
                                end: self.pos + TOOL_CLOSE.len(),
                                name,
                                arguments,
                            }
                        }
                        Expect::Partial => Step::NeedMore,
                        Expect::Mismatch => Step::Malformed { resume: self.pos },
                    };
                }
            }
        }
    }
}

impl JsonCall {
    /// Scans from `pos` (at or inside the object) and returns the position just past the
    /// object's closing brace once it is in the text.
    fn scan_object(&mut self, text: &str) -> Option<usize> {
        let bytes = text.as_bytes();
        while self.pos < bytes.len() {
            let b = bytes[self.pos];
            self.pos += 1;
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return Some(self.pos);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

/// The name and compact arguments of a call object, if it is a valid call.
fn decode_call(object: &str, tools: &ToolSet) -> Option<(String, String)> {
    let Value::Object(mut map) = serde_json::from_str::<Value>(object).ok()? else {
        return None;
    };
    let name = match map.remove("name")? {
        Value::String(name) if tools.accepts(&name) => name,
        _ => return None,
    };
    let arguments = match map.remove("arguments").or_else(|| map.remove("parameters")) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(args @ Value::Object(_)) => args,
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s).ok()? {
            args @ Value::Object(_) => args,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some((name, arguments.to_string()))
}
