//! Conversion of a tiktoken rank file (`base64-token rank` per line) into a byte-level BPE
//! [`tokenizers::Tokenizer`].
//!
//! tiktoken encodes a pre-tokenized piece by repeatedly merging the adjacent pair whose
//! concatenation has the lowest rank. A `tokenizers` BPE model instead applies explicit merges
//! `(left, right)` in priority order. The two agree when every multi-byte token `t` of rank `r`
//! gets the merge made of the two pieces that tiktoken's own procedure leaves when run on the
//! bytes of `t` up to the point where two pieces remain (for almost all tokens these pieces have
//! ranks below `r`; a few hundred added words are only reached through higher-ranked pieces),
//! and merges are prioritised by the rank of their result. tiktoken also takes a piece that is
//! itself a token as a whole, before merging; the model reproduces that with `ignore_merges`.
//! Tokens that merging can never reach (it gets stuck at three or more pieces) get no merge: like
//! tiktoken, the model produces them only for a piece that is exactly the token.
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
    /// Added tokens and their ids. They are matched in raw text, before normalization.
    pub special_tokens: &'a [(&'a str, u32)],
    /// Added tokens that are text, not control tokens (`<think>`, `<tool_call>`, …): decoding keeps them
    /// even when skipping special tokens, as the reasoning and tool-call parsers need them.
    pub text_tokens: &'a [&'a str],
    /// Apply NFC normalization before pre-tokenization.
    pub nfc: bool,
    /// Precomputed [`Ranks::splits`] of `ranks`; computed when absent.
    pub splits: Option<&'a [u8]>,
}

/// Ranks above this are rejected (no real vocabulary comes close; it bounds memory).
const MAX_RANK: u32 = 1 << 24;

/// A tiktoken vocabulary: the byte string of each rank (ranks may be sparse).
#[derive(Debug, Clone, Default)]
pub struct Ranks {
    /// All token bytes, back to back.
    data: Vec<u8>,
    /// `(start, len)` in `data` per rank; `len == 0` means the rank has no token.
    spans: Vec<(u32, u32)>,
}

impl Ranks {
    /// Parses the text of a `.tiktoken` file.
    pub fn parse(text: &str) -> Result<Ranks> {
        let mut data = Vec::with_capacity(text.len() / 2);
        let mut spans: Vec<(u32, u32)> = Vec::new();
        for (index, line) in text.split('\n').enumerate() {
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
            let start = data.len();
            if !base64_decode_into(b64, &mut data) {
                return Err(ranks_err(
                    line_no,
                    format!("token `{b64}` is not valid base64"),
                ));
            }
            let len = data.len() - start;
            if len == 0 {
                return Err(ranks_err(line_no, "empty token"));
            }
            if rank > MAX_RANK {
                return Err(ranks_err(
                    line_no,
                    format!("rank {rank} is implausibly large"),
                ));
            }
            let slot = rank as usize;
            if slot >= spans.len() {
                spans.resize(slot + 1, (0, 0));
            }
            if spans[slot].1 != 0 {
                return Err(ranks_err(line_no, format!("rank {rank} given twice")));
            }
            spans[slot] = (start as u32, len as u32);
        }
        if spans.is_empty() {
            return Err(ranks_err(0, "no tokens"));
        }
        Ok(Ranks { data, spans })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.spans.iter().filter(|s| s.1 != 0).count()
    }

    /// True when there is no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One past the highest rank.
    pub fn rank_bound(&self) -> u32 {
        self.spans.len() as u32
    }

    /// The bytes of a rank.
    pub fn bytes(&self, rank: u32) -> Option<&[u8]> {
        let &(start, len) = self.spans.get(rank as usize)?;
        (len != 0).then(|| &self.data[start as usize..(start + len) as usize])
    }

    fn iter(&self) -> impl Iterator<Item = (u32, &[u8])> {
        (0..self.rank_bound()).filter_map(|r| self.bytes(r).map(|b| (r, b)))
    }

    /// Bytes → rank, failing on a token given twice or a byte without a token.
    fn index(&self) -> Result<FastMap<&[u8], u32>> {
        let mut index: FastMap<&[u8], u32> =
            FastMap::with_capacity_and_hasher(self.spans.len(), Default::default());
        for (rank, bytes) in self.iter() {
            if let Some(first) = index.insert(bytes, rank) {
                return Err(ranks_err(
                    0,
                    format!("ranks {first} and {rank} hold the same token"),
                ));
            }
        }
        for b in 0..=255u8 {
            if !index.contains_key(&[b][..]) {
                return Err(ranks_err(0, format!("byte 0x{b:02X} has no token")));
            }
        }
        Ok(index)
    }

