#!/usr/bin/env python3
"""Score a served model on the held-out exchanges of every task kind.

    python3 eval.py MODEL_DIR --base-url http://127.0.0.1:8000 [--n-per-kind 25] [--out FILE]

Sends `data.py`'s eval split (values and phrasings training never saw; half with thinking on, half
with `chat_template_kwargs: {"enable_thinking": false}`) to the server's /v1/chat/completions at
temperature 0 and prints, as JSON, the share answered correctly per task kind:
  greeting     a greeting reply (starts with Hello / Hi)
  arithmetic, counting (letters), table   the last number of the reply is the answer
  counting (to N), echo, reverse          the reply is exactly the answer (a final period allowed)
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
    if t == "contains":
        return all(s in content for s in check["answer"])
    raise ValueError(t)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    p.add_argument("--n-per-kind", type=int, default=25)
    p.add_argument("--kinds", default=",".join(data.KINDS))
    p.add_argument("--seed", type=int, default=None, help="eval draw seed (default: training.json's)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--no-render-check", action="store_true")
    p.add_argument("--out", default=None, help="also write the report (with every reply) here")
    args = p.parse_args()

    seed = args.seed
    info_path = os.path.join(args.model_dir, "training.json")
    if seed is None:
        seed = 0
        if os.path.exists(info_path):
            with open(info_path) as f:
                seed = json.load(f).get("data_seed", 0)
    model = args.model or get(args.base_url, "/v1/models", args.timeout)["data"][0]["id"]
    kinds = args.kinds.split(",")
    examples = data.generate("eval", args.n_per_kind * len(kinds), seed, kinds)
    renderer = None if args.no_render_check else data.Renderer()
    tok = None if args.no_render_check else Tokenizer()

    per_kind = {k: {"correct": 0, "total": 0} for k in kinds}
    by_mode = {"thinking_on": [0, 0], "thinking_off": [0, 0],
               "held_out_phrasing": [0, 0], "training_phrasing": [0, 0]}
    render_checked = render_bad = 0
    records, failures = [], {}
    start = time.time()
    for ex in examples:
        body = {
            "model": model,
            "messages": openai_messages(ex["messages"]),
            "temperature": 0,
            "max_tokens": args.max_tokens,
        }
        if ex["tools"]:
            body["tools"] = ex["tools"]
        if not ex["enable_thinking"]:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if renderer is not None:
            prompt, _ = renderer.prompt_and_completion(ex)
            tk = {k: body[k] for k in ("messages", "tools", "chat_template_kwargs") if k in body}
            server_ids = post(args.base_url, "/tokenize", dict(tk, model=model, add_generation_prompt=True),
                              args.timeout)["tokens"]
            render_checked += 1
            if server_ids != tok.encode(prompt):
                render_bad += 1
        resp = post(args.base_url, "/v1/chat/completions", body, args.timeout)
        choice = resp["choices"][0]
        msg = choice["message"]
        ok = score(ex["check"], msg)
        k = ex["kind"]
        per_kind[k]["total"] += 1
        per_kind[k]["correct"] += int(ok)
        mode = "thinking_on" if ex["enable_thinking"] else "thinking_off"
        by_mode[mode][0] += int(ok)
        by_mode[mode][1] += 1
        mode = "held_out_phrasing" if ex["held_out_phrasing"] else "training_phrasing"
        by_mode[mode][0] += int(ok)
        by_mode[mode][1] += 1
        rec = {"kind": k, "thinking": ex["enable_thinking"], "ok": ok,
               "held_out_phrasing": ex["held_out_phrasing"],
               "request": ex["messages"][-1]["content"], "expected": ex["check"],
               "content": msg.get("content"), "reasoning_content": msg.get("reasoning_content"),
               "tool_calls": msg.get("tool_calls"), "finish_reason": choice.get("finish_reason")}
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
        "counts": per_kind,
        **{k: round(c / max(1, n), 4) for k, (c, n) in by_mode.items()},
        "render_checked": render_checked,
        "render_mismatches": render_bad,
        "seconds": round(time.time() - start, 1),
        "first_failure_per_kind": failures,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(report, replies=records), f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
