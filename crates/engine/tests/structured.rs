//! Structured output on the built-in model. Its weights are random, so every well-formed answer is the
//! grammar's doing: 100 sampled generations per JSON schema all parse and validate (one that runs into
//! `max_tokens` fails), regexes and choices match, the constraint starts after `</think>`, and a
//! complete grammar ends the sequence with `stop`.

use std::sync::OnceLock;

use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, FinishReason, OutputConstraint, StopParams};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, EngineHandle, ModelExecutor};
use sanmai_model::{builtin, Model};
use sanmai_structured::{CompiledGrammar, Constraint, GrammarCompiler};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::Dummy;
use serde_json::{json, Value};

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::builtin().unwrap())
}

fn compiler() -> &'static GrammarCompiler {
    static C: OnceLock<GrammarCompiler> = OnceLock::new();
    C.get_or_init(|| GrammarCompiler::new(tokenizer()).unwrap())
}

fn engine() -> &'static EngineHandle {
    static E: OnceLock<EngineHandle> = OnceLock::new();
    E.get_or_init(|| {
        let cfg = EngineConfig {
            model_name: "test".into(),
            max_num_seqs: 32,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            max_waiting: 1000,
            default_max_tokens: Some(64),
            valid_vocab: tokenizer().vocab_size(),
            eos_ids: tokenizer().eos_token_ids().to_vec(),
            block_size: 16,
            kv_cache_memory_bytes: 1 << 30,
            enable_prefix_caching: true,
            state_checkpoint_interval: Some(64),
            num_speculative_tokens: 0,
        };
        let model = Model::load(
            builtin::config(),
            &Dummy::new(builtin::SEED),
            CpuBackend::new(),
        )
        .unwrap();
        start(ModelExecutor::new(model), Some(tokenizer().clone()), cfg).unwrap()
    })
}

fn request(id: String, seed: u64, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        id,
        prompt: tokenizer().encode("Answer in JSON:", false).unwrap(),
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            // Random tied embeddings favour repeating the last token: without a penalty a number's
            // fraction (which no schema bounds) can repeat one digit to the end.
            frequency_penalty: 1.0,
            presence_penalty: 1.0,
            ..SamplingParams::default()
        }
        .validated(tokenizer().vocab_size())
        .unwrap(),
        stop: StopParams {
            max_tokens: Some(max_tokens),
            ..Default::default()
        },
        prompt_logprobs: false,
        cache_salt: Vec::new(),
        checkpoint_at: Vec::new(),
        images: None,
    }
}

struct Outcome {
    text: String,
    ids: Vec<u32>,
    reason: FinishReason,
}

/// Runs `n` seeded generations under `grammar` concurrently.
fn generate(
    grammar: &CompiledGrammar,
    n: usize,
    max_tokens: usize,
    tag: &str,
    edit: impl Fn(&mut EngineRequest),
    activate_after: &[u32],
) -> Vec<Outcome> {
    let mut streams = Vec::new();
    for i in 0..n {
        let mut req = request(format!("{tag}-{i}"), 1000 + i as u64, max_tokens);
        edit(&mut req);
        let c = OutputConstraint {
            matcher: grammar.matcher(),
            activate_after: activate_after.to_vec(),
        };
        streams.push(engine().submit_constrained(req, Some(c)).unwrap());
    }
    streams
        .into_iter()
        .map(|mut s| {
            let mut out = Outcome {
                text: String::new(),
                ids: Vec::new(),
                reason: FinishReason::Abort,
            };
            while let Some(ev) = s.blocking_recv() {
                match ev {
                    EngineEvent::Tokens { ids, text, .. } => {
                        out.ids.extend(ids);
                        out.text.push_str(&text);
                    }
                    EngineEvent::Finished { reason, .. } => out.reason = reason,
                    EngineEvent::PromptLogprobs(_) => {}
                }
            }
            out
        })
        .collect()
}

fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "nested",
            json!({"type": "object", "properties": {
                "user": {"type": "object", "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": {"type": "string", "minLength": 1, "maxLength": 8}
                }, "required": ["id", "name"], "additionalProperties": false},
                "active": {"type": "boolean"}
            }, "required": ["user", "active"], "additionalProperties": false}),
        ),
        (
            "arrays_and_enums",
            json!({"type": "object", "properties": {
                "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
                "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}
            }, "required": ["colors", "sizes"], "additionalProperties": false}),
        ),
        (
            "bounded_numbers",
            json!({"type": "object", "properties": {
                "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                "temp": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60},
                "count": {"type": "integer", "minimum": -5, "maximum": 5}
            }, "required": ["ratio", "temp", "count"], "additionalProperties": false}),
        ),
        (
            "any_of",
            json!({"type": "object", "properties": {
                "value": {"anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 100},
                    {"type": "string", "maxLength": 5},
                    {"type": "null"}
                ]}
            }, "required": ["value"], "additionalProperties": false}),
        ),
        (
            "optional_fields",
            json!({"type": "object", "properties": {
                "a": {"type": "boolean"},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
                "c": {"type": "string", "maxLength": 4},
                "d": {"enum": [1, 2, "three"]}
            }, "required": ["a"], "additionalProperties": false}),
        ),
        (
            "patterns",
            json!({"type": "object", "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 3}
            }, "required": ["code", "tags"], "additionalProperties": false}),
        ),
    ]
}

/// No whitespace outside strings.
fn compact(text: &str) -> bool {
    let (mut in_str, mut escaped) = (false, false);
    for c in text.chars() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
        } else if c == '"' {
            in_str = true;
        } else if c.is_whitespace() {
            return false;
        }
    }
    true
}

#[test]
fn json_schemas_hold_for_100_generations_each() {
    for (name, schema) in schemas() {
        let started = std::time::Instant::now();
        let validator = jsonschema::validator_for(&schema).unwrap();
        let grammar = compiler()
            .compile(&Constraint::JsonSchema(schema.clone()))
            .unwrap();
        let outs = generate(&grammar, 100, 300, name, |_| {}, &[]);
        let mut longest = 0;
        for o in outs {
            assert_eq!(o.reason, FinishReason::Stop, "{name}: {:?}", o.text);
            let v: Value = serde_json::from_str(&o.text)
                .unwrap_or_else(|e| panic!("{name}: {:?} is not JSON: {e}", o.text));
            assert!(
                validator.is_valid(&v),
                "{name}: {} breaks the schema",
                o.text
            );
            assert!(compact(&o.text), "{name}: not compact: {}", o.text);
            longest = longest.max(o.ids.len());
        }
        eprintln!(
            "{name}: 100 generations in {:.1} s, the longest {longest} tokens",
            started.elapsed().as_secs_f64()
        );
    }
}

#[test]
fn json_object_mode_gives_an_object() {
    let grammar = compiler().compile(&Constraint::JsonObject).unwrap();
    // An open object can go on for long (random weights write long strings); a bias towards the
    // tokens that close strings and objects lets some finish. The answers that finish are objects.
    let close: Vec<(u32, f32)> = ["\"", "}", "\"}"]
        .iter()
        .flat_map(|t| tokenizer().encode(t, false).unwrap())
        .map(|id| (id, 30.0))
        .collect();
    let outs = generate(
        &grammar,
        20,
        200,
        "object",
        |r| {
            r.sampling = SamplingParams {
                logit_bias: close.clone(),
                ..(*r.sampling).clone()
            }
            .validated(tokenizer().vocab_size())
            .unwrap()
        },
        &[],
    );
    let mut finished = 0;
    for o in outs {
        if o.reason == FinishReason::Stop {
            let v: Value = serde_json::from_str(&o.text).unwrap();
            assert!(v.is_object(), "{}", o.text);
            finished += 1;
        } else {
            assert_eq!(o.reason, FinishReason::Length);
            assert!(o.text.starts_with('{'), "{}", o.text);
        }
    }
    assert!(finished > 0);
}

