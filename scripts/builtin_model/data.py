#!/usr/bin/env python3
"""Seeded generator of short chat exchanges for training the built-in model, rendered with the
repository's Qwen3.5 chat template exactly as the server renders them, and packed into token arrays.

Task kinds (tasks.py): greeting, arithmetic (add / subtract numbers up to 50), counting (to N, from A
to B), echo (a word or a few words), reverse (the order of a few words), table (a one-line table of
ages, scores or home cities in the prompt, then a question), tool_call (pick the tool of the request's
`tools` and fill its arguments from the user's words, Qwen3.5 XML tool-call format), tool_result (the
final answer after a tool's result). Training also has `other`: requests none of the kinds serves,
declined in one sentence. Requests come alone, after a system prompt or an earlier turn, or inside
an agent-like context (context.py: a long system prompt and many tools the request does not need).
About half of the exchanges have thinking on (the template's default: the reply opens with a short
`<think>` block), the other half send `enable_thinking: false`; every reply ends with `<|im_end|>`.

Held out (tasks.py): an eval exchange's values never occur as that kind's values in training, and
half of the eval exchanges also use a phrasing training never saw.

Rendering uses jinja2 on `crates/tokenizer/data/qwen3_5_chat_template.jinja` with the variables the
server passes (crates/tokenizer/src/template/mod.rs): messages, tools (None without tools),
documents=None, add_generation_prompt, eos_token="<|im_end|>", and `chat_template_kwargs`
(`enable_thinking`), with trim_blocks / lstrip_blocks and a `tojson` that is Python's json.dumps.

    python3 data.py --split train --n 5 --seed 0        # print rendered examples
    python3 data.py --split eval --n 3 --json           # the requests the evaluation sends
    python3 data.py --pack train.npz --n 200000 --seed 0   # token ids and reply masks for train.py
"""

import argparse
import json
import lzma
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
DEFAULT_TEMPLATE = os.path.join(REPO, "crates", "tokenizer", "data", "qwen3_5_chat_template.jinja")

import context  # noqa: E402
import tasks  # noqa: E402
from tasks import KINDS  # noqa: E402,F401

TRAIN_KINDS = KINDS + ["other"]
MIX = dict(tasks.MIX, other=0.6)

# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


class TemplateError(Exception):
    pass


class Renderer:
    """The chat template rendered as the server renders it."""

    def __init__(self, template_path=DEFAULT_TEMPLATE):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        with open(template_path) as f:
            self.template = env.from_string(f.read())

    def render(self, messages, tools=None, add_generation_prompt=False, enable_thinking=None):
        kwargs = {}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        return self.template.render(
            messages=messages,
            tools=tools or None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            eos_token="<|im_end|>",
            **kwargs,
        )

    def prompt_and_completion(self, ex):
        """(prompt text the server builds for the request, the reply the model should produce).

        The reply ends with `<|im_end|>` (the template's newline after it is not part of it)."""
        think = ex["enable_thinking"]
        prompt = self.render(ex["messages"], ex.get("tools"), True, None if think else False)
        full = self.render(ex["messages"] + [ex["reply"]], ex.get("tools"), False, None if think else False)
        if not full.startswith(prompt):
            raise TemplateError("the rendered conversation does not extend the generation prompt")
        completion = full[len(prompt):]
        if completion.endswith("<|im_end|>\n"):
            completion = completion[:-1]
        if not completion.endswith("<|im_end|>"):
            raise TemplateError(f"the reply does not end with <|im_end|>: {completion[-30:]!r}")
        return prompt, completion


# --------------------------------------------------------------------------------------------------
# Exchanges
# --------------------------------------------------------------------------------------------------


def make_example(rng, kind, split, thinking=None):
    """One exchange: the request's messages / tools / enable_thinking, the reply, and its check."""
    ph = tasks.Phrasing(rng, split)
    if kind == "other":
        messages, tools, reply, reasoning, check = context.other_request(rng)
    else:
        messages, tools, reply, reasoning, check = tasks.TASKS[kind](rng, split, ph)
    if thinking is None:
        thinking = rng.random() < 0.5
    if not isinstance(reply, dict):
        reply = {"role": "assistant", "content": reply}
    reply = dict(reply)
    reply["reasoning_content"] = reasoning if thinking else ""
    if messages[-1]["role"] == "user":
        messages, tools = context.surround(rng, kind, messages, tools)
    return {
        "kind": kind,
        "messages": messages,
        "tools": tools,
        "enable_thinking": thinking,
        "reply": reply,
        "check": check,
        "held_out_phrasing": ph.held,
    }


