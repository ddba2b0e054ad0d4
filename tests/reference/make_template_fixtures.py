#!/usr/bin/env python3
"""Render chat templates with Jinja2 the way transformers' apply_chat_template does.

Writes the expected strings to a JSON fixture that the Rust chat-template tests compare
byte-for-byte against minijinja:

    python3 tests/reference/make_template_fixtures.py \
        --template qwen3_5=crates/tokenizer/data/qwen3_5_chat_template.jinja \
        --template qwen3=crates/tokenizer/tests/fixtures/qwen3_chat_template.jinja \
        --template features=crates/tokenizer/tests/fixtures/features_chat_template.jinja \
        --out crates/tokenizer/tests/fixtures/chat_templates.json

Needs `pip install jinja2`. The environment matches transformers' `_compile_jinja_template`:
an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls, `tojson` as
`json.dumps(x, ensure_ascii=False, ...)`, `raise_exception` and `strftime_now`. Before
rendering, messages get the same preparation as the server's: tool-call `arguments` given as a
JSON string are decoded into objects, and for templates that do not iterate over message content,
content-part arrays become their text parts joined by newlines (null content becomes "").
"""

import argparse
import copy
import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


FOR_TAG = re.compile(r"\{%[-+]?\s*for\s+(.*?)[-+]?%\}", re.S)


def iterates_content(source):
    """True when a `for` loop runs over something named content (mirrors ContentFormat::detect)."""
    for body in FOR_TAG.findall(source):
        if " in " not in body:
            continue
        expr = body.split(" in ", 1)[1].split(" if ")[0].strip()
        if expr.endswith("recursive"):
            expr = expr[: -len("recursive")].strip()
        expr = expr.rstrip("]'\" \t\n")
        if expr == "content" or expr.endswith((".content", "[content", "['content", '["content')):
            return True
    return False


def part_text(part):
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in (None, "text", "input_text", "output_text"):
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None


def prepare_messages(messages, flatten):
    messages = copy.deepcopy(messages)
    for message in messages:
        if flatten and "content" in message:
            content = message["content"]
            if content is None:
                message["content"] = ""
            elif isinstance(content, list):
                message["content"] = "\n".join(t for t in map(part_text, content) if t is not None)
        for call in message.get("tool_calls") or []:
            for holder in (call.get("function"), call):
                if isinstance(holder, dict) and isinstance(holder.get("arguments"), str):
                    try:
                        parsed = json.loads(holder["arguments"])
                    except ValueError:
                        continue
                    if isinstance(parsed, dict):
                        holder["arguments"] = parsed
    return messages


QWEN_TOKENS = {"eos_token": "<|im_end|>"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city. Use \"metric\" units by default.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. 東京 or São Paulo"},
                    "units": {"type": "string", "enum": ["metric", "imperial"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_code",
            "description": "Run a Python snippet <safely> & return stdout.",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string"},
                    "timeout": {"type": "number", "default": 2.5},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}},
                },
                "required": ["code"],
            },
        },
    },
]

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\", \"days\": 3, \"units\": \"metric\"}"},
}
CODE_CALL = {
    "id": "call_2",
    "type": "function",
    "function": {
        "name": "run_code",
        "arguments": {
            "code": "print(\"hi\\n\")\nfor i in range(3):\n\tprint(i)",
            "timeout": 1.5,
            "verbose": True,
            "retries": 0,
            "tags": ["a", "b"],
            "env": {"LANG": "ja_JP.UTF-8", "EMPTY": None},
            "ratio": 1e-7,
            "big": 12345678901234567890,
        },
    },
}

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be concise."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "reasoning_history": [
        {"role": "user", "content": "What is 17 * 3?"},
        {"role": "assistant", "content": "51", "reasoning_content": "17 * 3 = 51.\n"},
        {"role": "user", "content": "And 18 * 3?"},
        {"role": "assistant", "content": "54", "reasoning_content": "\n18 * 3 = 54."},
    ],
    "inline_think": [
        {"role": "user", "content": "Think, then answer: capital of France?"},
        {"role": "assistant", "content": "<think>\nThe capital of France is Paris.\n</think>\n\nParis."},
        {"role": "user", "content": "And Japan?"},
    ],
    "tool_calls_json_strings": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Tokyo, then run some code."},
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL, CODE_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21.5, \"sky\": \"晴れ\"}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "hi\n\n0\n1\n2"},
        {"role": "assistant", "content": "It is 21.5 °C and sunny in Tokyo; the code printed 0-2."},
        {"role": "user", "content": "Thanks! 🙏"},
    ],
    "tool_call_pending": [
        {"role": "user", "content": "Weather in Tokyo?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "I should call get_weather.",
            "tool_calls": [WEATHER_CALL],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "flat_tool_call": [
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "run_code", "arguments": {"code": "1+1"}}]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "The result is 2."},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "System in parts."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe this image:"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "Be brief."},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ],
    "unicode": [
        {"role": "system", "content": "日本語で答えてください。\"引用\" and \\backslash\\ and tabs\there."},
        {"role": "user", "content": "Ünïcödé? 한국어, 中文, emoji 👨‍👩‍👧 <b>tags</b> & {{ braces }}"},
    ],
    "system_not_first": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Late system."},
    ],
    "empty": [],
}

