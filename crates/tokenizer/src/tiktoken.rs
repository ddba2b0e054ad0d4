//! Conversion of a tiktoken rank file (`base64-token rank` per line) into a byte-level BPE
//! [`tokenizers::Tokenizer`].
//!
//! tiktoken encodes a pre-tokenized piece by repeatedly merging the adjacent pair whose
//! concatenation has the lowest rank. A `tokenizers` BPE model instead applies explicit merges
//! `(left, right)` in priority order. The two agree when every multi-byte token `t` of rank `r`
//! gets the merge made of the two pieces that tiktoken's own procedure leaves when run on the
//! bytes of `t` with only ranks below `r`, and merges are prioritised by the rank of their
//! result. tiktoken also takes a piece that is itself a token as a whole, before merging; the
//! model reproduces that with `ignore_merges`.
//!
//! Vocabulary strings use the GPT-2 byte-to-unicode alphabet so that the `ByteLevel`
//! pre-tokenizer and decoder of `tokenizers` map them back to bytes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use rayon::prelude::*;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Result, TokenizerError};

/// What is needed to build a tokenizer from tiktoken ranks.
#[derive(Debug, Clone)]
pub struct TiktokenSpec<'a> {
    /// Text of a `.tiktoken` file: one `base64(token) rank` pair per line.
    pub ranks: &'a str,
    /// The pre-tokenizer regex (tiktoken's `pat_str`).
    pub pattern: &'a str,
    /// Special tokens and their ids. They are matched in raw text, before normalization.
    pub special_tokens: &'a [(&'a str, u32)],
    /// Apply NFC normalization before pre-tokenization.
    pub nfc: bool,
}

/// A tiktoken vocabulary: `tokens[rank]` is the byte string of that rank (ranks may be sparse).
#[derive(Debug, Clone, Default)]
pub struct Ranks {
    tokens: Vec<Option<Vec<u8>>>,
}

impl Ranks {
    /// Parses the text of a `.tiktoken` file.
    pub fn parse(text: &str) -> Result<Ranks> {
        let mut tokens: Vec<Option<Vec<u8>>> = Vec::new();
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (index, line) in text.lines().enumerate() {
            let line_no = index + 1;
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let mut fields = line.split_ascii_whitespace();
            let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(ranks_err(line_no, "expected `base64-token rank`"));
            };
            let rank: u32 = rank
                .parse()
                .map_err(|_| ranks_err(line_no, format!("rank `{rank}` is not an integer")))?;
            let bytes = base64_decode(b64)
                .ok_or_else(|| ranks_err(line_no, format!("token `{b64}` is not valid base64")))?;
            if bytes.is_empty() {
                return Err(ranks_err(line_no, "empty token"));
            }
            if let Some(first) = seen.insert(b64, line_no) {
                return Err(ranks_err(
                    line_no,
                    format!("token `{b64}` already given on line {first}"),
                ));
            }
            let slot = rank as usize;
            if slot >= tokens.len() {
                tokens.resize(slot + 1, None);
            }
            if tokens[slot].is_some() {
                return Err(ranks_err(line_no, format!("rank {rank} given twice")));
            }
            tokens[slot] = Some(bytes);
        }
        if tokens.is_empty() {
            return Err(ranks_err(0, "no tokens"));
        }
        Ok(Ranks { tokens })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.iter().filter(|t| t.is_some()).count()
    }

    /// True when there is no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One past the highest rank.
    pub fn rank_bound(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// The bytes of a rank.
    pub fn bytes(&self, rank: u32) -> Option<&[u8]> {
        self.tokens.get(rank as usize)?.as_deref()
    }

    fn iter(&self) -> impl Iterator<Item = (u32, &[u8])> {
        self.tokens
            .iter()
            .enumerate()
            .filter_map(|(r, t)| t.as_deref().map(|t| (r as u32, t)))
    }

    /// Derives the BPE merges: for every multi-byte token, `(left rank, right rank, token rank)`,
    /// ordered by token rank. Fails when a token cannot be built from lower-ranked pieces, or
    /// when a single byte has no token.
    pub fn merges(&self) -> Result<Vec<(u32, u32, u32)>> {
        let mut index: FastMap<&[u8], u32> =
            FastMap::with_capacity_and_hasher(self.tokens.len(), Default::default());
        for (rank, bytes) in self.iter() {
            index.insert(bytes, rank);
        }
        for b in 0..=255u8 {
            if !index.contains_key(&[b][..]) {
                return Err(ranks_err(0, format!("byte 0x{b:02X} has no token")));
            }
        }
        let multi: Vec<(u32, &[u8])> = self.iter().filter(|(_, t)| t.len() > 1).collect();
        multi
            .par_iter()
            .map(|&(rank, bytes)| {
                let split = split_point(&index, bytes, rank).ok_or_else(|| {
                    ranks_err(
                        0,
                        format!("token of rank {rank} cannot be built from lower ranks"),
                    )
                })?;
                Ok((index[&bytes[..split]], index[&bytes[split..]], rank))
            })
            .collect()
    }
}

