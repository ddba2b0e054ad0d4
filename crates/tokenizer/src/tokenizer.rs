//! [`Tokenizer`]: a `tokenizers` tokenizer plus what a server needs around it (end-of-sequence
//! ids, special token strings, the chat template), loaded from a Hugging Face model directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use tokenizers::AddedToken;

use crate::error::{Result, TokenizerError};
use crate::template::{ChatTemplate, RenderRequest};

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
const GENERATION_CONFIG: &str = "generation_config.json";

/// A tokenizer with its special tokens and chat template. Cloning is cheap (shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tok: tokenizers::Tokenizer,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    chat_template: Option<ChatTemplate>,
    /// Ids of `<0x00>`..`<0xFF>` byte-fallback pieces, sorted (empty without them).
    byte_piece_ids: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.vocab_size)
            .field("eos_token_ids", &self.inner.eos_token_ids)
            .field("bos_token", &self.inner.bos_token)
            .field("eos_token", &self.inner.eos_token)
            .field("chat_template", &self.inner.chat_template.is_some())
            .finish()
    }
}

/// Parts of a [`Tokenizer`] other than the `tokenizers` model itself.
#[derive(Debug, Clone, Default)]
pub struct TokenizerParts {
    /// Report at least this vocabulary size (e.g. the model's padded embedding rows).
    pub min_vocab_size: usize,
    /// Ids that end generation.
    pub eos_token_ids: Vec<u32>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    /// Wraps a `tokenizers` tokenizer.
    pub fn from_parts(tok: tokenizers::Tokenizer, parts: TokenizerParts) -> Tokenizer {
        let max_id = tok
            .get_vocab(true)
            .values()
            .copied()
            .max()
            .map_or(0, |m| m as usize + 1);
        Self::assemble(tok, parts, max_id)
    }

    /// Like [`Tokenizer::from_parts`] when the caller already knows one past the highest id.
    pub(crate) fn assemble(
        tok: tokenizers::Tokenizer,
        parts: TokenizerParts,
        id_bound: usize,
    ) -> Tokenizer {
        let vocab_size = id_bound
            .max(tok.get_vocab_size(true))
            .max(parts.min_vocab_size);
        let mut byte_piece_ids: Vec<u32> = (0..=255u8)
            .filter_map(|b| tok.token_to_id(&format!("<0x{b:02X}>")))
            .collect();
        byte_piece_ids.sort_unstable();
        Tokenizer {
            inner: Arc::new(Inner {
                tok,
                vocab_size,
                eos_token_ids: parts.eos_token_ids,
                bos_token: parts.bos_token,
                eos_token: parts.eos_token,
                pad_token: parts.pad_token,
                chat_template: parts.chat_template,
                byte_piece_ids,
            }),
        }
    }

    /// Loads a Hugging Face model directory: `tokenizer.json` (required), `tokenizer_config.json`
    /// (special tokens, added tokens, chat template), `chat_template.jinja` (wins over the
    /// config's template) and `generation_config.json` (`eos_token_id`, int or list).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        let dir = dir.as_ref();
        let tok_path = dir.join(TOKENIZER_JSON);
        let bytes = fs::read(&tok_path).map_err(|source| TokenizerError::Io {
            path: tok_path.clone(),
            source,
        })?;
        let mut tok = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TokenizerError::backend(tok_path.display().to_string(), e))?;

        let mut parts = TokenizerParts::default();
        let config_path = dir.join(TOKENIZER_CONFIG);
        let mut config_template = None;
        if let Some(config) = read_json_opt(&config_path)? {
            let file = TOKENIZER_CONFIG;
            add_config_tokens(&mut tok, &config, file)?;
            parts.bos_token = token_field(&config, "bos_token", file)?;
            parts.eos_token = token_field(&config, "eos_token", file)?;
            parts.pad_token = token_field(&config, "pad_token", file)?;
            config_template = template_field(&config, file)?;
        }
        let jinja_path = dir.join(CHAT_TEMPLATE_JINJA);
        let template_source = match fs::read_to_string(&jinja_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => config_template,
            Err(source) => {
                return Err(TokenizerError::Io {
                    path: jinja_path,
                    source,
                })
            }
        };
        if let Some(source) = template_source {
            parts.chat_template = Some(ChatTemplate::new(&source)?);
        }

        let gen_path = dir.join(GENERATION_CONFIG);
        if let Some(gen) = read_json_opt(&gen_path)? {
            parts.eos_token_ids = id_list(gen.get("eos_token_id"), GENERATION_CONFIG)?;
        }
        if let Some(eos) = &parts.eos_token {
            let id = tok.token_to_id(eos).ok_or_else(|| {
                TokenizerError::field(
                    TOKENIZER_CONFIG,
                    "eos_token",
                    format!("`{eos}` is not in the vocabulary"),
                )
            })?;
            if !parts.eos_token_ids.contains(&id) {
                parts.eos_token_ids.push(id);
            }
        }
        Ok(Self::from_parts(tok, parts))
    }

    /// Token ids of `text`. `add_special_tokens` runs the post-processor (e.g. a BOS token);
    /// special tokens written in the text are always recognised.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .tok
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::backend("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`. Ids without a token are ignored.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .tok
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::backend("decode", e))
    }

    /// Id of a token string (vocabulary form, e.g. `Ġthe` for byte-level models).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tok.token_to_id(token)
    }

    /// Token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tok.id_to_token(id)
    }

    /// Number of ids the model may produce: one past the highest id, added tokens included,
    /// at least the padded size the tokenizer was built with.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// Ids that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_token_ids
    }

    /// True when `id` is a special added token (dropped by `skip_special_tokens`).
    pub fn is_special(&self, id: u32) -> bool {
        let added = self.inner.tok.get_added_vocabulary();
        added
            .simple_id_to_token(id)
            .is_some_and(|t| added.is_special_token(&t))
    }

    /// True when `id` is a byte-fallback piece (`<0xAB>`).
    pub fn is_byte_piece(&self, id: u32) -> bool {
        self.inner.byte_piece_ids.binary_search(&id).is_ok()
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.inner.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.inner.eos_token.as_deref()
    }

    pub fn pad_token(&self) -> Option<&str> {
        self.inner.pad_token.as_deref()
    }

    /// The chat template, if the tokenizer has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.chat_template.as_ref()
    }

    /// A render request for `messages` with this tokenizer's BOS/EOS strings filled in.
    pub fn chat_request(&self, messages: Value) -> RenderRequest {
        RenderRequest {
            messages,
            bos_token: self.inner.bos_token.clone(),
            eos_token: self.inner.eos_token.clone(),
            ..RenderRequest::default()
        }
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn backend(&self) -> &tokenizers::Tokenizer {
        &self.inner.tok
    }
}

