//! Shared test helpers: a small Llama-style (SentencePiece BPE with byte fallback)
//! `tokenizer.json`, temporary model directories, a deterministic random generator, and
//! streaming tool-call parsers at every split ([`tool_stream`]).

#![allow(dead_code)]

pub mod tool_stream;

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// Letters and merges of the small byte-fallback model; anything else falls back to bytes.
const LETTERS: &str = "▁abcdefghijklmnopqrstuvwxyzHW,.!";
const MERGES: [(&str, &str); 11] = [
    ("e", "l"),
    ("l", "o"),
    ("el", "lo"),
    ("h", "e"),
    ("l", "l"),
    ("▁", "w"),
    ("o", "r"),
    ("he", "ll"),
    ("▁w", "or"),
    ("▁", "H"),
    ("▁H", "ello"),
];

/// A `tokenizer.json` like Llama 2's: `<unk> <s> </s>`, `<0xXX>` byte pieces, a `▁`-prefix
/// normalizer, a BOS post-processor and the Replace/ByteFallback/Fuse/Strip decoder chain.
/// Returns the JSON and its vocabulary size.
pub fn byte_fallback_tokenizer_json() -> (Value, u32) {
    let mut vocab = Map::new();
    let mut push = |t: String| {
        let id = vocab.len();
        vocab.insert(t, json!(id));
    };
    for t in ["<unk>", "<s>", "</s>"] {
        push(t.to_string());
    }
    for b in 0..=255u8 {
        push(format!("<0x{b:02X}>"));
    }
    for c in LETTERS.chars() {
        push(c.to_string());
    }
    for (a, b) in MERGES {
        push(format!("{a}{b}"));
    }
    let size = vocab.len() as u32;
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let merges: Vec<Value> = MERGES.iter().map(|(a, b)| json!([a, b])).collect();
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    });
    (tok, size)
}

/// A fresh empty directory under the system temp dir; removed by [`TempDir`]'s drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "sanmai-tokenizer-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn write(&self, name: &str, text: &str) {
        std::fs::write(self.0.join(name), text).expect("write temp file");
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// xorshift64*: a small deterministic generator for test inputs.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}
