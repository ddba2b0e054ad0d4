//! IncrementalDecoder: chunks never split a character, and they concatenate to `decode(all)`,
//! for the byte-level built-in vocabulary and for a byte-fallback (`<0xAB>`) vocabulary.

mod common;

use std::sync::OnceLock;

use common::{byte_fallback_tokenizer_json, Rng, TempDir};
use sanmai_tokenizer::builtin::{BUILTIN_SPECIAL_START, BUILTIN_SPECIAL_TOKENS};
use sanmai_tokenizer::{IncrementalDecoder, Tokenizer};

fn builtin() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::builtin().expect("built-in tokenizer"))
}

fn byte_fallback() -> Tokenizer {
    let dir = TempDir::new("incremental-byte-fallback");
    dir.write(
        "tokenizer.json",
        &byte_fallback_tokenizer_json().0.to_string(),
    );
    Tokenizer::from_dir(dir.path()).expect("byte-fallback tokenizer")
}

/// Feeds `ids` one at a time; returns the chunks, the flushed rest, and checks the total.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
    let mut dec = IncrementalDecoder::new(tok.clone(), skip_special);
    let chunks: Vec<String> = ids.iter().map(|&id| dec.step(id).expect("step")).collect();
    let rest = dec.flush().expect("flush");
    assert_eq!(dec.len(), ids.len());
    let joined = chunks.concat() + &rest;
    assert_eq!(
        joined,
        tok.decode(ids, skip_special).expect("decode"),
        "ids {ids:?}"
    );
    (chunks, rest)
}

const TEXTS: [&str; 6] = [
    "Hello 世界! 🦀🐍 👨‍👩‍👧‍👦 🏳️‍🌈 and 🇯🇵.",
    "日本語のテキストと한국어 텍스트、中文：俱乐部，毛泽东。",
    "fn main() {\n\tprintln!(\"{}\", \"é∑😀\");\n}\n",
    "Zalgo: Z\u{351}\u{36b}\u{346}a\u{313}l\u{310}g\u{342}o ⁂ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀𓁐",
    "<|im_start|>assistant\n<think>\nhmm 🤔\n</think>\n\nOK<|im_end|>",
    "    spaces   and\ttabs\n\n\nnewlines",
];

#[test]
fn builtin_chunks_are_whole_characters_and_concatenate_to_decode() {
    let tok = builtin();
    for text in TEXTS {
        let ids = tok.encode(text, false).unwrap();
        for skip in [false, true] {
            let (chunks, rest) = stream(tok, &ids, skip);
            assert!(rest.is_empty(), "{text:?}: held back {rest:?}");
            for chunk in &chunks {
                assert!(!chunk.contains('\u{FFFD}'), "{text:?}: chunk {chunk:?}");
            }
        }
        let (chunks, _) = stream(tok, &ids, false);
        assert_eq!(chunks.concat(), text);
    }
}

#[test]
fn characters_split_over_tokens_are_held_back_until_complete() {
    let tok = builtin();
    // Find characters that take more than one token.
    let mut found = 0;
    for c in ['🦀', '𓀀', '𝔘', '🤔', '俱', '훑', '🦩', '𒀀'] {
        let text = c.to_string();
        let ids = tok.encode(&text, false).unwrap();
        if ids.len() < 2 {
            continue;
        }
        found += 1;
        let mut dec = IncrementalDecoder::new(tok.clone(), false);
        for &id in &ids[..ids.len() - 1] {
            assert_eq!(
                dec.step(id).unwrap(),
                "",
                "{c}: emitted part of a character"
            );
            assert!(dec.has_pending());
        }
        assert_eq!(dec.step(ids[ids.len() - 1]).unwrap(), text);
        assert!(!dec.has_pending());
    }
    assert!(found >= 3, "too few multi-token characters ({found})");
}