fn read_json_opt(path: &PathBuf) -> Result<Option<Value>> {
    match fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| TokenizerError::Json {
                    path: path.clone(),
                    source,
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.clone(),
            source,
        }),
    }
}

/// A special-token field: a string, `{"content": ...}` or null/absent.
fn token_field(config: &Value, field: &str, file: &str) -> Result<Option<String>> {
    match config.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(map)) => match map.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(TokenizerError::field(
                file,
                field,
                "object without a string `content`",
            )),
        },
        Some(_) => Err(TokenizerError::field(
            file,
            field,
            "expected a string or an object with `content`",
        )),
    }
}

/// `chat_template`: a string, or a list of `{name, template}` (the one named `default`, else
/// the first).
fn template_field(config: &Value, file: &str) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            let chosen = named("default").or_else(|| list.first());
            match chosen
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
            {
                Some(s) => Ok(Some(s.to_string())),
                None if list.is_empty() => Ok(None),
                None => Err(TokenizerError::field(
                    file,
                    "chat_template",
                    "list entries need a string `template`",
                )),
            }
        }
        Some(_) => Err(TokenizerError::field(
            file,
            "chat_template",
            "expected a string or a list of {name, template}",
        )),
    }
}

/// Adds the `added_tokens_decoder` entries that `tokenizer.json` lacks, checking their ids.
fn add_config_tokens(tok: &mut tokenizers::Tokenizer, config: &Value, file: &str) -> Result<()> {
    let Some(decoder) = config.get("added_tokens_decoder") else {
        return Ok(());
    };
    let Some(map) = decoder.as_object() else {
        return Err(TokenizerError::field(
            file,
            "added_tokens_decoder",
            "expected an object of id → token",
        ));
    };
    let mut entries = Vec::with_capacity(map.len());
    for (key, entry) in map {
        let field = format!("added_tokens_decoder.{key}");
        let id: u32 = key
            .parse()
            .map_err(|_| TokenizerError::field(file, &field, "key is not a token id"))?;
        let content = entry
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| TokenizerError::field(file, &field, "missing string `content`"))?;
        let special = entry
            .get("special")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        entries.push((id, content.to_string(), special, field));
    }
    entries.sort_by_key(|e| e.0);
    for (id, content, special, field) in entries {
        match tok.token_to_id(&content) {
            Some(have) if have == id => {}
            Some(have) => {
                return Err(TokenizerError::field(
                    file,
                    field,
                    format!("`{content}` has id {have} in {TOKENIZER_JSON}"),
                ))
            }
            None => {
                let token = AddedToken::from(content.clone(), special);
                let added = if special {
                    tok.add_special_tokens([token])
                } else {
                    tok.add_tokens([token])
                };
                added.map_err(|e| TokenizerError::backend(format!("{file}: {field}"), e))?;
                let got = tok.token_to_id(&content);
                if got != Some(id) {
                    return Err(TokenizerError::field(
                        file,
                        field,
                        format!("`{content}` would get id {got:?}, not {id}"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// An id or a list of ids (null/absent: none).
fn id_list(value: Option<&Value>, file: &str) -> Result<Vec<u32>> {
    let bad = || TokenizerError::field(file, "eos_token_id", "expected an id or a list of ids");
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(bad)
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}
