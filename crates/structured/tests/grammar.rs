//! Constraints compiled against the built-in Qwen vocabulary and walked with random tokens from each
//! mask: every finished walk matches its constraint.

use std::sync::OnceLock;

use sanmai_structured::{mask_words, Constraint, GrammarCompiler, GrammarMatcher, ToolSyntax};
use sanmai_tokenizer::Tokenizer;
use serde_json::{json, Value};

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::builtin().unwrap())
}

fn compiler() -> &'static GrammarCompiler {
    static C: OnceLock<GrammarCompiler> = OnceLock::new();
    C.get_or_init(|| GrammarCompiler::new(tokenizer()).unwrap())
}

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Walks the grammar with tokens drawn uniformly from each mask, preferring to finish after `soft`
/// tokens (an end-of-sequence id when allowed). Returns the text, or `None` past `limit` tokens.
fn walk(m: &mut GrammarMatcher, rng: &mut Rng, limit: usize) -> Option<String> {
    let eos = tokenizer().eos_token_ids().to_vec();
    let mut mask = vec![0u32; mask_words(compiler().vocab_size())];
    let mut ids = Vec::new();
    for _ in 0..limit {
        if m.is_stopped() {
            return Some(tokenizer().decode(&ids, false).unwrap());
        }
        m.fill_mask(&mut mask).unwrap();
        let allowed: Vec<u32> = (0..compiler().vocab_size() as u32)
            .filter(|&t| mask[t as usize / 32] & (1 << (t % 32)) != 0)
            .collect();
        assert!(!allowed.is_empty(), "empty mask after {ids:?}");
        if eos.iter().any(|e| allowed.contains(e)) && rng.next().is_multiple_of(4) {
            return Some(tokenizer().decode(&ids, false).unwrap());
        }
        let t = allowed[(rng.next() % allowed.len() as u64) as usize];
        if eos.contains(&t) {
            return Some(tokenizer().decode(&ids, false).unwrap());
        }
        m.advance(&[t]).unwrap();
        ids.push(t);
    }
    None
}

#[test]
fn json_schema_walks_validate() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "kind": {"enum": ["a", "b", "c"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
        },
        "required": ["name", "age", "kind"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).unwrap();
    let g = compiler()
        .compile(&Constraint::JsonSchema(schema.clone()))
        .unwrap();
    let mut rng = Rng(7);
    for _ in 0..20 {
        let text = walk(&mut g.matcher(), &mut rng, 200).expect("the walk ended");
        assert!(
            !text.contains(' ') || text.contains("\"name\":\""),
            "compact: {text}"
        );
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(validator.is_valid(&v), "{text}");
    }
}

#[test]
fn regex_and_choice_walks_match() {
    let g = compiler()
        .compile(&Constraint::Regex("[a-c]{2}-[0-9]{1,3}".into()))
        .unwrap();
    let mut rng = Rng(3);
    for _ in 0..20 {
        let t = walk(&mut g.matcher(), &mut rng, 50).unwrap();
        let (a, b) = t.split_once('-').unwrap();
        assert!(
            a.len() == 2 && a.chars().all(|c| ('a'..='c').contains(&c)),
            "{t}"
        );
        assert!(
            (1..=3).contains(&b.len()) && b.chars().all(|c| c.is_ascii_digit()),
            "{t}"
        );
    }
    let choices = vec!["yes".to_string(), "no".into(), "maybe so".into()];
    let g = compiler()
        .compile(&Constraint::Choice(choices.clone()))
        .unwrap();
    for _ in 0..20 {
        let t = walk(&mut g.matcher(), &mut rng, 50).unwrap();
        assert!(choices.contains(&t), "{t}");
    }
}

#[test]
fn xml_tool_call_walks_parse() {
    let tools = vec![
        json!({"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "maxLength": 5},
                "count": {"type": "integer", "minimum": 1, "maximum": 9},
                "mode": {"type": "string", "enum": ["fast", "slow"]}
            },
            "required": ["label", "count", "mode"]
        }}}),
    ];
    let c = Constraint::ToolCall {
        tools: tools.clone(),
        syntax: ToolSyntax::Xml,
        name: None,
    };
    let g = compiler().compile(&c).unwrap();
    let mut rng = Rng(11);
    for _ in 0..20 {
        let t = walk(&mut g.matcher(), &mut rng, 200).unwrap();
        let parsed = sanmai_tokenizer::parsers::ToolFormat::Qwen3Xml.parse_complete(&t, &tools);
        assert_eq!(parsed.tool_calls.len(), 1, "{t:?}");
        let args: Value = serde_json::from_str(&parsed.tool_calls[0].arguments).unwrap();
        assert!(
            args["count"].as_i64().is_some_and(|c| (1..=9).contains(&c)),
            "{t:?}"
        );
        assert!(
            ["fast", "slow"].contains(&args["mode"].as_str().unwrap()),
            "{t:?}"
        );
        assert!(
            args["label"].as_str().unwrap().chars().count() <= 5,
            "{t:?}"
        );
    }
}

