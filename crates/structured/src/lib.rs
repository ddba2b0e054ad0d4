//! Structured output: turning a request's constraint (JSON object or schema, regex, choice, Lark grammar,
//! forced tool call) into an llguidance grammar, compiling it against the tokenizer's token trie, and
//! following each sequence through it with a per-step allowed-token bitset.
//!
//! [`GrammarCompiler`] is built once per tokenizer (it owns the token trie); [`GrammarCompiler::compile`]
//! turns a [`Constraint`] into a [`CompiledGrammar`] (errors name the problem, for a 400 before any
//! token); [`CompiledGrammar::matcher`] starts a [`GrammarMatcher`] per sequence, whose
//! [`fill_mask`](GrammarMatcher::fill_mask) writes the bitset the sampler applies and whose
//! [`advance`](GrammarMatcher::advance) accepts one or several tokens.

mod constraint;
mod env;
mod error;
mod grammar;
mod matcher;
mod toolcall;

pub use constraint::Constraint;
pub use env::{build_tok_env, token_bytes, SanmaiTokEnv};
pub use error::{Result, StructuredError};
pub use llguidance;
pub use matcher::{mask_words, CompiledGrammar, GrammarCompiler, GrammarMatcher};
pub use toolcall::{tool_call_lark, ToolSyntax};
