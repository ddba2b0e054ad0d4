//! Tool-call ids: `call_` followed by 24 ASCII letters and digits.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
const ID_CHARS: usize = 24;

/// Source of tool-call ids for one parser: a seeded generator (deterministic, for tests and
/// reproducible runs), a randomly seeded one, or any closure.
pub struct ToolCallIds {
    source: Source,
}

enum Source {
    Seeded(u64),
    Custom(Box<dyn FnMut() -> String + Send>),
}

impl ToolCallIds {
    /// Ids from a fixed seed: the same seed gives the same sequence.
    pub fn seeded(seed: u64) -> Self {
        ToolCallIds {
            source: Source::Seeded(seed),
        }
    }

    /// Ids from a seed drawn from the process's hash randomness, the clock and a counter, so
    /// that parsers created one after another produce different ids. Not for security.
    pub fn random() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        hasher.write_u128(nanos);
        Self::seeded(hasher.finish())
    }

    /// Ids from a closure (called once per tool call, in order).
    pub fn from_fn(f: impl FnMut() -> String + Send + 'static) -> Self {
        ToolCallIds {
            source: Source::Custom(Box::new(f)),
        }
    }

    /// The next id.
    pub fn next_id(&mut self) -> String {
        match &mut self.source {
            Source::Seeded(state) => {
                let mut id = String::with_capacity(5 + ID_CHARS);
                id.push_str("call_");
                for _ in 0..ID_CHARS {
                    let r = splitmix64(state);
                    id.push(ALPHABET[(r % ALPHABET.len() as u64) as usize] as char);
                }
                id
            }
            Source::Custom(f) => f(),
        }
    }
}

impl Default for ToolCallIds {
    fn default() -> Self {
        Self::random()
    }
}

impl fmt::Debug for ToolCallIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source {
            Source::Seeded(_) => f.write_str("ToolCallIds::Seeded"),
            Source::Custom(_) => f.write_str("ToolCallIds::Custom"),
        }
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_the_openai_shape_and_are_reproducible() {
        let mut a = ToolCallIds::seeded(7);
        let mut b = ToolCallIds::seeded(7);
        let first = a.next_id();
        assert_eq!(first, b.next_id());
        assert_ne!(first, a.next_id());
        assert_eq!(first.len(), 29);
        assert!(first.starts_with("call_"));
        assert!(first[5..].bytes().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(
            ToolCallIds::random().next_id(),
            ToolCallIds::random().next_id()
        );
        let mut n = 0;
        let mut custom = ToolCallIds::from_fn(move || {
            n += 1;
            format!("id{n}")
        });
        assert_eq!(custom.next_id(), "id1");
        assert_eq!(custom.next_id(), "id2");
    }
}
