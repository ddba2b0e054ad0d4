//! Log-probabilities in the two OpenAI shapes: chat's `logprobs.content` entries (`token`, `logprob`,
//! `bytes`, `top_logprobs`) and the legacy completions object (`tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`), plus [`TokenText`], the text and bytes of a single token.

use std::collections::HashMap;

use sanmai_engine::api::TokenLogprob;
use sanmai_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use tokenizers::decoders::DecoderWrapper;

/// What JSON gets for a log-probability of minus infinity (JSON has no infinities), as vLLM does.
const NEG_INF_LOGPROB: f32 = -9999.0;

fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        NEG_INF_LOGPROB
    }
}

/// The text and bytes of single tokens, for log-probability reports.
#[derive(Clone)]
pub struct TokenText {
    tokenizer: Option<Tokenizer>,
    /// GPT-2 byte-level vocabulary: unicode char → byte.
    byte_level: Option<HashMap<char, u8>>,
}

impl TokenText {
    pub fn new(tokenizer: Option<Tokenizer>) -> TokenText {
        let byte_level = tokenizer.as_ref().and_then(|t| {
            let is_byte_level = match t.backend().get_decoder() {
                Some(DecoderWrapper::ByteLevel(_)) => true,
                Some(DecoderWrapper::Sequence(s)) => s
                    .get_decoders()
                    .iter()
                    .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
                _ => false,
            };
            is_byte_level.then(byte_level_map)
        });
        TokenText {
            tokenizer,
            byte_level,
        }
    }

    /// The bytes token `id` stands for (a byte-level piece may be part of a UTF-8 character).
    pub fn bytes(&self, id: u32) -> Vec<u8> {
        let Some(tok) = &self.tokenizer else {
            return format!("token_id:{id}").into_bytes();
        };
        let added = tok
            .backend()
            .get_added_vocabulary()
            .simple_id_to_token(id)
            .is_some();
        if !added {
            if let (Some(map), Some(piece)) = (&self.byte_level, tok.id_to_token(id)) {
                if let Some(bytes) = piece.chars().map(|c| map.get(&c).copied()).collect() {
                    return bytes;
                }
            }
            if tok.is_byte_piece(id) {
                if let Some(b) = tok.id_to_token(id).and_then(|p| {
                    u8::from_str_radix(p.trim_start_matches("<0x").trim_end_matches('>'), 16).ok()
                }) {
                    return vec![b];
                }
            }
        }
        tok.decode(&[id], false).unwrap_or_default().into_bytes()
    }

    /// The text of token `id` (invalid UTF-8 of a partial character shows as U+FFFD).
    pub fn text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.bytes(id)).into_owned()
    }

    /// One `logprobs.content` entry of a chat response, with at most `top_n` alternatives.
    pub fn chat_entry(&self, lp: &TokenLogprob, top_n: usize) -> Value {
        let bytes = self.bytes(lp.id);
        let top: Vec<Value> = lp
            .top
            .iter()
            .take(top_n)
            .map(|&(id, l)| {
                let b = self.bytes(id);
                json!({"token": String::from_utf8_lossy(&b), "logprob": finite(l), "bytes": b})
            })
            .collect();
        json!({
            "token": String::from_utf8_lossy(&bytes),
            "logprob": finite(lp.logprob),
            "bytes": bytes,
            "top_logprobs": top,
        })
    }

    /// The `logprobs` object of a chat choice (or chunk) for `lps`.
    pub fn chat_logprobs(&self, lps: &[TokenLogprob], top_n: usize) -> Value {
        json!({
            "content": lps.iter().map(|l| self.chat_entry(l, top_n)).collect::<Vec<_>>(),
        })
    }
}

/// The GPT-2 byte-to-unicode table, inverted.
fn byte_level_map() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (u32::from('!')..=u32::from('~')).collect();
    printable.extend(u32::from('¡')..=u32::from('¬'));
    printable.extend(u32::from('®')..=u32::from('ÿ'));
    let mut map = HashMap::with_capacity(256);
    let mut extra = 0;
    for b in 0..=255u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        if let Some(ch) = char::from_u32(c) {
            map.insert(ch, b as u8);
        }
    }
    map
}

/// The legacy completions `logprobs` object, built token by token.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LegacyLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    pub text_offset: Vec<usize>,
    /// Characters of text before the next token.
    pub offset: usize,
}

impl LegacyLogprobs {
    /// Starts with text offsets counted from `offset` characters.
    pub fn starting_at(offset: usize) -> LegacyLogprobs {
        LegacyLogprobs {
            offset,
            ..LegacyLogprobs::default()
        }
    }

    /// Appends token `id` with its log-probability (`None` for a prompt's first token).
    pub fn push(&mut self, text: &TokenText, id: u32, lp: Option<&TokenLogprob>, top_n: usize) {
        let token = text.text(id);
        self.text_offset.push(self.offset);
        self.offset += token.chars().count();
        self.tokens.push(token);
        self.token_logprobs.push(lp.map(|l| finite(l.logprob)));
        self.top_logprobs.push(lp.map(|l| {
            let mut map = Map::new();
            for &(id, v) in l.top.iter().take(top_n) {
                map.entry(text.text(id)).or_insert(json!(finite(v)));
            }
            map
        }));
    }

    /// The JSON object; the accumulator is left empty (offsets continue).
    pub fn take_json(&mut self) -> Value {
        json!({
            "tokens": std::mem::take(&mut self.tokens),
            "token_logprobs": std::mem::take(&mut self.token_logprobs),
            "top_logprobs": std::mem::take(&mut self.top_logprobs),
            "text_offset": std::mem::take(&mut self.text_offset),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection() {
        let map = byte_level_map();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'Ġ'], b' ');
        assert_eq!(map[&'Ċ'], b'\n');
        assert_eq!(map[&'a'], b'a');
        let mut seen: Vec<u8> = map.values().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn builtin_tokens_have_their_bytes() {
        let tok = Tokenizer::builtin().unwrap();
        let text = TokenText::new(Some(tok.clone()));
        let ids = tok.encode(" hello world\n你好", false).unwrap();
        let all: Vec<u8> = ids.iter().flat_map(|&id| text.bytes(id)).collect();
        assert_eq!(String::from_utf8(all).unwrap(), " hello world\n你好");
        let think = tok.encode("<think>", false).unwrap();
        assert_eq!(think.len(), 1);
        assert_eq!(text.text(think[0]), "<think>");
        let none = TokenText::new(None);
        assert_eq!(none.text(42), "token_id:42");
    }

    #[test]
    fn legacy_object_offsets_and_nulls() {
        let text = TokenText::new(None);
        let mut l = LegacyLogprobs::starting_at(0);
        l.push(&text, 1, None, 0);
        let lp = TokenLogprob {
            id: 2,
            logprob: -0.5,
            top: vec![(2, -0.5), (3, f32::NEG_INFINITY)],
        };
        l.push(&text, 2, Some(&lp), 2);
        let v = l.take_json();
        assert_eq!(v["tokens"], json!(["token_id:1", "token_id:2"]));
        assert_eq!(v["token_logprobs"], json!([null, -0.5]));
        assert_eq!(v["top_logprobs"][0], Value::Null);
        assert_eq!(v["top_logprobs"][1]["token_id:3"], json!(-9999.0));
        assert_eq!(v["text_offset"], json!([0, 10]));
        assert!(l.tokens.is_empty());
        assert_eq!(l.offset, 20);
    }
}
