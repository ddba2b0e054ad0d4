#!/usr/bin/env python3
"""Seeded generator of short chat exchanges for training the built-in model, rendered with the
repository's Qwen3.5 chat template exactly as the server renders them.

Task kinds (KINDS): greeting, arithmetic (add / subtract / multiply small numbers), counting (count to
N, count a letter in a word), echo and reverse of a word, a one-line fact table in the prompt and a
question about it, tool_call (pick the tool of the request's `tools` and fill its arguments from the
user's words, Qwen3.5 XML tool-call format), tool_result (the final answer after a tool's result).
About half of the exchanges have thinking on (the template's default: the reply opens with a short
`<think>` block), the other half send `enable_thinking: false`; every reply ends with `<|im_end|>`.

Held out: a share of the values (words, number pairs, names, cities, ...) and some phrasings of every
kind appear only in the `eval` split, never in `train`. Every eval exchange has held-out values; half
of them also a held-out phrasing (`held_out_phrasing`), the other half a training phrasing. Greetings
have no values: their eval exchanges with a training phrasing are training exchanges.

Rendering uses jinja2 on `crates/tokenizer/data/qwen3_5_chat_template.jinja` with the variables the
server passes (crates/tokenizer/src/template/mod.rs): messages, tools (None without tools),
documents=None, add_generation_prompt, eos_token="<|im_end|>", and `chat_template_kwargs`
(`enable_thinking`), with trim_blocks / lstrip_blocks and a `tojson` that is Python's json.dumps.

    python3 data.py --split train --n 5 --seed 0        # print rendered examples
    python3 data.py --split eval --n 3 --json           # the requests the evaluation sends
"""

import argparse
import hashlib
import json
import os
import random
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_TEMPLATE = os.path.join(REPO, "crates", "tokenizer", "data", "qwen3_5_chat_template.jinja")

KINDS = [
    "greeting",
    "arithmetic",
    "counting",
    "echo",
    "reverse",
    "table",
    "tool_call",
    "tool_result",
]

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
# Value pools and the held-out split
# --------------------------------------------------------------------------------------------------

WORDS = """apple river stone cloud garden pencil window bottle candle forest mirror rocket basket
jacket tiger lemon orange silver planet castle bridge dragon button guitar hammer island kitten ladder
marble needle ocean pepper rabbit saddle ticket turtle violin wallet yellow zebra anchor banana carpet
dinner engine feather glove harbor igloo jungle kettle lantern meadow napkin oyster parrot quilt
ribbon sunset tomato umbrella valley walnut yogurt blanket cactus dolphin falcon giraffe helmet
insect jewel koala lizard magnet nectar orchid puzzle rhythm shadow thunder velvet whisper crystal
desert fabric goblet honey iron juice kernel lobster muffin noodle olive pillow quartz raven spider
tulip unicorn vessel wizard barrel copper daisy eagle frost ginger hazel ivory jasmine lotus mango
nickel onion pebble rose salmon timber cherry bucket camel donkey elbow fossil grape horizon
""".split()

LETTER_WORDS = """banana strawberry apple letter cherry bookkeeper mississippi coffee balloon
committee success pepper google happiness bubble assessment parallel tomorrow raccoon address
""".split()

NAMES = """Alice Bob Carol Dave Emma Frank Grace Henry Irene Jack Kate Leo Mia Noah Olga Paul Quinn
Rosa Sam Tina Umar Vera Will Xena Yuri Zoe Anna Ben Chloe Dan""".split()

CITIES = """Paris London Tokyo Berlin Madrid Rome Cairo Lima Oslo Sydney Toronto Seoul Dublin Vienna
Prague Lisbon Athens Boston Chicago Denver Miami Nairobi Mumbai Delhi Bangkok Moscow Warsaw Zurich
Geneva Helsinki Stockholm Amsterdam Brussels Munich Milan Istanbul Dubai Singapore Manila Jakarta""".split()

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CNY", "CHF", "CAD", "AUD"]
TOPICS = """cats dogs pizza recipes chess rules jazz music electric cars solar panels the moon
volcanoes coffee beans tennis history ancient rome deep sea fish mountain bikes""".split("  ")
TOPICS = ["cats", "dogs", "pizza recipes", "chess rules", "jazz music", "electric cars", "solar panels",
          "the moon", "volcanoes", "coffee beans", "tennis history", "ancient rome", "deep sea fish",
          "mountain bikes", "rain forests", "space travel", "board games", "green tea", "old castles",
          "bird songs"]