def generate(split, n, seed, kinds=None):
    """`n` examples of `split` ("train" or "eval"), mixed by MIX (train) or round-robin (eval)."""
    rng = random.Random(f"{split}:{seed}")
    kinds = kinds or (TRAIN_KINDS if split == "train" else KINDS)
    out = []
    for i in range(n):
        if split == "eval":
            kind = kinds[i % len(kinds)]
        else:
            kind = rng.choices(kinds, weights=[MIX[k] for k in kinds])[0]
        out.append(make_example(rng, kind, split))
    return out


def _tokenize(args):
    """The (prompt, completion) token ids of `examples` rendered with `template` (a worker's share)."""
    from tokenization import Tokenizer

    examples, template = args
    tok, renderer = Tokenizer(), Renderer(template)
    return [tuple(map(tok.encode, renderer.prompt_and_completion(ex))) for ex in examples]


def _compress(raw):
    return lzma.compress(raw, preset=6)


def pack(path, n, seed, max_len, template, workers=1):
    """Renders and tokenizes `n` training exchanges into `path` (.npz): `ids_xz` (all exchanges' tokens,
    int32, one after the other, LZMA-compressed; `load_ids` reads them), `offsets` (where each starts; one more than exchanges), `reply_start`
    (each exchange's first reply token, relative to its start), `kind` (index into `kinds`).
    With `workers` > 1 the rendering, tokenizing and compression run in that many processes: the same
    exchanges and token ids (the examples are drawn in one sequence either way), the ids compressed as
    consecutive LZMA streams, which `load_ids` reads alike."""
    import multiprocessing
    import numpy as np

    from tokenization import IM_END_ID

    examples = generate("train", n, seed)
    if workers > 1:
        share = -(-len(examples) // (4 * workers))
        parts = [(examples[i:i + share], template) for i in range(0, len(examples), share)]
        pool = multiprocessing.get_context("spawn").Pool(workers)
        tokenized = [pc for part in pool.map(_tokenize, parts) for pc in part]
    else:
        pool, tokenized = None, _tokenize((examples, template))
    ids, offsets, starts, kind_ix, skipped = [], [0], [], [], 0
    for ex, (p, c) in zip(examples, tokenized):
        if c[-1] != IM_END_ID:
            raise RuntimeError("a reply does not end with <|im_end|>")
        if len(p) + len(c) > max_len:
            skipped += 1
            continue
        ids.extend(p + c)
        offsets.append(len(ids))
        starts.append(len(p))
        kind_ix.append(TRAIN_KINDS.index(ex["kind"]))
    # The token ids LZMA-compressed (a third of zlib's size: the contexts repeat a lot).
    raw = np.asarray(ids, np.int32).tobytes()
    if pool is None:
        xz = np.frombuffer(_compress(raw), np.uint8)
    else:
        step = -(-len(raw) // (4 * workers * 4)) * 4
        with pool:
            streams = pool.map(_compress, [raw[i:i + step] for i in range(0, len(raw), step)])
        xz = np.frombuffer(b"".join(streams), np.uint8)
    np.savez_compressed(path, ids_xz=xz, offsets=np.asarray(offsets, np.int64),
                        reply_start=np.asarray(starts, np.int32), kind=np.asarray(kind_ix, np.int8),
                        kinds=np.asarray(TRAIN_KINDS), seed=np.asarray(seed))
    return {"exchanges": len(starts), "tokens": len(ids), "skipped": skipped, "bytes": os.path.getsize(path)}


def load_ids(d):
    """The token ids of a loaded pack (`ids_xz`, or `ids` in older packs)."""
    import numpy as np

    if "ids_xz" in d:
        return np.frombuffer(lzma.decompress(d["ids_xz"].tobytes()), np.int32)
    return d["ids"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=["train", "eval"], default="train")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--template", default=DEFAULT_TEMPLATE)
    p.add_argument("--json", action="store_true", help="print the examples as JSON lines")
    p.add_argument("--pack", default=None, help="write --n training exchanges as token arrays (.npz) here")
    p.add_argument("--max-len", type=int, default=4096, help="with --pack: longer exchanges are left out")
    p.add_argument("--workers", type=int, default=1, help="with --pack: processes that render, tokenize "
                   "and compress (the same exchanges and ids; the compressed bytes differ from one's)")
    args = p.parse_args()
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.pack:
        print(json.dumps(pack(args.pack, args.n, args.seed, args.max_len, args.template, args.workers)))
        return 0
    r = Renderer(args.template)
    for ex in generate(args.split, args.n, args.seed):
        prompt, completion = r.prompt_and_completion(ex)
        if args.json:
            print(json.dumps(dict(ex, prompt=prompt, completion=completion)))
        else:
            print(f"===== {ex['kind']} (thinking {'on' if ex['enable_thinking'] else 'off'})")
            print(prompt + "|||" + completion)
    return 0


if __name__ == "__main__":
    sys.exit(main())