#[test]
fn bad_constraints_are_compile_errors() {
    for c in [
        Constraint::JsonSchema(
            json!({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
        ),
        Constraint::Regex("(unclosed".into()),
        Constraint::Lark("start: missing_rule".into()),
        Constraint::Choice(vec![]),
        Constraint::JsonSchema(json!(5)),
    ] {
        let e = compiler().compile(&c).unwrap_err();
        assert!(!e.to_string().is_empty(), "{c:?}");
    }
}

#[test]
fn draft_masks_leave_the_matcher_in_place() {
    let g = compiler()
        .compile(&Constraint::Regex("abc[0-9]+".into()))
        .unwrap();
    let mut m = g.matcher();
    let draft = tokenizer().encode("abc12", false).unwrap();
    let words = mask_words(compiler().vocab_size());
    let mut out = vec![0u32; words * (draft.len() + 1)];
    let rows = m.draft_masks(&draft, &mut out).unwrap();
    assert_eq!(rows, draft.len() + 1);
    assert_eq!(m.num_consumed(), 0);
    // Each draft token is allowed in the row before it.
    for (i, &t) in draft.iter().enumerate() {
        assert_ne!(out[i * words + t as usize / 32] & (1 << (t % 32)), 0);
    }
    m.advance(&draft).unwrap();
    assert!(m.is_accepting());
    m.rollback(draft.len()).unwrap();
    assert_eq!(m.num_consumed(), 0);
}

#[test]
fn json_tool_call_walks_parse() {
    let tools = vec![
        json!({"type": "function", "function": {"name": "noop"}}),
        json!({"type": "function", "function": {"name": "set", "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
            "required": ["on", "level"],
            "additionalProperties": false
        }}}),
    ];
    let c = Constraint::ToolCall {
        tools: tools.clone(),
        syntax: ToolSyntax::Json,
        name: Some("set".into()),
    };
    let g = compiler().compile(&c).unwrap();
    let mut rng = Rng(13);
    for _ in 0..20 {
        let t = walk(&mut g.matcher(), &mut rng, 100).unwrap();
        let parsed = sanmai_tokenizer::parsers::ToolFormat::Qwen3Json.parse_complete(&t, &tools);
        assert_eq!(parsed.tool_calls.len(), 1, "{t:?}");
        assert_eq!(parsed.tool_calls[0].name, "set");
        let args: Value = serde_json::from_str(&parsed.tool_calls[0].arguments).unwrap();
        assert!(args["on"].is_boolean(), "{t:?}");
        assert!(
            [1, 2, 3].contains(&args["level"].as_i64().unwrap()),
            "{t:?}"
        );
    }
    // A tool without parameters: an empty XML call.
    let c = Constraint::ToolCall {
        tools: tools.clone(),
        syntax: ToolSyntax::Xml,
        name: Some("noop".into()),
    };
    let g = compiler().compile(&c).unwrap();
    let t = walk(&mut g.matcher(), &mut rng, 100).unwrap();
    let parsed = sanmai_tokenizer::parsers::ToolFormat::Qwen3Xml.parse_complete(&t, &tools);
    assert_eq!(parsed.tool_calls.len(), 1, "{t:?}");
    assert_eq!(parsed.tool_calls[0].arguments, "{}");
}

#[test]
fn best_effort_schemas_ignore_what_cannot_be_enforced() {
    let schema = json!({"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3, "uniqueItems": true},
        "v": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}
    }, "required": ["ids", "v"], "additionalProperties": false});
    let e = compiler()
        .compile(&Constraint::JsonSchema(schema.clone()))
        .unwrap_err();
    assert!(e.to_string().contains("uniqueItems"), "{e}");
    let g = compiler()
        .compile(&Constraint::JsonSchemaBestEffort(schema.clone()))
        .unwrap();
    let mut rng = Rng(17);
    for _ in 0..10 {
        let t = walk(&mut g.matcher(), &mut rng, 100).unwrap();
        let v: Value = serde_json::from_str(&t).unwrap();
        assert!(v["v"].is_boolean() || v["v"].is_null(), "{t}");
    }
    // Tool parameters are read the same way.
    let tools = vec![json!({"type": "function", "function": {"name": "f", "parameters": schema}})];
    for syntax in [ToolSyntax::Xml, ToolSyntax::Json] {
        let c = Constraint::ToolCall {
            tools: tools.clone(),
            syntax,
            name: None,
        };
        assert!(compiler().compile(&c).is_ok(), "{syntax:?}");
    }
    // A wrong schema is still an error.
    let bad = json!({"type": "object", "properties": {"a": {"type": "frobnicate"}}});
    assert!(compiler()
        .compile(&Constraint::JsonSchemaBestEffort(bad))
        .is_err());
}
