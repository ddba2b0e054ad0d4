//! The pieces every grammar writer shares: the compact-JSON options of a schema and Lark string
//! literals.

use serde_json::{json, Value};

/// Adds the compact-JSON options to a schema that does not set its own; `lenient` ignores what
/// llguidance does not implement (see [`crate::Constraint::JsonSchemaBestEffort`]).
pub(crate) fn compact_schema(schema: &Value, lenient: bool) -> Value {
    let mut s = match schema {
        Value::Bool(true) => json!({}),
        Value::Bool(false) => json!({"not": {}}),
        other => other.clone(),
    };
    if let Value::Object(map) = &mut s {
        if !map.contains_key("x-guidance") {
            map.insert(
                "x-guidance".into(),
                json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":",
                    "lenient": lenient}),
            );
        }
    }
    s
}

/// A Lark string literal (Lark literals are JSON strings).
pub(crate) fn lark_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}