FEATURE_MESSAGES = [
    {"role": "user", "content": "Hello banana world!"},
    {"role": "skip", "content": "never shown"},
    {
        "role": "assistant",
        "content": "  padded\n",
        "data": {
            "z": 1,
            "a": [1, 2.5, True, None, "x"],
            "nested": {"k": "v", "é": "ü", "q": "\"quoted\" <tag> \\ /"},
            "f": 1e-5,
            "big": 1e16,
            "neg": -0.0,
            "s": "line\nbreak\ttab\u0001",
            "emoji": "🦀",
        },
    },
    {"role": "tool", "content": None},
    {"role": "stop", "content": "ends the loop"},
    {"role": "user", "content": "never reached"},
]

CASES = [
    # (template, conversation, tools, add_generation_prompt, kwargs)
    ("qwen3_5", "user_only", None, True, {}),
    ("qwen3_5", "user_only", None, True, {"enable_thinking": False}),
    ("qwen3_5", "system_user", None, True, {"enable_thinking": True}),
    ("qwen3_5", "multi_turn", None, True, {}),
    ("qwen3_5", "multi_turn", None, False, {}),
    ("qwen3_5", "reasoning_history", None, False, {}),
    ("qwen3_5", "reasoning_history", None, True, {"enable_thinking": False}),
    ("qwen3_5", "inline_think", None, True, {}),
    ("qwen3_5", "system_user", TOOLS, True, {}),
    ("qwen3_5", "user_only", TOOLS, True, {"enable_thinking": False}),
    ("qwen3_5", "tool_calls_json_strings", TOOLS, True, {}),
    ("qwen3_5", "tool_call_pending", TOOLS, True, {}),
    ("qwen3_5", "flat_tool_call", TOOLS, False, {}),
    ("qwen3_5", "content_parts", None, True, {}),
    ("qwen3_5", "content_parts", None, True, {"add_vision_id": True}),
    ("qwen3_5", "unicode", None, True, {}),
    ("qwen3_5", "system_not_first", None, True, {}),
    ("qwen3_5", "empty", None, True, {}),
    ("qwen3", "user_only", None, True, {}),
    ("qwen3", "user_only", None, True, {"enable_thinking": False}),
    ("qwen3", "system_user", None, True, {"enable_thinking": True}),
    ("qwen3", "multi_turn", None, True, {}),
    ("qwen3", "multi_turn", None, False, {}),
    ("qwen3", "reasoning_history", None, False, {}),
    ("qwen3", "reasoning_history", None, True, {"enable_thinking": False}),
    ("qwen3", "inline_think", None, True, {}),
    ("qwen3", "system_user", TOOLS, True, {}),
    ("qwen3", "user_only", TOOLS, True, {}),
    ("qwen3", "tool_calls_json_strings", TOOLS, True, {}),
    ("qwen3", "tool_call_pending", TOOLS, True, {}),
    ("qwen3", "flat_tool_call", TOOLS, False, {}),
    ("qwen3", "content_parts", None, True, {}),
    ("qwen3", "unicode", None, True, {}),
    ("features", "features", None, True, {"enable_thinking": False, "extra_kwarg": [1, {"a": None}]}),
    ("features", "features", TOOLS, False, {}),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    env = make_env()
    sources = {}
    for spec in args.template:
        name, path = spec.split("=", 1)
        with open(path, encoding="utf-8") as f:
            sources[name] = f.read()
    conversations = dict(CONVERSATIONS, features=FEATURE_MESSAGES)

    cases = []
    for template, conversation, tools, add_generation_prompt, kwargs in CASES:
        source = sources[template]
        messages = conversations[conversation]
        case = {
            "name": f"{template}/{conversation}"
            + ("/tools" if tools else "")
            + ("/gen" if add_generation_prompt else "")
            + "".join(f"/{k}={json.dumps(v)}" for k, v in kwargs.items()),
            "template": template,
            "request": {
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                "kwargs": kwargs,
                "eos_token": QWEN_TOKENS["eos_token"],
            },
        }
        prepared = prepare_messages(messages, flatten=not iterates_content(source))
        try:
            case["expected"] = env.from_string(source).render(
                messages=prepared,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **QWEN_TOKENS,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            # raise_exception raises a plain TemplateError; other errors are subclasses.
            case["error"] = str(e) if type(e) is jinja2.exceptions.TemplateError else None
            case["error_type"] = type(e).__name__
        cases.append(case)

    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"source": "jinja2 " + jinja2.__version__, "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum("error" in c for c in cases)
    print(f"{len(cases)} cases ({errors} raising) -> {args.out}")


if __name__ == "__main__":
    main()