    /// Derives the BPE merges: for every multi-byte token that merging can reach,
    /// `(left rank, right rank, token rank)`, ordered by token rank. Fails on a duplicate token
    /// or a byte without a token.
    pub fn merges(&self) -> Result<Vec<(u32, u32, u32)>> {
        let index = self.index()?;
        let splits = self.splits_with(&index)?;
        Ok(self
            .iter()
            .filter(|&(rank, _)| splits[rank as usize] != 0)
            .map(|(rank, bytes)| {
                let k = splits[rank as usize] as usize;
                (index[&bytes[..k]], index[&bytes[k..]], rank)
            })
            .collect())
    }

    /// The merge of each rank as a split offset into its bytes (`0`: no merge, for single
    /// bytes and tokens merging cannot reach). This is the compact form the built-in vocabulary
    /// ships precomputed.
    pub fn splits(&self) -> Result<Vec<u8>> {
        let index = self.index()?;
        self.splits_with(&index)
    }

    fn splits_with(&self, index: &FastMap<&[u8], u32>) -> Result<Vec<u8>> {
        (0..self.rank_bound())
            .into_par_iter()
            .map(|rank| match self.bytes(rank) {
                Some(bytes) if bytes.len() > 1 => match split_point(index, bytes) {
                    None => Ok(0),
                    Some(k) => u8::try_from(k).map_err(|_| {
                        ranks_err(
                            0,
                            format!("rank {rank}: split at byte {k} does not fit a byte"),
                        )
                    }),
                },
                _ => Ok(0),
            })
            .collect()
    }

    /// The merges given by a split table, as byte pairs in token-rank order.
    fn merge_pieces<'s>(&'s self, splits: &[u8]) -> Result<Vec<(&'s [u8], &'s [u8])>> {
        if splits.len() != self.spans.len() {
            return Err(ranks_err(
                0,
                format!(
                    "split table has {} entries for {} ranks",
                    splits.len(),
                    self.spans.len()
                ),
            ));
        }
        let mut pieces = Vec::with_capacity(splits.len());
        for (rank, bytes) in self.iter() {
            let k = splits[rank as usize] as usize;
            if k == 0 {
                continue;
            }
            if k >= bytes.len() {
                return Err(ranks_err(
                    0,
                    format!("split {k} of rank {rank} is out of range"),
                ));
            }
            pieces.push((&bytes[..k], &bytes[k..]));
        }
        Ok(pieces)
    }
}