#[test]
fn special_tokens_are_skipped_or_emitted() {
    let tok = builtin();
    let ids = tok
        .encode("<|im_start|>assistant\nHi<|im_end|>", false)
        .unwrap();
    let (chunks, _) = stream(tok, &ids, true);
    assert_eq!(chunks.concat(), "assistant\nHi");
    assert_eq!(chunks[0], "");
    let (chunks, _) = stream(tok, &ids, false);
    assert_eq!(chunks[0], "<|im_start|>");
    assert_eq!(chunks.last().unwrap(), "<|im_end|>");
}

#[test]
fn random_id_streams_concatenate_to_decode() {
    let tok = builtin();
    let bound = u64::from(BUILTIN_SPECIAL_START) + BUILTIN_SPECIAL_TOKENS.len() as u64;
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    for round in 0..200 {
        let len = 1 + rng.below(120) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| {
                // Bias towards single-byte tokens (ids below 256) to split characters often.
                if rng.below(3) == 0 {
                    rng.below(256) as u32
                } else {
                    rng.below(bound) as u32
                }
            })
            .collect();
        stream(tok, &ids, round % 2 == 0);
    }
}

#[test]
fn prompt_context_is_not_emitted_and_completes_split_characters() {
    let tok = builtin();
    let ids = tok.encode("Answer: 🦀🦀", false).unwrap();
    let crab = tok.encode("🦀", false).unwrap();
    assert!(crab.len() >= 2);
    // The prompt ends one token into the second crab.
    let cut = ids.len() - crab.len() + 1;
    let mut dec = IncrementalDecoder::with_prompt(tok.clone(), false, &ids[..cut]).unwrap();
    let out: String = ids[cut..].iter().map(|&id| dec.step(id).unwrap()).collect();
    assert_eq!(out, "🦀");
    assert_eq!(dec.flush().unwrap(), "");

    let prompt = tok.encode("Say hi.", false).unwrap();
    let mut dec = IncrementalDecoder::with_prompt(tok.clone(), true, &prompt).unwrap();
    let out: String = tok
        .encode(" Hi there", false)
        .unwrap()
        .iter()
        .map(|&id| dec.step(id).unwrap())
        .collect();
    assert_eq!(out, " Hi there");
}

#[test]
fn byte_fallback_pieces_are_assembled_into_characters() {
    let tok = byte_fallback();
    let text = "Hello world, 世界 🦀!";
    let ids = tok.encode(text, false).unwrap();
    // Characters outside the small vocabulary fall back to <0xXX> byte pieces.
    assert!(ids
        .iter()
        .any(|&id| tok.id_to_token(id).as_deref() == Some("<0xF0>")));
    let (chunks, rest) = stream(&tok, &ids, false);
    assert!(rest.is_empty());
    for chunk in &chunks {
        assert!(!chunk.contains('\u{FFFD}'), "chunk {chunk:?}");
    }
    // The first token's leading space is dropped by the decoder, later ones are kept.
    assert_eq!(chunks.concat(), text);
    assert_eq!(chunks[0], "Hello");
    assert!(chunks.iter().any(|c| c == " wor"), "{chunks:?}");
}

#[test]
fn byte_fallback_random_streams_concatenate_to_decode() {
    let tok = byte_fallback();
    let size = tok.vocab_size() as u64;
    let mut rng = Rng(42);
    for round in 0..100 {
        let len = 1 + rng.below(60) as usize;
        let ids: Vec<u32> = (0..len).map(|_| rng.below(size) as u32).collect();
        stream(&tok, &ids, round % 2 == 1);
    }
}

#[test]
fn long_streams_keep_a_small_window() {
    let tok = builtin();
    let text = "Streaming text with 表意文字 and emoji 🦀 over many tokens. ".repeat(400);
    let ids = tok.encode(&text, false).unwrap();
    let mut dec = IncrementalDecoder::new(tok.clone(), false);
    let mut out = String::new();
    let start = std::time::Instant::now();
    for &id in &ids {
        out.push_str(&dec.step(id).unwrap());
    }
    let per_token = start.elapsed() / ids.len() as u32;
    assert_eq!(out, text);
    // Each step decodes a few ids; even a slow debug machine stays far below a millisecond.
    assert!(per_token.as_micros() < 500, "{per_token:?} per token");
}
