//! The built-in vocabulary against tiktoken: identical ids on a varied corpus (fixture written by
//! `scripts/tiktoken_corpus.py`), decode round trips, and the vocabulary's fixed facts.

use std::sync::OnceLock;

use sanmai_tokenizer::builtin::{
    BUILTIN_PATTERN, BUILTIN_RANKS, BUILTIN_SPECIAL_START, BUILTIN_SPECIAL_TOKENS, BUILTIN_SPLITS,
    BUILTIN_TEXT_TOKENS, BUILTIN_VOCAB_SIZE,
};
use sanmai_tokenizer::tiktoken::Ranks;
use sanmai_tokenizer::{builtin_eos_ids, Tokenizer};
use serde_json::Value;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::builtin().expect("built-in tokenizer"))
}

fn fixture() -> Value {
    serde_json::from_str(include_str!("fixtures/tiktoken_corpus.json")).expect("fixture JSON")
}

#[test]
fn encodes_the_corpus_exactly_like_tiktoken() {
    let fixture = fixture();
    assert_eq!(fixture["pattern"].as_str(), Some(BUILTIN_PATTERN));
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() > 200);
    let tok = tokenizer();
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let got = tok.encode(text, false).expect("encode");
        if got != want {
            failures.push(format!("{text:?}\n  want {want:?}\n  got  {got:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn decoding_the_expected_ids_gives_back_the_normalized_text() {
    let fixture = fixture();
    let tok = tokenizer();
    for case in fixture["cases"].as_array().expect("cases") {
        let text = case["nfc"]
            .as_str()
            .or(case["text"].as_str())
            .expect("text");
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
        // Skipping special tokens drops exactly their text (the reasoning and tool tags are text).
        let mut plain = text.to_string();
        for special in BUILTIN_SPECIAL_TOKENS
            .iter()
            .filter(|t| !BUILTIN_TEXT_TOKENS.contains(t))
        {
            plain = plain.replace(special, "");
        }
        if !ids.iter().any(|&id| id >= BUILTIN_SPECIAL_START) {
            assert_eq!(plain, text);
        }
        assert_eq!(tok.decode(&ids, true).expect("decode"), plain);
    }
}

#[test]
fn committed_split_table_matches_the_converter() {
    let ranks = Ranks::parse(BUILTIN_RANKS).expect("ranks");
    assert_eq!(ranks.len(), BUILTIN_SPECIAL_START as usize);
    let splits = ranks.splits().expect("splits");
    assert_eq!(splits.len(), BUILTIN_SPLITS.len());
    assert!(splits == BUILTIN_SPLITS, "data/qwen3_6.splits is stale");
}

#[test]
fn vocabulary_facts() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), BUILTIN_VOCAB_SIZE);
    for (i, special) in BUILTIN_SPECIAL_TOKENS.iter().enumerate() {
        let id = BUILTIN_SPECIAL_START + i as u32;
        assert_eq!(tok.token_to_id(special), Some(id), "{special}");
        assert_eq!(tok.id_to_token(id).as_deref(), Some(*special));
        assert_eq!(
            tok.is_special(id),
            !BUILTIN_TEXT_TOKENS.contains(special),
            "{special}"
        );
    }
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(248_046));
    assert_eq!(tok.eos_token_ids(), builtin_eos_ids());
    assert_eq!(builtin_eos_ids(), &[248_046, 248_044]);
    // Byte-level pieces: a space is "Ġ", a newline "Ċ".
    assert_eq!(
        tok.id_to_token(tok.encode(" the", false).unwrap()[0])
            .as_deref(),
        Some("Ġthe")
    );
    assert_eq!(tok.encode("\n", false).unwrap().len(), 1);
    assert!(!tok.is_special(0));
    // Padding ids past the last special token have no token and decode to nothing.
    let last = BUILTIN_SPECIAL_START + BUILTIN_SPECIAL_TOKENS.len() as u32;
    assert_eq!(tok.id_to_token(last), None);
    assert_eq!(tok.id_to_token(BUILTIN_VOCAB_SIZE as u32 - 1), None);
    assert_eq!(tok.decode(&[9419, last, 248_300], false).unwrap(), "Hello");
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.pad_token(), Some("<|endoftext|>"));
    assert_eq!(tok.bos_token(), None);
}

#[test]
fn built_in_chat_template_renders_a_conversation() {
    let tok = tokenizer();
    let template = tok.chat_template().expect("built-in template");
    let mut request = tok.chat_request(serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}
    ]));
    request.add_generation_prompt = true;
    let text = template.render(&request).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    );
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(ids[0], 248_045);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn tokenizer_and_decoder_can_cross_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<sanmai_tokenizer::ChatTemplate>();
    assert_send_sync::<sanmai_tokenizer::IncrementalDecoder>();
    let tok = tokenizer().clone();
    let handle = std::thread::spawn(move || tok.encode("hello from a thread", false).unwrap());
    assert_eq!(
        handle.join().unwrap(),
        tokenizer().encode("hello from a thread", false).unwrap()
    );
}
