#!/usr/bin/env python3
"""Score a served model on the held-out exchanges of every task kind.

    python3 eval.py MODEL_DIR --base-url http://127.0.0.1:8000 [--n-per-kind 25] [--out FILE]

Sends `data.py`'s eval split (values and phrasings training never saw; half with thinking on, half
off, through `chat_template_kwargs: {"enable_thinking": ...}`) to the server's /v1/chat/completions at
temperature 0 and prints, as JSON, the share answered correctly per task kind:
  greeting     a greeting reply (starts with Hello / Hi)
  arithmetic, table (ages, scores)   the last number of the reply is the answer
  table (cities)                     the last word of the reply is the answer
  counting, echo, reverse            the reply is exactly the answer (a final period allowed)
  tool_call    exactly one tool call, the right tool, arguments equal to the expected ones
  tool_result  the reply carries the tool result's values
`reasoning_content` is not scored; `content` and `tool_calls` are.

MODEL_DIR is the training output: its training.json gives the data seed (the eval split is drawn
from a different seed stream than training, and its held-out values never occur in training).
Unless --no-render-check is given, each request's prompt is also sent to the server's /tokenize and
compared with this directory's rendering and tokenization (`render_mismatches` in the report): the
training text is what the server builds.
"""

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import data  # noqa: E402
from tokenization import Tokenizer  # noqa: E402


def post(base, path, body, timeout):
    req = urllib.request.Request(
        base.rstrip("/") + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def get(base, path, timeout):
    with urllib.request.urlopen(base.rstrip("/") + path, timeout=timeout) as r:
        return json.load(r)


def openai_messages(messages):
    """The messages as an OpenAI client sends them (tool-call arguments as JSON strings, with ids)."""
    out = []
    n = 0
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                n += 1
                calls.append({"id": f"call_{n}", "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"]["arguments"])}})
            m["tool_calls"] = calls
        if m["role"] == "tool":
            m.setdefault("tool_call_id", f"call_{n}")
        out.append(m)
    return out


NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def score(check, message):
    content = (message.get("content") or "").strip()
    calls = message.get("tool_calls") or []
    t = check["type"]
    if t == "tool_call":
        if len(calls) != 1:
            return False
        f = calls[0].get("function", {})
        try:
            args = json.loads(f.get("arguments") or "{}")
        except json.JSONDecodeError:
            return False
        return f.get("name") == check["name"] and args == check["arguments"]
    if calls:
        return False
    if t == "greeting":
        return bool(re.match(r"(hello|hi)\b", content, re.I))
    if t == "number":
        nums = NUM_RE.findall(content)
        return bool(nums) and float(nums[-1]) == float(check["answer"])
    if t == "exact":
        return content.rstrip(".") == str(check["answer"])
    if t == "word":
        words = content.rstrip(".").split()
        return bool(words) and words[-1] == str(check["answer"])
    if t == "contains":
        return all(s in content for s in check["answer"])
    raise ValueError(t)


