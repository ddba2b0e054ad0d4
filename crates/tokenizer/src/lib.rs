//! Tokenization for sanmai: the [`Tokenizer`] (a Hugging Face `tokenizer.json` loaded with the
//! `tokenizers` crate, with special tokens, end-of-sequence ids and chat template from the model
//! directory), the built-in Qwen3.5/3.6 vocabulary and chat template (converted from tiktoken
//! ranks compiled into the binary), the streaming [`IncrementalDecoder`], and [`ChatTemplate`]
//! rendering that matches transformers' `apply_chat_template`.

pub mod builtin;
mod detok;
mod error;
pub mod parsers;
pub mod template;
pub mod tiktoken;
mod tokenizer;

pub use builtin::builtin_eos_ids;
pub use detok::IncrementalDecoder;
pub use error::{Result, TokenizerError};
pub use template::{ChatTemplate, ContentFormat, RenderRequest};
pub use tokenizer::{Tokenizer, TokenizerParts};