/// Runs tiktoken's merge procedure on `bytes` with ranks below `limit`; returns the split point
/// when exactly two pieces remain.
fn split_point(index: &FastMap<&[u8], u32>, bytes: &[u8], limit: u32) -> Option<usize> {
    // Piece boundaries; piece i is bytes[bounds[i]..bounds[i + 1]].
    let mut bounds: Vec<usize> = (0..=bytes.len()).collect();
    while bounds.len() > 3 {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..bounds.len() - 2 {
            if let Some(&r) = index.get(&bytes[bounds[i]..bounds[i + 2]]) {
                if r < limit && best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, i));
                }
            }
        }
        let (_, i) = best?;
        bounds.remove(i + 1);
    }
    (bounds.len() == 3).then_some(bounds[1])
}

/// The GPT-2 byte-to-unicode table: printable bytes map to themselves, the others to U+0100+.
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            b as char
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
            next += 1;
            c
        };
    }
    table
}

/// Builds the `tokenizers` tokenizer described by `spec`.
pub fn build_tokenizer(spec: &TiktokenSpec<'_>) -> Result<tokenizers::Tokenizer> {
    let ranks = Ranks::parse(spec.ranks)?;
    let merges = ranks.merges()?;
    let table = byte_to_char();
    let strings: Vec<Option<String>> = ranks
        .tokens
        .iter()
        .map(|t| {
            t.as_ref()
                .map(|t| t.iter().map(|&b| table[b as usize]).collect())
        })
        .collect();
    let vocab: Vocab = ranks
        .iter()
        .map(|(rank, _)| (strings[rank as usize].clone().unwrap_or_default(), rank))
        .collect();
    let piece = |rank: u32| strings[rank as usize].clone().unwrap_or_default();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|&(left, right, _)| (piece(left), piece(right)))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(true)
        .build()
        .map_err(|e| TokenizerError::backend("building the BPE model", e))?;

    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    if spec.nfc {
        tokenizer
            .with_normalizer(Some(NFC))
            .map_err(|e| TokenizerError::backend("setting the NFC normalizer", e))?;
    }
    let split = Split::new(
        SplitPattern::Regex(spec.pattern.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| TokenizerError::backend("compiling the pre-tokenizer regex", e))?;
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])));
    tokenizer.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));

    let mut specials: Vec<(&str, u32)> = spec.special_tokens.to_vec();
    specials.sort_by_key(|&(_, id)| id);
    if let Some(&(content, id)) = specials.iter().find(|&&(_, id)| ranks.bytes(id).is_some()) {
        return Err(TokenizerError::field(
            "special tokens",
            content,
            format!("id {id} is already a BPE token"),
        ));
    }
    tokenizer
        .add_special_tokens(
            specials
                .iter()
                .map(|&(content, _)| AddedToken::from(content.to_string(), true)),
        )
        .map_err(|e| TokenizerError::backend("adding special tokens", e))?;
    for &(content, id) in &specials {
        let got = tokenizer.token_to_id(content);
        if got != Some(id) {
            return Err(TokenizerError::field(
                "special tokens",
                content,
                format!(
                    "wanted id {id}, the tokenizer assigned {got:?} (ids must follow the ranks densely)"
                ),
            ));
        }
    }
    Ok(tokenizer)
}

