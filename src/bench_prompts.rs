//! The prompts of `sanmai bench serve`: random words tokenized by the server and cut to an exact
//! length, random token ids for a model served without a tokenizer, or text; and the request body
//! that carries one.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use clap::ValueEnum;

/// Words of the random prompts: common, so most are one token in a byte-level BPE vocabulary.
#[rustfmt::skip]
const WORDS: &[&str] = &[
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
    "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case",
    "week", "company", "system", "program", "question", "work", "government", "number", "night",
    "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot",
    "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head",
    "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law",
    "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body",
    "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person",
    "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl",
    "guy", "moment", "air", "teacher", "force", "education", "good", "new", "first", "last", "long",
    "great", "little", "own", "other", "old", "big", "high", "different", "small", "large", "next",
    "early", "young", "important", "few", "public", "bad", "same", "able", "go", "make", "know", "take",
    "see", "come", "think", "look", "want", "give", "use", "find", "tell", "ask", "seem", "feel", "try",
    "leave", "call", "keep", "let", "begin", "help", "talk", "turn", "start", "show", "hear", "play",
    "run", "move", "like", "live", "believe", "hold", "bring", "happen", "write", "provide", "sit",
    "stand", "lose", "pay", "meet", "include", "continue", "set", "learn", "lead", "understand",
    "watch", "follow", "stop", "create", "speak", "read", "allow", "add", "spend", "grow", "open",
    "walk", "win", "offer", "remember", "love", "consider", "appear", "buy", "wait", "serve", "die",
    "send", "expect", "build", "stay", "fall", "cut", "reach", "kill", "remain", "river", "stone",
    "cloud", "green", "quiet", "bright", "north", "south", "paper", "glass", "music", "window",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `/v1/completions` (token-id prompts of exact length when the server can tokenize).
    Completions,
    /// `/v1/chat/completions` with one user message.
    Chat,
}

impl Endpoint {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// What every request of a run asks for.
pub(crate) struct PromptSpec {
    pub(crate) endpoint: Endpoint,
    pub(crate) prompt_len: usize,
    pub(crate) gen_len: usize,
    pub(crate) temperature: f64,
}

/// A small deterministic generator (SplitMix64) for prompts and arrival times.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn words(&mut self, n: usize) -> String {
        let mut s = String::with_capacity(n * 7);
        for i in 0..n {
            if i > 0 {
                s.push(' ');
            }
            s.push_str(WORDS[(self.next_u64() % WORDS.len() as u64) as usize]);
        }
        s
    }
}

/// One request's prompt as sent.
#[derive(Debug, Clone)]
pub(crate) enum Prompt {
    Ids(Vec<u32>),
    /// Token ids for a model served without a tokenizer: its streamed chunks carry no text, so the
    /// request asks for the sampled tokens' log-probabilities, which mark each token's arrival.
    BareIds(Vec<u32>),
    Text(String),
}

/// What `/tokenize` answered.
pub(crate) enum Tokenized {
    Ids(Vec<u32>),
    /// The server has no such route.
    NoRoute,
    /// The server serves a model without a tokenizer (token-id prompts only).
    NoTokenizer,
}

/// Token ids a tokenizer-less model's prompts are drawn from: ids every vocabulary holds (the
/// smallest, the test fixtures', has 1,024).
const RANDOM_IDS: std::ops::Range<u64> = 1..1000;

/// Random words of about `spec.prompt_len` tokens, to be tokenized by the server.
pub(crate) fn prompt_words(spec: &PromptSpec, rng: &mut Rng) -> String {
    // Words run a little over one token each: 1.25 words per token leaves room to cut.
    rng.words(spec.prompt_len + spec.prompt_len / 4 + 8)
}

/// One prompt from its words and what the server's tokenizer made of them: exact token ids when it
/// tokenizes (`exact` stays true), else text of about one token per word (`exact` turns false, and
/// stays so for the rest of the run).
pub(crate) fn make_prompt(
    spec: &PromptSpec,
    rng: &mut Rng,
    text: String,
    tokenized: Tokenized,
    exact: &mut bool,
) -> Result<Prompt> {
    let n = spec.prompt_len;
    Ok(match (*exact, tokenized) {
        (true, Tokenized::NoTokenizer) => match spec.endpoint {
            Endpoint::Completions => Prompt::BareIds(
                (0..n)
                    .map(|_| {
                        let span = RANDOM_IDS.end - RANDOM_IDS.start;
                        (RANDOM_IDS.start + rng.next_u64() % span) as u32
                    })
                    .collect(),
            ),
            Endpoint::Chat => {
                bail!("the server's model has no tokenizer: use --endpoint completions")
            }
        },
        (true, Tokenized::Ids(ids)) if ids.len() >= n => match spec.endpoint {
            Endpoint::Completions => Prompt::Ids(ids[..n].to_vec()),
            Endpoint::Chat => {
                // As many words as make about prompt_len tokens at this text's ratio.
                let n_words = text.split(' ').count();
                let keep = (n * n_words).div_ceil(ids.len()).max(1);
                Prompt::Text(text.split(' ').take(keep).collect::<Vec<_>>().join(" "))
            }
        },
        _ => {
            *exact = false;
            Prompt::Text(text.split(' ').take(n).collect::<Vec<_>>().join(" "))
        }
    })
}

pub(crate) fn request_body(spec: &PromptSpec, model: &str, prompt: &Prompt) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": spec.gen_len,
        "ignore_eos": true,
        "temperature": spec.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let prompt = match prompt {
        Prompt::Ids(ids) => json!(ids),
        Prompt::BareIds(ids) => {
            body["logprobs"] = json!(0);
            json!(ids)
        }
        Prompt::Text(s) => json!(s),
    };
    match spec.endpoint {
        Endpoint::Completions => body["prompt"] = prompt,
        // Chat prompts are always text (see `make_prompt`).
        Endpoint::Chat => body["messages"] = json!([{"role": "user", "content": prompt}]),
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_words_and_units() {
        let mut a = Rng(7);
        let mut b = Rng(7);
        let w = a.words(50);
        assert_eq!(w, b.words(50));
        assert_eq!(w.split(' ').count(), 50);
        assert!(w.split(' ').all(|x| WORDS.contains(&x)));
        assert_ne!(w, Rng(8).words(50));
        let u: Vec<f64> = (0..1000).map(|_| a.unit()).collect();
        assert!(u.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = u.iter().sum::<f64>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05, "{mean}");
    }
}