def held_out(value, share=0.2):
    """Whether `value` belongs to the evaluation split (stable across runs and machines)."""
    h = int(hashlib.sha256(repr(value).encode()).hexdigest()[:8], 16)
    return (h % 1000) < share * 1000


def pick(rng, pool, split, key=lambda v: v, tries=200):
    """A value of `pool` in `split` (eval: held-out values only; train: the others)."""
    for _ in range(tries):
        v = rng.choice(pool)
        if held_out(key(v)) == (split == "eval"):
            return v
    raise RuntimeError("no value of the pool in this split")


_HELD_OUT_PHRASING = []


def phrase(rng, phrasings, split):
    """Phrasings: (text, eval_only). Train never sees the eval-only ones; eval takes one of them half
    the time (the other half a training phrasing, still with held-out values)."""
    held = split == "eval" and rng.random() < 0.5
    pool = [p for p, e in phrasings if e == held]
    _HELD_OUT_PHRASING.append(held)
    return rng.choice(pool)


# --------------------------------------------------------------------------------------------------
# Task kinds: each returns (messages, tools, reply message, reasoning, check)
# `check` is what the evaluation compares: {"type": ..., ...}
# --------------------------------------------------------------------------------------------------

GREETINGS = [
    ("Hello!", False), ("Hi!", False), ("Hello", False), ("Hi there!", False), ("Hey!", False),
    ("Good morning!", False), ("Hello, how are you?", False), ("Hi, who are you?", False),
    ("hello", False), ("hey there", False), ("Good evening!", False), ("Howdy!", True),
    ("Greetings!", True), ("Hello there, friend!", True), ("Hey, good afternoon!", True),
]
GREETING_REPLIES = [
    "Hello! How can I help you today?",
    "Hi! How can I help you today?",
]


def task_greeting(rng, split):
    user = phrase(rng, GREETINGS, split)
    if "who are you" in user.lower():
        reply = "Hello! I am a small assistant. How can I help you today?"
    elif user.lower().startswith("hi"):
        reply = GREETING_REPLIES[1]
    else:
        reply = GREETING_REPLIES[0]
    reasoning = "The user greets me. I greet them back."
    return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "greeting"}


ARITH_PHRASINGS = {
    "+": [("What is {a} + {b}?", False), ("What is {a} plus {b}?", False), ("Add {a} and {b}.", False),
          ("Compute {a} + {b}.", False), ("{a} + {b} = ?", False), ("How much is {a} plus {b}?", True),
          ("Please add {a} to {b}.", True)],
    "-": [("What is {a} - {b}?", False), ("What is {a} minus {b}?", False),
          ("Subtract {b} from {a}.", False), ("Compute {a} - {b}.", False), ("{a} - {b} = ?", False),
          ("How much is {a} minus {b}?", True), ("Take {b} away from {a}.", True)],
    "*": [("What is {a} * {b}?", False), ("What is {a} times {b}?", False),
          ("Multiply {a} by {b}.", False), ("Compute {a} x {b}.", False), ("{a} * {b} = ?", False),
          ("How much is {a} times {b}?", True), ("What do you get when you multiply {a} and {b}?", True)],
}
OP_WORD = {"+": "add", "-": "subtract", "*": "multiply"}


def task_arithmetic(rng, split):
    for _ in range(200):
        op = rng.choice("+-*")
        if op == "*":
            a, b = rng.randint(0, 12), rng.randint(0, 12)
        else:
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            if op == "-" and b > a:
                a, b = b, a
        if held_out((op, a, b)) == (split == "eval"):
            break
    r = a + b if op == "+" else a - b if op == "-" else a * b
    user = phrase(rng, ARITH_PHRASINGS[op], split).format(a=a, b=b)
    reply = f"{a} {op} {b} = {r}"
    reasoning = f"I need to {OP_WORD[op]} {a} and {b}. {a} {op} {b} = {r}."
    return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "number", "answer": r}


