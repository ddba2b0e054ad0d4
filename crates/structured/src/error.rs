//! What can go wrong on the grammar side.

use thiserror::Error;

/// A constraint that cannot be compiled, or a matcher that cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StructuredError {
    /// The tokenizer's vocabulary cannot be turned into a token trie.
    #[error("cannot build the token trie: {0}")]
    Vocabulary(String),
    /// The request's constraint is malformed (before llguidance sees it).
    #[error("{0}")]
    Invalid(String),
    /// llguidance refused the grammar (an unsupported schema, a bad regex or Lark grammar).
    #[error("the grammar cannot be compiled: {0}")]
    Compile(String),
    /// The matcher failed while generating (a token outside the mask, a lexer limit).
    #[error("the grammar matcher failed: {0}")]
    Matcher(String),
}

/// Short alias.
pub type Result<T, E = StructuredError> = std::result::Result<T, E>;
