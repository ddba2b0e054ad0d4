//! [`IncrementalDecoder`]: turns a stream of generated ids into text chunks.
//!
//! Each step decodes only a small window of recent ids, like vLLM's prefix/read offsets: the
//! text of `ids[prefix..read]` was emitted already; the text of `ids[prefix..]` minus that is
//! new. Text that ends in U+FFFD (an unfinished UTF-8 character from byte-level or
//! `<0xAB>` byte-fallback pieces) is held back until a later id completes it. A run of
//! byte-fallback pieces is held back until it ends, because the `ByteFallback` decoder turns the
//! whole run into U+FFFD when a later piece makes it invalid. Starting the window a little
//! before the new ids keeps decoders that treat the first token specially (e.g. dropping a
//! leading space) consistent, so the chunks concatenate to `decode(all ids)`.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Held-back ids after which text is emitted anyway, so that an endless run of invalid bytes
/// cannot grow the window without bound (the chunks may then differ from `decode(all)` in how
/// the invalid bytes are replaced).
const MAX_PENDING: usize = 64;

/// Streaming detokenizer for one sequence.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The window: ids from `prefix` on; earlier ids are dropped.
    window: Vec<u32>,
    /// `window[..read]` has been emitted.
    read: usize,
    /// Text of `window[..read]`.
    prefix_text: String,
    /// Total ids fed.
    count: usize,
}

impl IncrementalDecoder {
    /// A decoder for a new sequence. With `skip_special_tokens`, special added tokens produce no
    /// text; otherwise their text is emitted.
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> IncrementalDecoder {
        IncrementalDecoder {
            tokenizer,
            skip_special_tokens,
            window: Vec::new(),
            read: 0,
            prefix_text: String::new(),
            count: 0,
        }
    }

    /// A decoder that continues after `prompt` ids (e.g. so the first generated token is
    /// decoded in context). The prompt's text is not emitted.
    pub fn with_prompt(
        tokenizer: Tokenizer,
        skip_special_tokens: bool,
        prompt: &[u32],
    ) -> Result<IncrementalDecoder> {
        let mut dec = IncrementalDecoder::new(tokenizer, skip_special_tokens);
        // A few ids of context are enough; start where the text is complete.
        let mut start = prompt.len().saturating_sub(6);
        while start > 0 {
            let text = dec.decode(&prompt[start..])?;
            if !text.starts_with('\u{FFFD}') {
                break;
            }
            start -= 1;
        }
        dec.window = prompt[start..].to_vec();
        // The prompt may end inside a character or a byte-fallback run: those ids stay pending,
        // so the generated ids that complete them emit the whole character.
        let mut read = dec.window.len();
        while read > 0 {
            let pending = dec.tokenizer.is_byte_piece(dec.window[read - 1]);
            if !pending {
                let text = dec.decode(&dec.window[..read])?;
                if !text.ends_with('\u{FFFD}') {
                    dec.prefix_text = text;
                    break;
                }
            }
            read -= 1;
        }
        dec.read = read;
        Ok(dec)
    }

    /// Feeds one id; returns the text it completes (often empty).
    pub fn step(&mut self, id: u32) -> Result<String> {
        self.count += 1;
        self.window.push(id);
        if self.tokenizer.is_byte_piece(id) && self.window.len() - self.read <= MAX_PENDING {
            return Ok(String::new());
        }
        let text = self.decode(&self.window)?;
        if text.ends_with('\u{FFFD}') && self.window.len() - self.read <= MAX_PENDING {
            return Ok(String::new());
        }
        let new = self.new_part(&text);
        // The emitted text becomes the prefix of the next window.
        self.window.drain(..self.read);
        self.read = self.window.len();
        self.prefix_text = if self.window.is_empty() {
            String::new()
        } else {
            self.decode(&self.window)?
        };
        Ok(new)
    }

    /// Returns whatever text is still held back (an unfinished character shows as U+FFFD), and
    /// resets the window. Call at the end of the sequence.
    pub fn flush(&mut self) -> Result<String> {
        if self.read == self.window.len() {
            return Ok(String::new());
        }
        let text = self.decode(&self.window)?;
        let new = self.new_part(&text);
        self.window.clear();
        self.read = 0;
        self.prefix_text.clear();
        Ok(new)
    }

    /// Number of ids fed so far.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True before the first id.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// True when some ids' text is held back.
    pub fn has_pending(&self) -> bool {
        self.read < self.window.len()
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, self.skip_special_tokens)
    }

    /// `text` minus the already emitted prefix text.
    fn new_part(&self, text: &str) -> String {
        if let Some(rest) = text.strip_prefix(self.prefix_text.as_str()) {
            return rest.to_string();
        }
        // A decoder rewrote the earlier text (not the case for byte-level or byte-fallback
        // vocabularies): emit past the common prefix.
        let common = text
            .char_indices()
            .zip(self.prefix_text.chars())
            .find(|((_, a), b)| a != b)
            .map_or_else(|| text.len().min(self.prefix_text.len()), |((i, _), _)| i);
        let common = (0..=common)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        text[common..].to_string()
    }
}