#[test]
fn regex_and_choice_outputs_match() {
    let grammar = compiler()
        .compile(&Constraint::Regex("(yes|no)-[0-9]{2,4}".into()))
        .unwrap();
    for o in generate(&grammar, 30, 40, "regex", |_| {}, &[]) {
        assert_eq!(o.reason, FinishReason::Stop, "{}", o.text);
        let (word, digits) = o.text.split_once('-').unwrap();
        assert!(word == "yes" || word == "no", "{}", o.text);
        assert!((2..=4).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()));
    }
    let options = vec!["alpha".to_string(), "beta gamma".into(), "δέλτα".into()];
    let grammar = compiler()
        .compile(&Constraint::Choice(options.clone()))
        .unwrap();
    let outs = generate(&grammar, 30, 40, "choice", |_| {}, &[]);
    for o in &outs {
        assert_eq!(o.reason, FinishReason::Stop);
        assert!(options.contains(&o.text), "{}", o.text);
    }
}

#[test]
fn the_constraint_starts_after_think_end() {
    let think_end = tokenizer().encode("</think>", false).unwrap();
    assert_eq!(
        think_end.len(),
        1,
        "`</think>` is one token in the built-in vocabulary"
    );
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": false});
    let grammar = compiler().compile(&Constraint::JsonSchema(schema)).unwrap();
    // The bias makes `</think>` the first token: JSON could never start with it, so the constraint was
    // not active yet; once it is, the bias cannot pull it in again.
    let outs = generate(
        &grammar,
        10,
        50,
        "think",
        |r| {
            r.sampling = SamplingParams {
                logit_bias: vec![(think_end[0], 100.0)],
                ..(*r.sampling).clone()
            }
            .validated(tokenizer().vocab_size())
            .unwrap()
        },
        &think_end,
    );
    for o in outs {
        assert_eq!(o.reason, FinishReason::Stop, "{}", o.text);
        assert_eq!(o.ids[0], think_end[0]);
        let rest = o.text.strip_prefix("</think>").unwrap();
        let v: Value = serde_json::from_str(rest).unwrap();
        assert!(
            v["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)),
            "{rest}"
        );
    }
}

#[test]
fn constrained_sequences_leave_their_batch_alone() {
    // Greedy free sequences give the same tokens alone and next to constrained ones.
    let free = |tag: &str| {
        let mut r = request(format!("free-{tag}"), 1, 24);
        r.sampling = SamplingParams::greedy()
            .validated(tokenizer().vocab_size())
            .unwrap();
        r.stop.ignore_eos = true;
        r
    };
    let alone: Vec<u32> = {
        let mut s = engine().submit(free("alone")).unwrap();
        let mut ids = Vec::new();
        while let Some(ev) = s.blocking_recv() {
            if let EngineEvent::Tokens { ids: t, .. } = ev {
                ids.extend(t);
            }
        }
        ids
    };
    let grammar = compiler()
        .compile(&Constraint::JsonSchema(json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 8})))
        .unwrap();
    let mut free_streams: Vec<_> = (0..3)
        .map(|i| engine().submit(free(&format!("busy{i}"))).unwrap())
        .collect();
    let constrained = generate(&grammar, 12, 100, "beside", |_| {}, &[]);
    for o in constrained {
        assert_eq!(o.reason, FinishReason::Stop, "{}", o.text);
        let v: Value = serde_json::from_str(&o.text).unwrap();
        assert!(v.as_array().is_some_and(|a| a.len() <= 8), "{}", o.text);
    }
    for s in &mut free_streams {
        let mut ids = Vec::new();
        while let Some(ev) = s.blocking_recv() {
            if let EngineEvent::Tokens { ids: t, .. } = ev {
                ids.extend(t);
            }
        }
        assert_eq!(ids, alone);
    }
}