fn ranks_err(line: usize, message: impl Into<String>) -> TokenizerError {
    TokenizerError::Ranks {
        line,
        message: message.into(),
    }
}

/// Decodes standard base64 (with optional `=` padding).
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let body = text.trim_end_matches('=');
    if text.len() - body.len() > 2 || body.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.as_bytes().chunks(4) {
        let mut acc = 0u32;
        for &c in chunk {
            acc = (acc << 6) | value(c)?;
        }
        acc <<= 6 * (4 - chunk.len()) as u32;
        let n = chunk.len() * 6 / 8;
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    Some(out)
}

/// A small multiplicative hasher for short byte-string keys (FxHash).
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(K);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.write(&n.to_le_bytes());
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_known_values() {
        assert_eq!(base64_decode("IQ==").unwrap(), b"!");
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(base64_decode("4pyT").unwrap(), "✓".as_bytes());
        assert!(base64_decode("a").is_none());
        assert!(base64_decode("a$==").is_none());
    }

    #[test]
    fn byte_table_is_a_bijection_onto_gpt2_alphabet() {
        let t = byte_to_char();
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    fn tiny_ranks() -> String {
        // All bytes, then "ab" (256), "bc" (257), "abc" (258), "cab" (259).
        let mut text = String::new();
        for b in 0..=255u8 {
            text.push_str(&format!("{} {}\n", b64(&[b]), b));
        }
        for (i, t) in ["ab", "bc", "abc", "cab"].iter().enumerate() {
            text.push_str(&format!("{} {}\n", b64(t.as_bytes()), 256 + i));
        }
        text
    }

    fn b64(bytes: &[u8]) -> String {
        const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let mut buf = [0u8; 3];
            buf[..chunk.len()].copy_from_slice(chunk);
            let n = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    #[test]
    fn merges_follow_lower_ranks() {
        let ranks = Ranks::parse(&tiny_ranks()).unwrap();
        let merges = ranks.merges().unwrap();
        let a = b'a' as u32;
        let b = b'b' as u32;
        let c = b'c' as u32;
        // "abc": with ranks < 258, "ab" (256) beats "bc" (257) → (ab, c).
        // "cab": "ca" is no token, "ab" merges → (c, ab).
        assert_eq!(
            merges,
            vec![(a, b, 256), (b, c, 257), (256, c, 258), (c, 256, 259)]
        );
    }

    #[test]
    fn tiny_tokenizer_encodes_like_tiktoken() {
        let ranks = tiny_ranks();
        let tok = build_tokenizer(&TiktokenSpec {
            ranks: &ranks,
            pattern: r"\S+|\s+",
            special_tokens: &[("<|end|>", 260)],
            nfc: false,
        })
        .unwrap();
        let ids = |s: &str| tok.encode_fast(s, false).unwrap().get_ids().to_vec();
        assert_eq!(ids("abc"), vec![258]);
        assert_eq!(ids("cab"), vec![259]);
        // "abcab": ab, c, ab → abc + ab (abc 258 < cab 259 pair "c"+"ab")
        assert_eq!(ids("abcab"), vec![258, 256]);
        assert_eq!(ids("bc<|end|>"), vec![257, 260]);
    }

    #[test]
    fn malformed_ranks_are_reported_with_line() {
        let err = Ranks::parse("IQ== 0\nIg== x\n").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        let err = Ranks::parse("IQ== 0\nIQ== 1\n").unwrap_err();
        assert!(err.to_string().contains("already"), "{err}");
        let err = Ranks::parse("IQ== 0\n").unwrap().merges().unwrap_err();
        assert!(err.to_string().contains("has no token"), "{err}");
    }
}