TOOL_CALL_RE = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
PARAM_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_completion(text, tools, thinking):
    """A generated reply as the server answers it: reasoning split off at `</think>` (with thinking on),
    Qwen3.5 XML tool calls parsed into OpenAI tool calls (arguments converted by the tool's schema)."""
    text = text.split("<|im_end|>")[0].split("<|endoftext|>")[0]
    reasoning = None
    if thinking and "</think>" in text:
        reasoning, text = text.split("</think>", 1)
    elif "</think>" in text:
        text = text.split("</think>", 1)[1]
    calls = []
    schemas = {t["function"]["name"]: t["function"]["parameters"].get("properties", {}) for t in tools or []}
    for m in TOOL_CALL_RE.finditer(text):
        name = m.group(1).strip()
        args = {}
        for pm in PARAM_RE.finditer(m.group(2)):
            key, val = pm.group(1).strip(), pm.group(2)
            kind = schemas.get(name, {}).get(key, {}).get("type")
            if kind in ("integer", "number"):
                try:
                    val = json.loads(val)
                except json.JSONDecodeError:
                    pass
            args[key] = val
        calls.append({"type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
    if calls:
        text = text[: text.index("<tool_call>")]
    return {"content": text.strip(), "reasoning_content": reasoning, "tool_calls": calls or None}


def pack_prompts(path, examples):
    """The held-out prompts as token ids (.npz: `ids`, `offsets`), for generation where no server runs."""
    import numpy as np

    renderer, tok = data.Renderer(), Tokenizer()
    ids, offsets = [], [0]
    for ex in examples:
        prompt, _ = renderer.prompt_and_completion(ex)
        ids.extend(tok.encode(prompt))
        offsets.append(len(ids))
    np.savez_compressed(path, ids=np.asarray(ids, np.int32), offsets=np.asarray(offsets, np.int64))


def report_of(examples, answers, model, seed, seconds, render=(0, 0)):
    """The per-kind report of (example, (message, finish_reason)) pairs."""
    kinds = list(dict.fromkeys(ex["kind"] for ex in examples))
    per_kind = {k: {"correct": 0, "total": 0} for k in kinds}
    by_mode = {"thinking_on": [0, 0], "thinking_off": [0, 0],
               "held_out_phrasing": [0, 0], "training_phrasing": [0, 0]}
    records, failures = [], {}
    for ex, (msg, finish) in zip(examples, answers):
        ok = score(ex["check"], msg)
        k = ex["kind"]
        per_kind[k]["total"] += 1
        per_kind[k]["correct"] += int(ok)
        for mode in ("thinking_on" if ex["enable_thinking"] else "thinking_off",
                     "held_out_phrasing" if ex["held_out_phrasing"] else "training_phrasing"):
            by_mode[mode][0] += int(ok)
            by_mode[mode][1] += 1
        rec = {"kind": k, "thinking": ex["enable_thinking"], "ok": ok,
               "held_out_phrasing": ex["held_out_phrasing"],
               "request": ex["messages"][-1]["content"], "expected": ex["check"],
               "content": msg.get("content"), "reasoning_content": msg.get("reasoning_content"),
               "tool_calls": msg.get("tool_calls"), "finish_reason": finish}
        records.append(rec)
        if not ok and k not in failures:
            failures[k] = rec
    total = sum(v["total"] for v in per_kind.values())
    correct = sum(v["correct"] for v in per_kind.values())
    for v in per_kind.values():
        v["share"] = round(v["correct"] / v["total"], 4) if v["total"] else None
    report = {
        "model": model,
        "seed": seed,
        "n": total,
        "overall": round(correct / total, 4) if total else None,
        "per_kind": {k: v["share"] for k, v in per_kind.items()},
        "min_kind": min(v["share"] for v in per_kind.values()) if per_kind else None,
        "counts": per_kind,
        **{k: round(c / max(1, n), 4) for k, (c, n) in by_mode.items()},
        "stopped": sum(1 for r in records if r["finish_reason"] in ("stop", "tool_calls")),
        "render_checked": render[0],
        "render_mismatches": render[1],
        "seconds": seconds,
        "first_failure_per_kind": failures,
    }
    return report, records


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="the training output (its training.json gives the data seed)")
    p.add_argument("--base-url", default=None, help="the server to score")
    p.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    p.add_argument("--n-per-kind", type=int, default=25)
    p.add_argument("--kinds", default=",".join(data.KINDS))
    p.add_argument("--seed", type=int, default=None, help="eval draw seed (default: training.json's)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--no-render-check", action="store_true")
    p.add_argument("--pack-prompts", default=None, help="write the held-out prompts' token ids here (.npz) "
                   "for `train.py --eval-prompts`, and exit")
    p.add_argument("--score-generated", default=None, help="score train.py's generated.json instead of a server")
    p.add_argument("--min-share", type=float, default=None, help="exit 1 when a kind scores below this")
    p.add_argument("--require-stop", action="store_true", help="exit 1 unless every reply ended by itself "
                   "(finish_reason stop or tool_calls) and the rendering matched the server's")
    p.add_argument("--out", default=None, help="also write the report (with every reply) here")
    args = p.parse_args()

    seed = args.seed
    info_path = os.path.join(args.model_dir, "training.json")
    if seed is None:
        seed = 0
        if os.path.exists(info_path):
            with open(info_path) as f:
                seed = json.load(f).get("data_seed", 0)
    kinds = args.kinds.split(",")
    examples = data.generate("eval", args.n_per_kind * len(kinds), seed, kinds)
    if args.pack_prompts:
        pack_prompts(args.pack_prompts, examples)
        return 0
    start = time.time()
    render = (0, 0)
    if args.score_generated:
        with open(args.score_generated) as f:
            generated = json.load(f)["generated"]
        if len(generated) != len(examples):
            raise SystemExit(f"{args.score_generated}: {len(generated)} replies for {len(examples)} prompts")
        tok = Tokenizer()
        answers = []
        for ex, ids in zip(examples, generated):
            msg = parse_completion(tok.decode(ids), ex["tools"], ex["enable_thinking"])
            stopped = bool(ids) and ids[-1] in (248046, 248044)
            answers.append((msg, ("tool_calls" if msg["tool_calls"] else "stop") if stopped else "length"))
        model = os.path.basename(os.path.abspath(args.model_dir))
    else:
        if not args.base_url:
            raise SystemExit("give --base-url (a running server) or --score-generated FILE")
        model = args.model or get(args.base_url, "/v1/models", args.timeout)["data"][0]["id"]
        answers, render = ask_server(args, model, examples)
    report, records = report_of(examples, answers, model, seed, round(time.time() - start, 1), render)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(report, replies=records), f, indent=2)
            f.write("\n")
    if args.min_share is not None and (report["min_kind"] is None or report["min_kind"] < args.min_share
                                       or report["render_mismatches"]):
        print(f"FAIL: a kind scored below {args.min_share} (or the rendering differs)", file=sys.stderr)
        return 1
    if args.require_stop and (report["stopped"] != report["n"] or report["render_mismatches"]):
        print(f"FAIL: {report['n'] - report['stopped']} replies did not end by themselves, "
              f"{report['render_mismatches']} renderings differ", file=sys.stderr)
        return 1
    return 0


