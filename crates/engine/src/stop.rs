//! Stop strings over streamed text: text that could still be the start of a stop string is held back,
//! and a stop string is never emitted.

/// Holds back the tail of the generated text that could begin a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
}

/// Result of feeding text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCheck {
    /// Text safe to emit now.
    pub emit: String,
    /// The stop string that matched (generation ends; `emit` is the text before it).
    pub matched: Option<String>,
    /// Text after the match (for callers that ignore the match, e.g. before `min_tokens`).
    pub rest: String,
}

impl StopStrings {
    pub fn new(stops: &[String]) -> Self {
        StopStrings {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Adds newly decoded text.
    pub fn feed(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck {
                emit: text.to_string(),
                matched: None,
                rest: String::new(),
            };
        }
        self.held.push_str(text);
        // The earliest match wins; emitted text never holds a stop-string prefix, so a match lies in `held`.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, s)) = first {
            let emit = self.held[..pos].to_string();
            let rest = self.held[pos + s.len()..].to_string();
            let matched = Some(s.clone());
            self.held.clear();
            return StopCheck {
                emit,
                matched,
                rest,
            };
        }
        let keep = self.longest_partial_suffix();
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopCheck {
            emit,
            matched: None,
            rest: String::new(),
        }
    }

    /// Releases held-back text at the end of generation.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `held` that is a proper prefix of a stop string (and starts
    /// on a character boundary).
    fn longest_partial_suffix(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(self.held.len());
            for k in (best + 1..=max).rev() {
                let start = self.held.len() - k;
                if self.held.is_char_boundary(start)
                    && s.as_bytes().starts_with(&self.held.as_bytes()[start..])
                {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let mut s = StopStrings::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        for p in pieces {
            let c = s.feed(p);
            out.push_str(&c.emit);
            if c.matched.is_some() {
                return (out, c.matched);
            }
        }
        out.push_str(&s.flush());
        (out, None)
    }

    #[test]
    fn stop_across_pieces_is_never_emitted() {
        assert_eq!(
            run(&["STOP"], &["abc S", "TO", "P more"]),
            ("abc ".into(), Some("STOP".into()))
        );
        assert_eq!(
            run(&["\n\n"], &["line\n", "\nnext"]),
            ("line".into(), Some("\n\n".into()))
        );
    }

    #[test]
    fn partial_prefix_is_released_when_it_cannot_match() {
        assert_eq!(
            run(&["STOP"], &["ab ST", "OX", "!"]),
            ("ab STOX!".into(), None)
        );
        assert_eq!(run(&["STOP"], &["ab ST"]), ("ab ST".into(), None));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["world", "lo w"], &["hello world"]),
            ("hel".into(), Some("lo w".into()))
        );
    }

    #[test]
    fn holds_only_what_could_match() {
        let mut s = StopStrings::new(&["xyz".into()]);
        assert_eq!(s.feed("abcx").emit, "abc");
        assert_eq!(s.feed("y").emit, "");
        assert_eq!(s.feed("q").emit, "xyq");
        let mut s = StopStrings::new(&["é!".into()]);
        assert_eq!(s.feed("caf").emit, "caf");
        assert_eq!(s.feed("é").emit, "");
        assert_eq!(s.feed("?").emit, "é?");
    }
}
