#!/usr/bin/env python3
"""The built-in Qwen3.5/3.6 vocabulary in Python, token for token as the server encodes.

Built from the repository's own files: the tiktoken ranks `crates/tokenizer/data/qwen3_6.tiktoken`
(248,044 byte-level BPE tokens), the Qwen3.5 pre-tokenizer regex and the 33 special tokens from id
248,044 (`crates/tokenizer/src/builtin.rs`). Text is NFC-normalised and special tokens are matched
anywhere in the raw text, as the server's tokenizer does (`<think>`, `<tool_call>` and the other
text-like added tokens included).

(The module is not called `tokenize.py`: that name would shadow Python's standard `tokenize` module,
which torch and transformers import.)

Check it against the server:

    python3 tokenization.py check                       # the repository's tokenizer fixture
    python3 tokenization.py check --base-url http://127.0.0.1:8000   # also a running server's /tokenize
    python3 tokenization.py encode "Hello, world!"
"""

import argparse
import base64
import json
import os
import re
import sys
import unicodedata

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_RANKS = os.path.join(REPO, "crates", "tokenizer", "data", "qwen3_6.tiktoken")
DEFAULT_FIXTURE = os.path.join(REPO, "crates", "tokenizer", "tests", "fixtures", "tiktoken_corpus.json")

# crates/tokenizer/src/builtin.rs: BUILTIN_PATTERN
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_START = 248_044
VOCAB_SIZE = 248_320
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]
SPECIAL_IDS = {t: SPECIAL_START + i for i, t in enumerate(SPECIAL_TOKENS)}
ENDOFTEXT_ID = SPECIAL_IDS["<|endoftext|>"]
IM_START_ID = SPECIAL_IDS["<|im_start|>"]
IM_END_ID = SPECIAL_IDS["<|im_end|>"]
EOS_IDS = [IM_END_ID, ENDOFTEXT_ID]


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


class Tokenizer:
    """encode(text) -> ids and decode(ids) -> text with the built-in vocabulary."""

    def __init__(self, ranks_path=DEFAULT_RANKS):
        import tiktoken

        ranks = load_ranks(ranks_path)
        if len(ranks) != SPECIAL_START:
            raise ValueError(f"{ranks_path}: {len(ranks)} ranks, expected {SPECIAL_START}")
        self.enc = tiktoken.Encoding(
            name="qwen3_6",
            pat_str=PATTERN,
            mergeable_ranks=ranks,
            special_tokens=dict(SPECIAL_IDS),
        )
        self.vocab_size = VOCAB_SIZE
        self.split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    def encode(self, text):
        # Special tokens are matched in the raw text; the pieces between them are NFC-normalised.
        ids = []
        for i, piece in enumerate(self.split.split(text)):
            if i % 2:
                ids.append(SPECIAL_IDS[piece])
            elif piece:
                ids.extend(self.enc.encode_ordinary(unicodedata.normalize("NFC", piece)))
        return ids

    def decode(self, ids):
        return self.enc.decode([i for i in ids if i < SPECIAL_START + len(SPECIAL_TOKENS)])


def check(args):
    tok = Tokenizer(args.ranks)
    with open(args.fixture) as f:
        fixture = json.load(f)
    if fixture["pattern"] != PATTERN:
        print("the fixture's pattern differs from this script's", file=sys.stderr)
        return 1
    bad = 0
    for case in fixture["cases"]:
        got = tok.encode(case["text"])
        if got != case["ids"]:
            bad += 1
            if bad <= 5:
                print(f"MISMATCH {case['text'][:60]!r}: {got[:12]} vs {case['ids'][:12]}", file=sys.stderr)
    n = len(fixture["cases"])
    # The chat template's control tokens (crates/tokenizer/tests/builtin_vocab.rs).
    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>"
    ids = tok.encode(chat)
    specials_ok = (
        ids[0] == IM_START_ID
        and ids[-1] == IM_END_ID
        and SPECIAL_IDS["<think>"] in ids
        and SPECIAL_IDS["</think>"] in ids
        and tok.encode("Hello") == [9419]
        and tok.decode(ids) == chat
    )
    report = {"fixture_cases": n, "fixture_mismatches": bad, "special_tokens_ok": specials_ok}
    if args.base_url:
        import urllib.request

        texts = [c["text"] for c in fixture["cases"][:40]] + [chat]
        server_bad = 0
        for text in texts:
            req = urllib.request.Request(
                args.base_url.rstrip("/") + "/tokenize",
                data=json.dumps({"prompt": text, "add_special_tokens": False}).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                server_ids = json.load(r)["tokens"]
            if server_ids != tok.encode(text):
                server_bad += 1
        report["server_strings"] = len(texts)
        report["server_mismatches"] = server_bad
    print(json.dumps(report))
    ok = bad == 0 and specials_ok and report.get("server_mismatches", 0) == 0
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default=DEFAULT_RANKS, help="the tiktoken ranks file")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="compare with the repository's fixture (and a server's /tokenize)")
    c.add_argument("--fixture", default=DEFAULT_FIXTURE)
    c.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    e = sub.add_parser("encode", help="print the ids of TEXT")
    e.add_argument("text")
    args = p.parse_args()
    if args.cmd == "check":
        return check(args)
    print(json.dumps(Tokenizer(args.ranks).encode(args.text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