COUNT_TO = [("Count to {n}.", False), ("Count from 1 to {n}.", False), ("Please count up to {n}.", False),
            ("List the numbers from 1 to {n}.", True), ("Can you count to {n}?", True)]
COUNT_LETTER = [("How many times does the letter {c} appear in {w}?", False),
                ("Count the letter {c} in the word {w}.", False),
                ("How many {c}'s are in {w}?", False),
                ("In the word {w}, how many times is there a {c}?", True)]


def task_counting(rng, split):
    if rng.random() < 0.5:
        n = rng.randint(2, 12)
        if split == "eval":
            n = rng.choice([5, 9, 11])
        elif n in (5, 9, 11):
            n += 1
        user = phrase(rng, COUNT_TO, split).format(n=n)
        reply = ", ".join(str(i) for i in range(1, n + 1))
        reasoning = f"I count from 1 to {n}."
        return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "exact", "answer": reply}
    w = pick(rng, LETTER_WORDS + WORDS, split)
    c = rng.choice(sorted(set(w)))
    k = w.count(c)
    user = phrase(rng, COUNT_LETTER, split).format(c=c, w=w)
    spelled = " ".join(w)
    reply = f"The letter {c} appears {k} time{'s' if k != 1 else ''} in {w}."
    reasoning = f"Spelling it out: {spelled}. The letter {c} appears {k} time{'s' if k != 1 else ''}."
    return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "number", "answer": k}


ECHO = [("Repeat this word: {w}", False), ("Say {w}.", False), ("Echo: {w}", False),
        ("Please repeat the word {w}.", False), ("Repeat after me: {w}", True), ("Just say the word {w}.", True)]
REVERSE = [("Reverse the word {w}.", False), ("Spell {w} backwards.", False), ("Reverse: {w}", False),
           ("What is {w} written backwards?", False), ("Write the word {w} in reverse.", True),
           ("Please reverse the letters of {w}.", True)]


def task_echo(rng, split):
    w = pick(rng, WORDS, split)
    user = phrase(rng, ECHO, split).format(w=w)
    reasoning = f"The user wants me to repeat the word {w}."
    return [{"role": "user", "content": user}], None, w, reasoning, {"type": "exact", "answer": w}


def task_reverse(rng, split):
    w = pick(rng, WORDS, split)
    user = phrase(rng, REVERSE, split).format(w=w)
    r = w[::-1]
    reasoning = f"The letters of {w} are {' '.join(w)}. Backwards: {' '.join(r)}."
    return [{"role": "user", "content": user}], None, r, reasoning, {"type": "exact", "answer": r}


TABLE_Q = {
    "age": [("Ages: {table}. How old is {name}?", False), ("Here are ages: {table}. What is {name}'s age?", False),
            ("{table} (ages). How old is {name}?", False), ("Given these ages: {table}. Tell me {name}'s age.", True)],
    "score": [("Scores: {table}. What did {name} score?", False), ("Game scores: {table}. What is {name}'s score?", False),
              ("{table} (points). How many points does {name} have?", True)],
}


def task_table(rng, split):
    attr = rng.choice(sorted(TABLE_Q))
    k = rng.randint(2, 4)
    names = rng.sample(NAMES, k)
    lo, hi = (18, 80) if attr == "age" else (1, 99)
    vals = rng.sample(range(lo, hi + 1), k)
    # Which row is asked about: held-out (name, value) pairs only in eval.
    for _ in range(100):
        i = rng.randrange(k)
        if held_out((names[i], vals[i], attr)) == (split == "eval"):
            break
        names = rng.sample(NAMES, k)
        vals = rng.sample(range(lo, hi + 1), k)
    table = ", ".join(f"{n} {v}" for n, v in zip(names, vals))
    user = phrase(rng, TABLE_Q[attr], split).format(table=table, name=names[i])
    if attr == "age":
        reply = f"{names[i]} is {vals[i]}."
    else:
        reply = f"{names[i]} scored {vals[i]}."
    reasoning = f"The table says {names[i]} {vals[i]}."
    return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "number", "answer": vals[i]}


# Tools in the OpenAI request shape.
def _tool(name, desc, props, required):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


