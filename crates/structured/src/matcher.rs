//! Compiling constraints ([`GrammarCompiler`], once per tokenizer) and following one generation
//! ([`GrammarMatcher`], once per sequence): the allowed-token bitset of the next position, advancing on
//! accepted tokens (one or several at a time), rollback, and whether the grammar is done.
//!
//! The bitset layout is the sampler's: bit `i % 32` of word `i / 32` allows token `i`; ids past the
//! vocabulary are never allowed.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, TokEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use sanmai_tokenizer::Tokenizer;

use crate::constraint::Constraint;
use crate::env::build_tok_env;
use crate::error::{Result, StructuredError};

/// Words of a bitset over `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Compiles constraints for one tokenizer. Building it builds the token trie (hundreds of milliseconds
/// for a 250k vocabulary): do it once at startup and share it.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl GrammarCompiler {
    /// A compiler over `tok`'s vocabulary.
    pub fn new(tok: &Tokenizer) -> Result<Self> {
        Self::from_env(build_tok_env(tok)?)
    }

    /// A compiler over a prepared token environment.
    pub fn from_env(env: TokEnv) -> Result<Self> {
        let vocab = env.tok_trie().vocab_size();
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            vocab,
        })
    }

    /// Tokens the bitsets cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The token environment (trie and tokenization).
    pub fn tok_env(&self) -> &TokEnv {
        self.factory.tok_env()
    }

    /// Compiles a constraint. Errors name what is wrong with it; the first mask is computed here too, so a
    /// grammar that cannot start fails now rather than at the first step.
    pub fn compile(&self, c: &Constraint) -> Result<CompiledGrammar> {
        self.compile_grammar(c.to_grammar()?)
    }

    /// Compiles an llguidance grammar.
    pub fn compile_grammar(&self, g: TopLevelGrammar) -> Result<CompiledGrammar> {
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(g)
        }))
        .map_err(|_| StructuredError::Compile("the grammar compiler panicked".into()))?
        .map_err(|e| StructuredError::Compile(e.to_string()))?;
        let compiled = CompiledGrammar {
            parser,
            vocab: self.vocab,
        };
        let mut probe = compiled.matcher();
        let mut mask = vec![0u32; mask_words(self.vocab)];
        probe
            .fill_mask(&mut mask)
            .map_err(|e| StructuredError::Compile(e.to_string()))?;
        if mask.iter().all(|&w| w == 0) {
            return Err(StructuredError::Compile(
                "the grammar allows no output at all".into(),
            ));
        }
        Ok(compiled)
    }
}

/// A compiled grammar: a template for any number of matchers (one per sequence).
#[derive(Clone)]
pub struct CompiledGrammar {
    parser: TokenParser,
    vocab: usize,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl CompiledGrammar {
    /// A fresh matcher at the start of the grammar.
    pub fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher {
            m: Matcher::new(Ok(self.parser.deep_clone())),
            vocab: self.vocab,
            consumed: 0,
        }
    }
}

/// One sequence's position in its grammar.
pub struct GrammarMatcher {
    m: Matcher,
    vocab: usize,
    consumed: usize,
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("consumed", &self.consumed)
            .field("stopped", &self.m.is_stopped())
            .finish()
    }
}

impl GrammarMatcher {
    fn err(&self, what: &str, e: impl std::fmt::Display) -> StructuredError {
        StructuredError::Matcher(format!("{what}: {e}"))
    }

    /// Tokens the bitsets cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Tokens accepted so far.
    pub fn num_consumed(&self) -> usize {
        self.consumed
    }

    /// Writes the allowed tokens of the next position into `out` (at least [`mask_words`] words; the rest
    /// is cleared). Once the grammar is done only the end-of-sequence tokens are allowed.
    pub fn fill_mask(&mut self, out: &mut [u32]) -> Result<()> {
        let vob = self
            .m
            .compute_mask_or_eos()
            .map_err(|e| self.err("computing the mask", e))?;
        let src = vob.as_slice();
        let n = src.len().min(out.len());
        out[..n].copy_from_slice(&src[..n]);
        out[n..].fill(0);
        Ok(())
    }

    /// Accepts `tokens` (a sampled token, or several accepted at once by speculative decoding).
    pub fn advance(&mut self, tokens: &[u32]) -> Result<()> {
        self.m
            .consume_tokens(tokens)
            .map_err(|e| self.err("accepting a token", e))?;
        self.consumed += tokens.len();
        Ok(())
    }

    /// How many of `tokens` the grammar accepts in order (it advances over those).
    pub fn try_advance(&mut self, tokens: &[u32]) -> Result<usize> {
        let n = self
            .m
            .try_consume_tokens(tokens)
            .map_err(|e| self.err("accepting tokens", e))?;
        self.consumed += n;
        Ok(n)
    }

    /// Forgets the last `n` accepted tokens (rejected speculative tokens).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > self.consumed {
            return Err(StructuredError::Matcher(format!(
                "cannot roll back {n} tokens: only {} were accepted",
                self.consumed
            )));
        }
        self.m
            .rollback(n)
            .map_err(|e| self.err("rolling back", e))?;
        self.consumed -= n;
        Ok(())
    }

    /// The masks of every position of a speculative draft: row `i` of `out` (rows of
    /// [`mask_words`] words) is the mask after `draft[..i]`, for `i` in `0..=draft.len()`, as far as the
    /// grammar accepts the draft. Returns the number of rows written (1 + the accepted draft prefix); the
    /// matcher is left where it was.
    pub fn draft_masks(&mut self, draft: &[u32], out: &mut [u32]) -> Result<usize> {
        let words = mask_words(self.vocab);
        let mut rows = 0;
        let mut taken = 0;
        let result = (|| {
            for i in 0..=draft.len() {
                let Some(row) = out.get_mut(i * words..(i + 1) * words) else {
                    break;
                };
                self.fill_mask(row)?;
                rows += 1;
                let Some(&t) = draft.get(i) else { break };
                if row[t as usize / 32] & (1 << (t % 32)) == 0 || self.m.is_stopped() {
                    break;
                }
                self.advance(&[t])?;
                taken += 1;
            }
            Ok(())
        })();
        self.rollback(taken)?;
        result.map(|()| rows)
    }

    /// The grammar is done: nothing but the end of the sequence may follow (also after an error).
    pub fn is_stopped(&self) -> bool {
        self.m.is_stopped()
    }

    /// The text so far is a complete match (the end of the sequence is allowed now).
    pub fn is_accepting(&mut self) -> bool {
        self.m.is_accepting().unwrap_or(false)
    }

    /// The matcher's error, if it failed.
    pub fn error(&self) -> Option<String> {
        self.m.get_error()
    }
}
