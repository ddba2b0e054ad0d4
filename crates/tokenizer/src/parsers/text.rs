//! Small string helpers shared by the streaming parsers: whitespace runs, partial-tag detection
//! and "does the text at this position start with a tag, could it still, or can it not".

/// The opening tag of a tool call, shared by the XML and JSON formats.
pub(crate) const TOOL_OPEN: &str = "<tool_call>";
/// The closing tag of a tool call.
pub(crate) const TOOL_CLOSE: &str = "</tool_call>";

/// ASCII whitespace as the model emits it between tags.
pub(crate) fn is_ws(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// The first position at or after `from` that is not ASCII whitespace (or `s.len()`).
pub(crate) fn skip_ws(s: &str, from: usize) -> usize {
    from + s[from..].len() - s[from..].trim_start_matches(is_ws).len()
}

/// The start of the run of characters matching `pred` that ends at `end`.
pub(crate) fn run_start(s: &str, end: usize, pred: impl Fn(char) -> bool) -> usize {
    s[..end].trim_end_matches(pred).len()
}

/// The start of the longest suffix of `s` that is a proper, non-empty prefix of `tag`, or
/// `s.len()` when there is none. Text from there on might still become `tag`.
pub(crate) fn partial_tag_start(s: &str, tag: &str) -> usize {
    let longest = tag.len().saturating_sub(1).min(s.len());
    for n in (1..=longest).rev() {
        let start = s.len() - n;
        if s.is_char_boundary(start) && tag.starts_with(&s[start..]) {
            return start;
        }
    }
    s.len()
}

/// What the text from some position says about a tag expected there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// The text starts with the tag.
    Match,
    /// The text is a proper prefix of the tag (possibly empty): more text is needed.
    Partial,
    /// The text cannot start with the tag.
    Mismatch,
}

/// Whether `rest` starts with `tag`.
pub(crate) fn expect(rest: &str, tag: &str) -> Expect {
    if rest.starts_with(tag) {
        Expect::Match
    } else if tag.starts_with(rest) {
        Expect::Partial
    } else {
        Expect::Mismatch
    }
}

/// The largest char boundary of `s` at or below `at`.
pub(crate) fn floor_boundary(s: &str, mut at: usize) -> usize {
    at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_tags_and_whitespace() {
        assert_eq!(partial_tag_start("abc<tool", TOOL_OPEN), 3);
        assert_eq!(partial_tag_start("abc<", TOOL_OPEN), 3);
        assert_eq!(partial_tag_start("abc", TOOL_OPEN), 3);
        // A whole tag is not a partial one.
        assert_eq!(partial_tag_start("<tool_call>", TOOL_OPEN), 11);
        assert_eq!(partial_tag_start("é<t", TOOL_OPEN), "é".len());
        assert_eq!(skip_ws("a \n\tb", 1), 4);
        assert_eq!(run_start("ab\n\n", 4, is_ws), 2);
        assert_eq!(expect("<fun", "<function="), Expect::Partial);
        assert_eq!(expect("", "<function="), Expect::Partial);
        assert_eq!(expect("<function=f>", "<function="), Expect::Match);
        assert_eq!(expect("<fx", "<function="), Expect::Mismatch);
        assert_eq!(floor_boundary("aé", 2), 1);
    }
}