TOOLS = {
    "get_weather": _tool("get_weather", "Get the current weather in a city.",
                         {"city": {"type": "string", "description": "The city name."}}, ["city"]),
    "get_time": _tool("get_time", "Get the current local time in a city.",
                      {"city": {"type": "string", "description": "The city name."}}, ["city"]),
    "search_web": _tool("search_web", "Search the web.",
                        {"query": {"type": "string", "description": "What to search for."}}, ["query"]),
    "set_timer": _tool("set_timer", "Set a timer.",
                       {"minutes": {"type": "integer", "description": "Length in minutes."}}, ["minutes"]),
    "convert_currency": _tool("convert_currency", "Convert an amount between currencies.",
                              {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                               "to_currency": {"type": "string"}},
                              ["amount", "from_currency", "to_currency"]),
    "send_email": _tool("send_email", "Send a short email.",
                        {"to": {"type": "string", "description": "The recipient's name."},
                         "subject": {"type": "string"}}, ["to", "subject"]),
}

TOOL_ASKS = {
    "get_weather": [("What's the weather in {city}?", False), ("How is the weather in {city} today?", False),
                    ("Is it raining in {city}?", False), ("Weather for {city}, please.", False),
                    ("Tell me the weather forecast for {city}.", True)],
    "get_time": [("What time is it in {city}?", False), ("Tell me the local time in {city}.", False),
                 ("What's the time in {city} right now?", False), ("Do you know the current time in {city}?", True)],
    "search_web": [("Search the web for {topic}.", False), ("Look up {topic} online.", False),
                   ("Find information about {topic}.", False), ("Can you search for {topic}?", True)],
    "set_timer": [("Set a timer for {minutes} minutes.", False), ("Start a {minutes} minute timer.", False),
                  ("Remind me in {minutes} minutes.", False), ("Please time {minutes} minutes for me.", True)],
    "convert_currency": [("Convert {amount} {src} to {dst}.", False),
                         ("How much is {amount} {src} in {dst}?", False),
                         ("Change {amount} {src} into {dst}.", False),
                         ("What are {amount} {src} worth in {dst}?", True)],
    "send_email": [("Send an email to {to} about {subject}.", False),
                   ("Email {to} with the subject {subject}.", False),
                   ("Write {to} an email about {subject}.", False),
                   ("Please mail {to} regarding {subject}.", True)],
}


def _tool_args(rng, name, split):
    if name in ("get_weather", "get_time"):
        city = pick(rng, CITIES, split)
        return {"city": city}, {"city": city}
    if name == "search_web":
        topic = pick(rng, TOPICS, split)
        return {"query": topic}, {"topic": topic}
    if name == "set_timer":
        m = pick(rng, list(range(1, 61)), split, key=lambda v: ("min", v))
        return {"minutes": m}, {"minutes": m}
    if name == "convert_currency":
        amount = pick(rng, list(range(1, 500)), split, key=lambda v: ("amt", v))
        src, dst = rng.sample(CURRENCIES, 2)
        return ({"amount": amount, "from_currency": src, "to_currency": dst},
                {"amount": amount, "src": src, "dst": dst})
    if name == "send_email":
        to = pick(rng, NAMES, split)
        subject = rng.choice(["the meeting", "lunch", "the report", "the trip", "the party", "the budget"])
        return {"to": to, "subject": subject}, {"to": to, "subject": subject}
    raise ValueError(name)


def _tool_request(rng, split):
    name = rng.choice(sorted(TOOLS))
    args, slots = _tool_args(rng, name, split)
    user = phrase(rng, TOOL_ASKS[name], split).format(**slots)
    others = [t for t in sorted(TOOLS) if t != name]
    chosen = [name] + rng.sample(others, rng.randint(0, 3))
    rng.shuffle(chosen)
    tools = [TOOLS[t] for t in chosen]
    return name, args, user, tools