def ask_server(args, model, examples):
    """Each example's request to the server: (message, finish_reason) answers, and the render check's
    (checked, mismatches)."""
    renderer = None if args.no_render_check else data.Renderer()
    tok = None if args.no_render_check else Tokenizer()
    checked = bad = 0
    answers = []
    for ex in examples:
        body = {
            "model": model,
            "messages": openai_messages(ex["messages"]),
            "temperature": 0,
            "max_tokens": args.max_tokens,
        }
        if ex["tools"]:
            body["tools"] = ex["tools"]
        # Explicit either way: a server may default to either (the built-in model's to off).
        body["chat_template_kwargs"] = {"enable_thinking": ex["enable_thinking"]}
        if renderer is not None:
            prompt, _ = renderer.prompt_and_completion(ex)
            tk = {k: body[k] for k in ("messages", "tools", "chat_template_kwargs") if k in body}
            server_ids = post(args.base_url, "/tokenize", dict(tk, model=model, add_generation_prompt=True),
                              args.timeout)["tokens"]
            checked += 1
            if server_ids != tok.encode(prompt):
                bad += 1
        resp = post(args.base_url, "/v1/chat/completions", body, args.timeout)
        choice = resp["choices"][0]
        answers.append((choice["message"], choice.get("finish_reason")))
    return answers, (checked, bad)


if __name__ == "__main__":
    sys.exit(main())
