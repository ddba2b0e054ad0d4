//! The `<think>` reasoning splitter: whole texts, tags split across deltas at every point,
//! prompts that open the block, and the implicit end at a tool call.

use sanmai_tokenizer::parsers::{prompt_opens_think, ReasoningDelta, ReasoningParser};

fn split(starts: bool, text: &str) -> (String, String) {
    let out = ReasoningParser::parse_complete(starts, text);
    (out.reasoning, out.content)
}

fn pair(reasoning: &str, content: &str) -> (String, String) {
    (reasoning.to_string(), content.to_string())
}

/// Feeds `pieces` and returns the concatenated output, checking that the reasoning never
/// follows content.
fn stream(parser: ReasoningParser, pieces: &[&str]) -> ReasoningDelta {
    let mut parser = parser;
    let mut out = ReasoningDelta::default();
    let step = |delta: ReasoningDelta, out: &mut ReasoningDelta| {
        assert!(
            delta.reasoning.is_empty() || out.content.is_empty(),
            "reasoning after content"
        );
        out.append(delta);
    };
    for piece in pieces {
        let delta = parser.feed(piece);
        step(delta, &mut out);
    }
    let delta = parser.finish();
    step(delta, &mut out);
    out
}

/// Every two-piece split and the one-char-at-a-time feed give the whole-text split.
fn check_every_split(starts: bool, text: &str) {
    let whole = ReasoningParser::parse_complete(starts, text);
    for (at, _) in text.char_indices().skip(1) {
        let out = stream(ReasoningParser::new(starts), &[&text[..at], &text[at..]]);
        assert_eq!(out, whole, "split at {at} of {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        stream(ReasoningParser::new(starts), &pieces),
        whole,
        "char by char: {text:?}"
    );
}

#[test]
fn think_block_in_the_output() {
    assert_eq!(
        split(false, "<think>\nabc\n</think>\n\nhello"),
        pair("abc", "hello")
    );
    // Inner newlines and trailing content whitespace stay.
    assert_eq!(
        split(
            false,
            "\n<think>\n\nline 1\n\nline 2\n\n</think>\n\nhello\n\nworld\n"
        ),
        pair("line 1\n\nline 2", "hello\n\nworld\n")
    );
    // An empty block (thinking switched off in an older template).
    assert_eq!(split(false, "<think>\n\n</think>\n\nhi"), pair("", "hi"));
}

#[test]
fn prompt_opened_block() {
    let prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n";
    assert!(prompt_opens_think(prompt));
    assert!(!prompt_opens_think(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ));
    assert_eq!(split(true, "abc\n</think>\n\nhello"), pair("abc", "hello"));
    // A model that repeats the opening tag.
    assert_eq!(
        split(true, "<think>\nabc</think>hello"),
        pair("abc", "hello")
    );
    // Truncated reasoning: everything is reasoning, nothing is dropped at the end.
    assert_eq!(
        split(true, "still thinking\n\n"),
        pair("still thinking\n\n", "")
    );
    assert_eq!(split(true, ""), pair("", ""));
}

#[test]
fn no_block_means_content() {
    for text in [
        "plain answer",
        "  \n answer",
        "I use </think> as text",
        "a <think> tag later is text",
    ] {
        assert_eq!(split(false, text), pair("", text));
    }
    // After the block, tags are text.
    assert_eq!(
        split(false, "<think>x</think>y<think>z</think>"),
        pair("x", "y<think>z</think>")
    );
}

#[test]
fn streaming_emits_early_and_holds_only_tags() {
    let mut parser = ReasoningParser::new(true);
    assert!(parser.in_reasoning());
    assert_eq!(parser.feed("\nabc").reasoning, "abc");
    // Newlines that would be dropped before </think> are held, so are partial tags.
    assert!(parser.feed("\n").is_empty());
    assert!(parser.feed("</thi").is_empty());
    let out = parser.feed("nk>\n\nHel");
    assert_eq!(out.reasoning, "");
    assert_eq!(out.content, "Hel");
    assert!(!parser.in_reasoning());
    assert_eq!(parser.feed("lo").content, "lo");
    assert!(parser.finish().is_empty());

    // A held newline run that turns out to be inside the reasoning comes out with what follows.
    let mut parser = ReasoningParser::new(true);
    assert_eq!(parser.feed("a\n\n").reasoning, "a");
    assert_eq!(parser.feed("b").reasoning, "\n\nb");
    assert_eq!(parser.finish(), ReasoningDelta::default());
}

#[test]
fn tags_split_at_every_point() {
    check_every_split(false, "<think>\nabc\n</think>\n\nhello");
    check_every_split(
        false,
        " \n<think>\n\n<thinking> is not a tag\n\n</think>\n\n\nhi\n",
    );
    check_every_split(true, "abc\n</think>\n\nhello </think> again");
    check_every_split(true, "<think>\n思考中… 🤔\n</think>\n\n答え🎉");
    check_every_split(true, "never closed\n\n</thin");
    check_every_split(false, "<thin");
    check_every_split(false, "no think at all, <think> later");
}

#[test]
fn tool_call_ends_an_unclosed_block() {
    let call =
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>";
    let text = format!("I should call f.\n\n{call}");
    assert_eq!(split(true, &text), pair("I should call f.", call));
    check_every_split(true, &text);
    // A mention of the tag without a function is reasoning.
    let text = "The <tool_call> tag\nwraps calls.\n</think>\n\nOK";
    assert_eq!(
        split(true, text),
        pair("The <tool_call> tag\nwraps calls.", "OK")
    );
    check_every_split(true, text);
    // Disabled: the call stays in the reasoning.
    let parser = ReasoningParser::new(true).with_implicit_tool_call_end(false);
    let out = stream(parser, &[&format!("x\n{call}")]);
    assert_eq!(out.reasoning, format!("x\n{call}"));
    assert_eq!(out.content, "");
}