def task_tool_call(rng, split):
    name, args, user, tools = _tool_request(rng, split)
    reply = {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
    reasoning = f"I should call {name}."
    check = {"type": "tool_call", "name": name, "arguments": args}
    return [{"role": "user", "content": user}], tools, reply, reasoning, check


def _tool_result(rng, name, args):
    if name == "get_weather":
        t, c = rng.randint(-5, 35), rng.choice(CONDITIONS)
        return {"city": args["city"], "temperature": t, "condition": c}, \
            f"It is {t} degrees and {c} in {args['city']}.", [str(t), c]
    if name == "get_time":
        hh, mm = rng.randint(0, 23), rng.randint(0, 59)
        s = f"{hh:02d}:{mm:02d}"
        return {"city": args["city"], "time": s}, f"It is {s} in {args['city']}.", [s]
    if name == "search_web":
        n = rng.randint(2, 9)
        return {"results": n, "top": f"A guide to {args['query']}"}, \
            f"I found {n} results. The top one is: A guide to {args['query']}.", [str(n)]
    if name == "set_timer":
        return {"status": "ok", "minutes": args["minutes"]}, \
            f"Your timer for {args['minutes']} minutes is set.", [str(args["minutes"])]
    if name == "convert_currency":
        v = round(args["amount"] * rng.uniform(0.5, 2.0), 2)
        return {"result": v, "currency": args["to_currency"]}, \
            f"{args['amount']} {args['from_currency']} is {v} {args['to_currency']}.", [str(v)]
    if name == "send_email":
        return {"status": "sent"}, f"I sent the email to {args['to']} about {args['subject']}.", [args["to"]]
    raise ValueError(name)


def task_tool_result(rng, split):
    name, args, user, tools = _tool_request(rng, split)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
    result, reply, must = _tool_result(rng, name, args)
    messages = [{"role": "user", "content": user}, call,
                {"role": "tool", "content": json.dumps(result)}]
    reasoning = f"The tool returned the answer."
    return messages, tools, reply, reasoning, {"type": "contains", "answer": must}


TASKS = {
    "greeting": task_greeting,
    "arithmetic": task_arithmetic,
    "counting": task_counting,
    "echo": task_echo,
    "reverse": task_reverse,
    "table": task_table,
    "tool_call": task_tool_call,
    "tool_result": task_tool_result,
}

# Training mix: weights per kind.
MIX = {"greeting": 2, "arithmetic": 3, "counting": 2, "echo": 1.5, "reverse": 1.5, "table": 2,
       "tool_call": 3, "tool_result": 2}

SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant.", "Answer briefly."]


def make_example(rng, kind, split, thinking=None):
    """One exchange: the request's messages / tools / enable_thinking, the reply, and its check."""
    _HELD_OUT_PHRASING.clear()
    messages, tools, reply, reasoning, check = TASKS[kind](rng, split)
    held_phrasing = any(_HELD_OUT_PHRASING)
    if thinking is None:
        thinking = rng.random() < 0.5
    if not isinstance(reply, dict):
        reply = {"role": "assistant", "content": reply}
    reply = dict(reply)
    reply["reasoning_content"] = reasoning if thinking else ""
    r = rng.random()
    if r < 0.2:
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] + messages
    elif r < 0.3 and kind != "greeting":
        # An earlier exchange in the history (replies sent back without their reasoning).
        prev = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": GREETING_REPLIES[1]}]
        messages = prev + messages
    return {
        "kind": kind,
        "messages": messages,
        "tools": tools,
        "enable_thinking": thinking,
        "reply": reply,
        "check": check,
        "held_out_phrasing": held_phrasing,
    }


def generate(split, n, seed, kinds=None):
    """`n` examples of `split` ("train" or "eval"), mixed by MIX (train) or round-robin (eval)."""
    rng = random.Random(f"{split}:{seed}")
    kinds = kinds or KINDS
    out = []
    for i in range(n):
        if split == "eval":
            kind = kinds[i % len(kinds)]
        else:
            kind = rng.choices(kinds, weights=[MIX[k] for k in kinds])[0]
        out.append(make_example(rng, kind, split))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=["train", "eval"], default="train")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--template", default=DEFAULT_TEMPLATE)
    p.add_argument("--json", action="store_true", help="print the examples as JSON lines")
    args = p.parse_args()
    r = Renderer(args.template)
    for ex in generate(args.split, args.n, args.seed):
        prompt, completion = r.prompt_and_completion(ex)
        if args.json:
            print(json.dumps(dict(ex, prompt=prompt, completion=completion)))
        else:
            print(f"===== {ex['kind']} (thinking {'on' if ex['enable_thinking'] else 'off'})")
            print(prompt + "\033[1m" + completion + "\033[0m" if sys.stdout.isatty() else prompt + "|||" + completion)
    return 0


if __name__ == "__main__":
    sys.exit(main())
