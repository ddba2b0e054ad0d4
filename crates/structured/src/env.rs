//! The token trie of a tokenizer, built once at startup: each id's bytes, with special tokens marked so a
//! grammar never produces them as text.
//!
//! Byte-level BPE vocabularies (GPT-2's byte-to-char mapping, as Qwen's) and byte-fallback vocabularies
//! (`<0xAB>` pieces and `▁` for space, as SentencePiece's) are both read from the token strings; added
//! tokens that are text rather than control tokens (Qwen's `<think>`, `<tool_call>`) keep their content
//! as bytes, so a grammar can produce them.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use sanmai_tokenizer::Tokenizer;

use crate::error::{Result, StructuredError};

/// A [`TokenizerEnv`] over a sanmai tokenizer: the trie plus canonical tokenization of text.
pub struct SanmaiTokEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for SanmaiTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

/// GPT-2's byte-level alphabet: the char each byte is written as.
fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |c: u32| matches!(c, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for b in 0..=255u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        if let Some(ch) = char::from_u32(c) {
            map.insert(ch, b as u8);
        }
    }
    map
}

/// How token strings encode bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    ByteLevel,
    ByteFallback,
}

fn detect_encoding(tok: &Tokenizer) -> Encoding {
    // A byte-level vocabulary writes a space as `Ġ`; a byte-fallback one has `<0xAB>` pieces.
    let backend = tok.backend();
    let has_g = backend.token_to_id("Ġthe").is_some() || backend.token_to_id("Ġ").is_some();
    let has_fallback = (0..=255u8).any(|b| backend.token_to_id(&format!("<0x{b:02X}>")).is_some());
    if has_fallback && !has_g {
        return Encoding::ByteFallback;
    }
    Encoding::ByteLevel
}

/// The bytes of every id below `vocab_size` (empty for ids without a token), special tokens prefixed by
/// [`TokTrie::SPECIAL_TOKEN_MARKER`].
pub fn token_bytes(tok: &Tokenizer) -> Vec<Vec<u8>> {
    let n = tok.vocab_size();
    let backend = tok.backend();
    let chars = byte_level_chars();
    let encoding = detect_encoding(tok);
    let added = backend.get_added_tokens_decoder();
    let mut out = vec![Vec::new(); n];
    for (id, slot) in out.iter_mut().enumerate() {
        let id = id as u32;
        if let Some(a) = added.get(&id) {
            *slot = if a.special {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(a.content.as_bytes());
                b
            } else {
                a.content.as_bytes().to_vec()
            };
            continue;
        }
        let Some(name) = backend.id_to_token(id) else {
            continue;
        };
        *slot = match encoding {
            Encoding::ByteLevel => {
                match name
                    .chars()
                    .map(|c| chars.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                {
                    Some(b) => b,
                    // Not in the byte alphabet: take the string as it is.
                    None => name.into_bytes(),
                }
            }
            Encoding::ByteFallback => {
                if tok.is_byte_piece(id) {
                    u8::from_str_radix(&name[3..5], 16).map_or_else(|_| Vec::new(), |b| vec![b])
                } else {
                    name.replace('▁', " ").into_bytes()
                }
            }
        };
    }
    out
}

/// Builds the token environment of `tok`: the trie over its vocabulary, with `eos` as the end token a
/// grammar allows once it is complete.
pub fn build_tok_env(tok: &Tokenizer) -> Result<TokEnv> {
    let words = token_bytes(tok);
    let eos: Vec<u32> = tok
        .eos_token_ids()
        .iter()
        .copied()
        .filter(|&e| (e as usize) < words.len())
        .collect();
    let Some(&first) = eos.first() else {
        return Err(StructuredError::Vocabulary(
            "the tokenizer has no end-of-sequence id inside its vocabulary".into(),
        ));
    };
    let info = TokRxInfo::new(words.len() as u32, first);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    Ok(Arc::new(SanmaiTokEnv {
        trie,
        tokenizer: tok.clone(),
    }))
}