/// Runs tiktoken's merge procedure on `bytes` until two pieces remain; returns the split point,
/// or `None` when merging gets stuck before.
fn split_point(index: &FastMap<&[u8], u32>, bytes: &[u8]) -> Option<usize> {
    // Piece i is bytes[bounds[i]..bounds[i + 1]]; pair[i] is the rank of pieces i and i + 1
    // joined (u32::MAX: not a token).
    let mut bounds: Vec<usize> = (0..=bytes.len()).collect();
    let pair_rank = |bounds: &[usize], i: usize| {
        index
            .get(&bytes[bounds[i]..bounds[i + 2]])
            .copied()
            .unwrap_or(u32::MAX)
    };
    let mut pair: Vec<u32> = (0..bytes.len() - 1)
        .map(|i| pair_rank(&bounds, i))
        .collect();
    while bounds.len() > 3 {
        let (i, &best) = pair.iter().enumerate().min_by_key(|&(i, r)| (*r, i))?;
        if best == u32::MAX {
            return None;
        }
        bounds.remove(i + 1);
        pair.remove(i);
        if i > 0 {
            pair[i - 1] = pair_rank(&bounds, i - 1);
        }
        if i < pair.len() {
            pair[i] = pair_rank(&bounds, i);
        }
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
    let computed;
    let splits = match spec.splits {
        Some(splits) => splits,
        None => {
            computed = ranks.splits()?;
            &computed
        }
    };
    let merges = ranks.merge_pieces(splits)?;
    let table = byte_to_char();
    let to_string = |bytes: &[u8]| -> String { bytes.iter().map(|&b| table[b as usize]).collect() };
    let (vocab, merges) = rayon::join(
        || -> Vocab {
            let mut vocab = Vocab::with_capacity(ranks.spans.len());
            vocab.extend(ranks.iter().map(|(rank, bytes)| (to_string(bytes), rank)));
            vocab
        },
        || -> Vec<(String, String)> {
            merges
                .par_iter()
                .map(|&(left, right)| (to_string(left), to_string(right)))
                .collect()
        },
    );
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
        .add_special_tokens(specials.iter().map(|&(content, _)| {
            // Matched in the raw text (before NFC) whether special or not, as tiktoken does.
            AddedToken::from(content.to_string(), !spec.text_tokens.contains(&content))
                .normalized(false)
        }))
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

/// Decodes standard base64 (with optional `=` padding), appending to `out`; false when the
/// text is not base64.
fn base64_decode_into(text: &str, out: &mut Vec<u8>) -> bool {
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
        return false;
    }
    for chunk in body.as_bytes().chunks(4) {
        let mut acc = 0u32;
        for &c in chunk {
            match value(c) {
                Some(v) => acc = (acc << 6) | v,
                None => return false,
            }
        }
        acc <<= 6 * (4 - chunk.len()) as u32;
        let n = chunk.len() * 6 / 8;
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    true
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

    fn base64_decode(text: &str) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        base64_decode_into(text, &mut out).then_some(out)
    }

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
        // All bytes, then "ab" (256), "bc" (257), "abc" (258), "cab" (259), "pqr" (260, no pair
        // of it is a token), "zw" (261), "xyzw" (262, reached as "xy" + "zw" although "xy" has
        // the higher rank 263), "xy" (263).
        let mut text = String::new();
        for b in 0..=255u8 {
            text.push_str(&format!("{} {}\n", b64(&[b]), b));
        }
        for (i, t) in ["ab", "bc", "abc", "cab", "pqr", "zw", "xyzw", "xy"]
            .iter()
            .enumerate()
        {
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
    fn merges_follow_tiktoken_merge_order() {
        let ranks = Ranks::parse(&tiny_ranks()).unwrap();
        let merges = ranks.merges().unwrap();
        let [a, b, c, w, x, y, z] = [b'a', b'b', b'c', b'w', b'x', b'y', b'z'].map(u32::from);
        // "abc": "ab" (256) beats "bc" (257) → (ab, c). "cab": "ca" is no token → (c, ab).
        // "pqr": stuck at three pieces, no merge. "xyzw": zw first, then xy → (xy, zw).
        assert_eq!(
            merges,
            vec![
                (a, b, 256),
                (b, c, 257),
                (256, c, 258),
                (c, 256, 259),
                (z, w, 261),
                (263, 261, 262),
                (x, y, 263),
            ]
        );
    }

    #[test]
    fn tiny_tokenizer_encodes_like_tiktoken() {
        let ranks = tiny_ranks();
        let tok = build_tokenizer(&TiktokenSpec {
            ranks: &ranks,
            pattern: r"\S+|\s+",
            special_tokens: &[("<|end|>", 264)],
            text_tokens: &[],
            nfc: false,
            splits: None,
        })
        .unwrap();
        let ids = |s: &str| tok.encode_fast(s, false).unwrap().get_ids().to_vec();
        let byte = |c: u8| u32::from(c);
        assert_eq!(ids("abc"), vec![258]);
        assert_eq!(ids("cab"), vec![259]);
        // a b c a b → ab, c, ab → abc, ab.
        assert_eq!(ids("abcab"), vec![258, 256]);
        assert_eq!(ids("bc<|end|>"), vec![257, 264]);
        // Unreachable by merges: only as a whole piece.
        assert_eq!(ids("pqr"), vec![260]);
        assert_eq!(
            ids("pqrp"),
            vec![byte(b'p'), byte(b'q'), byte(b'r'), byte(b'p')]
        );
        assert_eq!(ids("xyzwx"), vec![262, byte(b'x')]);
        assert_eq!(ids("abc xy"), vec![258, byte(b' '), 263]);
    }

    #[test]
    fn malformed_ranks_are_reported_with_line() {
        let err = Ranks::parse("IQ== 0\nIg== x\n").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        let err = Ranks::parse("IQ== 0\nIQ== 1\n")
            .unwrap()
            .merges()
            .unwrap_err();
        assert!(err.to_string().contains("same token"), "{err}");
        let err = Ranks::parse("IQ== 4000000000\n").unwrap_err();
        assert!(err.to_string().contains("implausibly large"), "{err}");
        let err = Ranks::parse("IQ== 0\nIg== 0\n").unwrap_err();
        assert!(err.to_string().contains("given twice"), "{err}");
        let err = Ranks::parse("IQ== 0\n").unwrap().merges().unwrap_err();
        assert!(err.to_string().contains("has no token"), "{err}");
    }
}
