#!/usr/bin/env python3
"""A scripted conversation with a sanmai server through the official `openai` Python SDK.

Usage: openai_conversation.py BASE_URL MODEL [--api-key KEY]
   e.g. openai_conversation.py http://127.0.0.1:8000/v1 sanmai-demo

It covers non-streamed and streamed chat (usage chunk, role chunk, finish reasons), log-probabilities with
alternatives, `n`, stop strings, tools with `tool_choice="auto"` and tool results sent back, structured output
(`chat.completions.parse` with a pydantic model, forced tool calls, `structured_outputs`), reasoning with
thinking on, prefix-cache reuse across turns, an image as a data URL, the completions API (echo + logprobs, token-id prompts,
several prompts, streaming), the models list and error answers.

The model may have random weights: every check is about structure and invariants (counts, agreement between
streamed and whole answers, greedy determinism), never about what the text says. Each check runs on its own;
the script prints one line per check, a summary, and exits non-zero if any failed.
"""

import argparse
import base64
import json
import pathlib
import math
import sys
import time
import traceback

import openai
import pydantic
from openai import OpenAI


class Mismatch(Exception):
    """An answer that breaks the API's contract."""


def check(cond, msg):
    if not cond:
        raise Mismatch(msg)


def eq(got, want, what):
    check(got == want, f"{what}: expected {want!r}, got {got!r}")


def extra(obj, name):
    """A field the SDK's models do not declare (vLLM extensions such as `reasoning_content`)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def has_field(obj, name):
    return name in (getattr(obj, "model_extra", None) or {}) or getattr(obj, name, None) is not None


SYSTEM = "You are a terse assistant. Answer in one short sentence."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string"}},
            "required": ["tz"],
        },
    },
}
TOOL_NAMES = {"get_weather", "get_time"}


class Conversation:
    def __init__(self, base_url, model, api_key):
        self.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
        self.model = model

    def chat(self, messages, **kw):
        return self.client.chat.completions.create(model=self.model, messages=messages, **kw)

    def user(self, text):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]

    # ---- shared validators ------------------------------------------------------------------------

    def check_usage(self, usage, what, completion=None):
        check(usage is not None, f"{what}: no usage")
        check(usage.prompt_tokens > 0, f"{what}: prompt_tokens {usage.prompt_tokens} is not positive")
        check(usage.completion_tokens >= 0, f"{what}: negative completion_tokens")
        eq(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens, f"{what}: total_tokens")
        if completion is not None:
            eq(usage.completion_tokens, completion, f"{what}: completion_tokens")

    def check_completion_header(self, resp, obj, what):
        check(isinstance(resp.id, str) and resp.id, f"{what}: empty id")
        eq(resp.object, obj, f"{what}: object")
        check(isinstance(resp.created, int) and resp.created > 1_600_000_000, f"{what}: created {resp.created!r}")
        eq(resp.model, self.model, f"{what}: model")

    def check_message(self, choice, what):
        msg = choice.message
        eq(msg.role, "assistant", f"{what}: role")
        check(msg.content is None or isinstance(msg.content, str), f"{what}: content is {type(msg.content)}")
        if msg.content:
            check("<think>" not in msg.content, f"{what}: a <think> tag in content")
        check(
            choice.finish_reason in ("stop", "length", "tool_calls"),
            f"{what}: finish_reason {choice.finish_reason!r}",
        )

    def collect_stream(self, stream, what, n=1, usage=True):
        """Reads a chat stream; returns (content per index, finish_reason per index, usage, chunks)."""
        chunks = list(stream)
        check(chunks, f"{what}: no chunks")
        ids = {c.id for c in chunks}
        eq(len(ids), 1, f"{what}: distinct ids across chunks")
        content = {i: "" for i in range(n)}
        reasoning = {i: "" for i in range(n)}
        finish = {}
        roles = {}
        tool_calls = {i: {} for i in range(n)}
        usage_chunk = None
        for k, c in enumerate(chunks):
            eq(c.object, "chat.completion.chunk", f"{what}: chunk object")
            eq(c.model, self.model, f"{what}: chunk model")
            if not c.choices:
                check(usage_chunk is None, f"{what}: two usage chunks")
                check(c.usage is not None, f"{what}: a chunk with neither choices nor usage")
                usage_chunk = c
                continue
            check(usage_chunk is None, f"{what}: a choice chunk after the usage chunk")
            check(c.usage is None, f"{what}: usage on a choice chunk")
            for ch in c.choices:
                i = ch.index
                check(i in content, f"{what}: choice index {i} out of range")
                check(i not in finish, f"{what}: a delta for choice {i} after its finish_reason")
                d = ch.delta
                if i not in roles:
                    eq(d.role, "assistant", f"{what}: role in the first delta of choice {i}")
                    roles[i] = True
                if d.content:
                    content[i] += d.content
                r = extra(d, "reasoning_content")
                if r:
                    reasoning[i] += r
                for tc in d.tool_calls or []:
                    slot = tool_calls[i].get(tc.index)
                    if slot is None:
                        check(tc.id, f"{what}: first delta of tool call {tc.index} has no id")
                        eq(tc.type, "function", f"{what}: tool call type")
                        check(tc.function and tc.function.name, f"{what}: first tool-call delta has no name")
                        slot = tool_calls[i][tc.index] = {"name": tc.function.name, "arguments": ""}
                    if tc.function and tc.function.arguments:
                        slot["arguments"] += tc.function.arguments
                if ch.finish_reason is not None:
                    finish[i] = ch.finish_reason
        eq(sorted(roles), list(range(n)), f"{what}: choices that got a role delta")
        eq(sorted(finish), list(range(n)), f"{what}: choices that got a finish_reason")
        if usage:
            check(usage_chunk is not None, f"{what}: no usage chunk with include_usage")
            check(chunks[-1] is usage_chunk, f"{what}: the usage chunk is not the last")
            self.check_usage(usage_chunk.usage, what)
            details = usage_chunk.usage.prompt_tokens_details
            check(details is not None and details.cached_tokens is not None, f"{what}: no cached_tokens")
        else:
            check(usage_chunk is None, f"{what}: a usage chunk without include_usage")
        for i in range(n):
            check("<think>" not in content[i], f"{what}: a <think> tag in streamed content")
            for call in tool_calls[i].values():
                check(call["name"] in TOOL_NAMES, f"{what}: tool call to unknown {call['name']!r}")
                args = json.loads(call["arguments"] or "{}")
                check(isinstance(args, dict), f"{what}: tool arguments are not an object")
            if tool_calls[i]:
                eq(finish[i], "tool_calls", f"{what}: finish_reason of a choice with tool calls")
        return {
            "content": content,
            "reasoning": reasoning,
            "finish": finish,
            "usage": usage_chunk.usage if usage_chunk else None,
            "tool_calls": tool_calls,
            "chunks": chunks,
        }

    # ---- the checks -------------------------------------------------------------------------------

    def models_list(self):
        models = self.client.models.list().data
        ids = [m.id for m in models]
        check(self.model in ids, f"model {self.model!r} not in /v1/models: {ids}")
        m = next(m for m in models if m.id == self.model)
        eq(m.object, "model", "models[].object")
        mml = extra(m, "max_model_len")
        check(isinstance(mml, int) and mml > 0, f"max_model_len {mml!r}")
        self.max_model_len = mml

    def chat_non_stream(self):
        r = self.chat(self.user("Say hello."), max_tokens=12, temperature=0.7, seed=1)
        self.check_completion_header(r, "chat.completion", "chat")
        eq(len(r.choices), 1, "number of choices")
        eq(r.choices[0].index, 0, "choice index")
        self.check_message(r.choices[0], "chat")
        self.check_usage(r.usage, "chat")
        check(1 <= r.usage.completion_tokens <= 12, f"completion_tokens {r.usage.completion_tokens} not in 1..=12")
        if r.choices[0].finish_reason == "length":
            eq(r.usage.completion_tokens, 12, "completion_tokens of a length-finished choice")
        # ignore_eos (a vLLM extension) makes the length exact.
        r = self.chat(self.user("Count."), max_tokens=9, temperature=1.0, extra_body={"ignore_eos": True})
        eq(r.choices[0].finish_reason, "length", "finish_reason with ignore_eos")
        self.check_usage(r.usage, "chat with ignore_eos", completion=9)
        # max_completion_tokens is the newer spelling.
        r = self.chat(self.user("Count."), max_completion_tokens=5, extra_body={"ignore_eos": True})
        self.check_usage(r.usage, "chat with max_completion_tokens", completion=5)
        # Content parts instead of a string.
        parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": " hello."}]
        r = self.chat([{"role": "user", "content": parts}], max_tokens=4)
        self.check_message(r.choices[0], "chat with content parts")

    def chat_stream_matches_whole(self):
        msgs = self.user("Describe the sea.")
        kw = dict(max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
        whole = self.chat(msgs, **kw)
        self.check_message(whole.choices[0], "greedy chat")
        self.check_usage(whole.usage, "greedy chat", completion=24)
        s = self.collect_stream(
            self.chat(msgs, stream=True, stream_options={"include_usage": True}, **kw), "greedy stream"
        )
        eq(s["finish"][0], "length", "streamed finish_reason")
        eq(s["usage"].completion_tokens, 24, "streamed completion_tokens")
        eq(s["usage"].prompt_tokens, whole.usage.prompt_tokens, "streamed prompt_tokens")
        eq(s["content"][0], whole.choices[0].message.content or "", "greedy streamed text vs the whole answer")
        deltas = [c for c in s["chunks"] if c.choices and c.choices[0].delta.content]
        check(len(deltas) >= 2 or len(s["content"][0]) <= 1, "the stream did not arrive in several deltas")
        # Without include_usage: no usage chunk, and a stream still ends with its finish_reason.
        s = self.collect_stream(self.chat(msgs, stream=True, **kw), "stream without usage", usage=False)
        eq(s["content"][0], whole.choices[0].message.content or "", "greedy stream without usage")

    def logprobs(self):
        k = 3
        r = self.chat(
            self.user("Name a colour."),
            max_tokens=8,
            temperature=0.0,
            logprobs=True,
            top_logprobs=k,
            extra_body={"ignore_eos": True},
        )
        c = r.choices[0]
        check(c.logprobs is not None and c.logprobs.content is not None, "no logprobs.content")
        entries = c.logprobs.content
        eq(len(entries), r.usage.completion_tokens, "logprob entries vs completion_tokens")
        for j, e in enumerate(entries):
            check(isinstance(e.token, str), f"logprobs[{j}].token is not a string")
            check(e.logprob <= 1e-6 and math.isfinite(e.logprob), f"logprobs[{j}].logprob {e.logprob}")
            check(isinstance(e.bytes, list), f"logprobs[{j}].bytes is not a list")
            eq(len(e.top_logprobs), k, f"logprobs[{j}]: alternatives")
            tops = [t.logprob for t in e.top_logprobs]
            check(tops == sorted(tops, reverse=True), f"logprobs[{j}]: alternatives not sorted: {tops}")
            # Greedy with no penalties picks the most likely token.
            check(abs(e.logprob - tops[0]) < 1e-4, f"logprobs[{j}]: greedy token {e.logprob} is not the top {tops[0]}")
            check(sum(math.exp(t) for t in tops) <= 1.0 + 1e-4, f"logprobs[{j}]: alternatives sum past 1")
        # Streamed: one entry per token across the deltas.
        stream = self.chat(
            self.user("Name a colour."),
            max_tokens=8,
            temperature=0.0,
            logprobs=True,
            top_logprobs=k,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        s = self.collect_stream(stream, "streamed logprobs")
        streamed = [
            e for ch in s["chunks"] for x in ch.choices if x.logprobs and x.logprobs.content for e in x.logprobs.content
        ]
        eq(len(streamed), 8, "streamed logprob entries")
        eq([e.logprob for e in streamed], [e.logprob for e in entries], "streamed logprobs vs whole")
        # Without logprobs=True the field is absent.
        r = self.chat(self.user("Hi"), max_tokens=2)
        check(r.choices[0].logprobs is None, "logprobs present without being asked for")

    def n_choices(self):
        r = self.chat(self.user("Pick a number."), n=2, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
        eq(sorted(c.index for c in r.choices), [0, 1], "choice indices with n=2")
        for c in r.choices:
            self.check_message(c, f"n=2 choice {c.index}")
            eq(c.finish_reason, "length", "finish_reason with ignore_eos")
        self.check_usage(r.usage, "n=2", completion=12)
        s = self.collect_stream(
            self.chat(
                self.user("Pick a number."),
                n=2,
                max_tokens=6,
                temperature=1.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ),
            "stream with n=2",
            n=2,
        )
        eq(s["usage"].completion_tokens, 12, "streamed n=2 completion_tokens")
        eq(s["usage"].prompt_tokens, r.usage.prompt_tokens, "n=2 prompt_tokens counted once")

    def stop_string(self):
        msgs = self.user("Tell me a story.")
        kw = dict(temperature=0.0, extra_body={"ignore_eos": True})
        base = self.chat(msgs, max_tokens=32, **kw).choices[0].message.content or ""
        check(len(base) >= 8, f"greedy output too short to pick a stop string from: {base!r}")
        # A stop string from the middle of the greedy output: the answer must be cut right before its first
        # occurrence, with the stop string itself never sent.
        mid = len(base) // 2
        stop = base[mid : mid + 3]
        if not stop.strip():
            stop = base[mid : mid + 5]
        want = base[: base.find(stop)]
        r = self.chat(msgs, max_tokens=32, stop=[stop, "\x00never"], **kw)
        c = r.choices[0]
        eq(c.finish_reason, "stop", f"finish_reason at stop string {stop!r}")
        eq(c.message.content or "", want, f"text cut at stop string {stop!r}")
        s = self.collect_stream(
            self.chat(msgs, max_tokens=32, stop=stop, stream=True, stream_options={"include_usage": True}, **kw),
            "streamed stop string",
        )
        eq(s["finish"][0], "stop", "streamed finish_reason at a stop string")
        eq(s["content"][0], want, f"streamed text cut at stop string {stop!r}")

    def tools(self):
        tools = [WEATHER_TOOL, CLOCK_TOOL]
        msgs = [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ]
        for seed in range(3):
            r = self.chat(msgs, tools=tools, tool_choice="auto", max_tokens=48, temperature=1.0, seed=seed)
            c = r.choices[0]
            self.check_message(c, "tools")
            for tc in c.message.tool_calls or []:
                check(tc.id, "tool call without id")
                eq(tc.type, "function", "tool call type")
                check(tc.function.name in TOOL_NAMES, f"tool call to unknown {tc.function.name!r}")
                check(isinstance(json.loads(tc.function.arguments), dict), "tool arguments are not a JSON object")
            if c.message.tool_calls:
                eq(c.finish_reason, "tool_calls", "finish_reason with tool calls")
            else:
                check(c.finish_reason in ("stop", "length"), f"finish_reason {c.finish_reason!r} without tool calls")
            self.collect_stream(
                self.chat(
                    msgs,
                    tools=tools,
                    tool_choice="auto",
                    max_tokens=48,
                    temperature=1.0,
                    seed=seed,
                    stream=True,
                    stream_options={"include_usage": True},
                ),
                "streamed tools",
            )
        # tool_choice="none" turns parsing off: never tool_calls.
        r = self.chat(msgs, tools=tools, tool_choice="none", max_tokens=16)
        check(not r.choices[0].message.tool_calls, "tool_calls with tool_choice=none")
        # An agent's next turn: the assistant's call and the tool's result go back.
        history = msgs + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": 18, "sky": "clear"})},
        ]
        r = self.chat(history, tools=tools, max_tokens=16)
        self.check_message(r.choices[0], "turn after a tool result")
        check(r.usage.prompt_tokens > 40, f"tool history rendered into only {r.usage.prompt_tokens} tokens")

    def structured_output(self):
        # Penalties keep a random model from repeating one token; the constraint does the rest.
        kw = dict(max_tokens=200, temperature=1.0, frequency_penalty=1.0, presence_penalty=1.0)

        class Plan(pydantic.BaseModel):
            city: str = pydantic.Field(min_length=1, max_length=12)
            days: int = pydantic.Field(ge=1, le=7)
            units: str = pydantic.Field(pattern="^(metric|imperial)$")

        for seed in range(3):
            r = self.client.chat.completions.parse(
                model=self.model, messages=self.user("Plan a trip as JSON."), response_format=Plan, seed=seed, **kw
            )
            c = r.choices[0]
            eq(c.finish_reason, "stop", "finish_reason of a schema answer")
            plan = c.message.parsed
            check(isinstance(plan, Plan), f"the answer did not parse into the schema: {c.message.content!r}")
            check(1 <= plan.days <= 7 and plan.units in ("metric", "imperial"), f"out of the schema: {plan!r}")
        # A forced call of one tool, whole and streamed (qwen-code's side-query shape).
        side_tool = {
            "type": "function",
            "function": {
                "name": "respond_in_schema",
                "description": "Provide the response in the requested schema.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "reasoning": {"type": "string", "maxLength": 30},
                        "next_speaker": {"type": "string", "enum": ["user", "model"]},
                    },
                    "required": ["reasoning", "next_speaker"],
                },
            },
        }
        for seed in range(3):
            r = self.chat(self.user("Who speaks next?"), tools=[side_tool], tool_choice="required", seed=seed, **kw)
            c = r.choices[0]
            eq(c.finish_reason, "tool_calls", "finish_reason of a forced tool call")
            calls = c.message.tool_calls or []
            eq(len(calls), 1, "forced tool calls")
            eq(calls[0].function.name, "respond_in_schema", "forced tool name")
            args = json.loads(calls[0].function.arguments)
            check(args.get("next_speaker") in ("user", "model"), f"arguments out of the schema: {args}")
            check(len(args.get("reasoning", "x" * 99)) <= 30, f"arguments out of the schema: {args}")
            stream = self.chat(
                self.user("Who speaks next?"),
                tools=[side_tool],
                tool_choice={"type": "function", "function": {"name": "respond_in_schema"}},
                seed=seed,
                stream=True,
                **kw,
            )
            arguments, name, finish = "", "", None
            for chunk in stream:
                for ch in chunk.choices:
                    for tc in ch.delta.tool_calls or []:
                        name += tc.function.name or ""
                        arguments += tc.function.arguments or ""
                    finish = ch.finish_reason or finish
            eq(name, "respond_in_schema", "streamed forced tool name")
            eq(finish, "tool_calls", "streamed finish_reason of a forced tool call")
            args = json.loads(arguments)
            check(args.get("next_speaker") in ("user", "model"), f"streamed arguments out of the schema: {args}")
        # vLLM's extension: a choice.
        r = self.chat(
            self.user("Sentiment?"), extra_body={"structured_outputs": {"choice": ["good", "bad"]}}, seed=1, **kw
        )
        check(r.choices[0].message.content in ("good", "bad"), f"choice answer {r.choices[0].message.content!r}")
        # A schema that cannot compile is a 400 before any token.
        try:
            self.chat(
                self.user("x"),
                response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}},
                max_tokens=4,
            )
        except openai.BadRequestError as e:
            eq(e.status_code, 400, "status of an invalid schema")
        else:
            raise Mismatch("an invalid schema was accepted")

    def reasoning(self):
        # Sampled with a seed (greedy output of a random model can be all whitespace, which is no reasoning).
        kw = dict(
            max_tokens=12,
            temperature=1.0,
            seed=5,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
        )
        r = self.chat(self.user("Think, then answer."), **kw)
        m = r.choices[0].message
        reasoning = extra(m, "reasoning_content")
        check(reasoning, "thinking on: no reasoning_content")
        check("<think>" not in reasoning and "<think>" not in (m.content or ""), "a <think> tag in the output")
        s = self.collect_stream(
            self.chat(self.user("Think, then answer."), stream=True, stream_options={"include_usage": True}, **kw),
            "streamed reasoning",
        )
        eq(s["reasoning"][0], reasoning, "streamed reasoning_content vs whole")
        eq(s["content"][0], m.content or "", "streamed content after reasoning vs whole")
        # reasoning_content sent back in history is accepted.
        history = self.user("Think, then answer.") + [
            {"role": "assistant", "content": "Blue.", "reasoning_content": "The sky is blue."},
            {"role": "user", "content": "Again."},
        ]
        self.check_message(self.chat(history, max_tokens=4).choices[0], "reasoning in history")

    def prefix_cache(self):
        # An agent-shaped second turn repeats the first turn's long system prompt, question and answer: the
        # server reports cached prompt tokens for it. (The system prompt is longer than a GDN state
        # checkpoint interval, as agents' are.)
        long_system = SYSTEM + " " + " ".join(f"Rule {i}: keep answers short and plain." for i in range(300))
        turn1 = [{"role": "system", "content": long_system}, {"role": "user", "content": "First question."}]
        r1 = self.chat(turn1, max_tokens=8, temperature=0.0)
        check(r1.usage.prompt_tokens >= 2048, f"first turn only {r1.usage.prompt_tokens} prompt tokens")
        turn2 = turn1 + [
            {"role": "assistant", "content": r1.choices[0].message.content or ""},
            {"role": "user", "content": "Second question."},
        ]
        s = self.collect_stream(
            self.chat(turn2, max_tokens=8, temperature=0.0, stream=True, stream_options={"include_usage": True}),
            "second turn",
        )
        cached = s["usage"].prompt_tokens_details.cached_tokens
        check(cached > 0, f"second turn: no cached prompt tokens (prompt {s['usage'].prompt_tokens})")
        check(cached < s["usage"].prompt_tokens, f"second turn: {cached} cached of {s['usage'].prompt_tokens}")

    def completions(self):
        prompt = "The quick brown fox jumps over the lazy dog"
        r = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=5, temperature=0.0, echo=True, logprobs=2,
            extra_body={"ignore_eos": True},
        )
        self.check_completion_header(r, "text_completion", "completions")
        c = r.choices[0]
        check(c.text.startswith(prompt), "echo: the text does not start with the prompt")
        eq(c.finish_reason, "length", "completions finish_reason with ignore_eos")
        self.check_usage(r.usage, "completions", completion=5)
        lp = c.logprobs
        total = r.usage.prompt_tokens + r.usage.completion_tokens
        eq(len(lp.tokens), total, "echo: logprob tokens vs prompt + completion")
        eq(len(lp.token_logprobs), total, "echo: token_logprobs length")
        check(lp.token_logprobs[0] is None, "echo: the first prompt token has a logprob")
        check(all(x is not None and x <= 1e-6 for x in lp.token_logprobs[1:]), "echo: missing or positive logprob")
        eq(len(lp.top_logprobs), total, "echo: top_logprobs length")
        check(lp.top_logprobs[0] is None, "echo: the first prompt token has alternatives")
        check(all(isinstance(t, dict) and 1 <= len(t) <= 3 for t in lp.top_logprobs[1:]), "echo: top_logprobs shape")
        offs = lp.text_offset
        eq(len(offs), total, "echo: text_offset length")
        check(offs[0] == 0 and all(a <= b for a, b in zip(offs, offs[1:])), f"echo: text_offset not monotone: {offs}")
        eq("".join(lp.tokens[: r.usage.prompt_tokens]), prompt, "echo: prompt tokens spell the prompt")
        # Greedy: the generated token is the top alternative.
        for j in range(r.usage.prompt_tokens, total):
            check(abs(lp.token_logprobs[j] - max(lp.top_logprobs[j].values())) < 1e-4, f"echo: token {j} not greedy")
        # Token-id prompts have exactly their length; several prompts give indexed choices.
        ids = [1000 + 37 * i for i in range(10)]
        r = self.client.completions.create(model=self.model, prompt=ids, max_tokens=3, extra_body={"ignore_eos": True})
        self.check_usage(r.usage, "token-id prompt", completion=3)
        eq(r.usage.prompt_tokens, 10, "token-id prompt_tokens")
        r = self.client.completions.create(model=self.model, prompt=["one", "two three"], max_tokens=2)
        eq(sorted(c.index for c in r.choices), [0, 1], "indices of two prompts")
        # Streamed, with a usage chunk at the end.
        chunks = list(
            self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=6, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        whole = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
        )
        eq(text, whole.choices[0].text, "streamed completion vs whole")
        finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        eq(finals, ["length"], "streamed completion finish_reason")
        check(chunks[-1].usage is not None and not chunks[-1].choices, "streamed completion: no final usage chunk")
        eq(chunks[-1].usage.completion_tokens, 6, "streamed completion tokens")

    def image(self):
        """An image as a data URL (the vision fixture's PNG): answered, its tokens counted as prompt
        tokens, the same image again greedy-identical and served from the prefix cache; a broken one is a
        400 naming the part."""
        png = (pathlib.Path(__file__).resolve().parents[1] / "fixtures/qwen3_5_mm_tiny/image0.png").read_bytes()
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        text = {"type": "text", "text": "Describe the picture."}
        plain = self.chat([{"role": "user", "content": [text]}], max_tokens=4, temperature=0.0)
        msgs = [{"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": url}}]}]
        first = self.chat(msgs, max_tokens=4, temperature=0.0)
        self.check_message(first.choices[0], "image chat")
        self.check_usage(first.usage, "image chat", completion=4)
        check(
            first.usage.prompt_tokens > plain.usage.prompt_tokens + 2,
            f"image chat: {first.usage.prompt_tokens} prompt tokens, {plain.usage.prompt_tokens} without the image",
        )
        again = self.chat(msgs, max_tokens=4, temperature=0.0)
        eq(again.choices[0].message.content, first.choices[0].message.content, "the same image, greedy")
        cached = again.usage.prompt_tokens_details.cached_tokens
        check(cached > plain.usage.prompt_tokens, f"the image's tokens not from the cache: {cached} cached")
        broken = [{"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": url[: len(url) // 2]}}]}]
        try:
            self.chat(broken, max_tokens=2)
        except openai.BadRequestError as e:
            eq(e.response.json()["error"]["param"], "messages[0].content[1]", "broken image: error param")
        else:
            raise Mismatch("a truncated image was accepted")

    def errors(self):
        def expect(exc_type, status, param, fn):
            try:
                fn()
            except exc_type as e:
                eq(e.status_code, status, f"{exc_type.__name__} status")
                body = e.response.json()
                check(isinstance(body.get("error"), dict), f"error body {body!r} has no error object")
                err = body["error"]
                for key in ("message", "type", "param", "code"):
                    check(key in err, f"error object lacks {key!r}: {err}")
                check(isinstance(err["message"], str) and err["message"], "empty error message")
                if param is not None:
                    eq(err["param"], param, "error param")
                return
            except openai.APIStatusError as e:
                raise Mismatch(f"expected {exc_type.__name__}, got {type(e).__name__} {e.status_code}: {e.message}")
            raise Mismatch(f"expected {exc_type.__name__}, the request succeeded")

        msgs = self.user("Hi")
        expect(openai.BadRequestError, 400, "temperature", lambda: self.chat(msgs, temperature=-1.0, max_tokens=2))
        expect(openai.BadRequestError, 400, "n", lambda: self.chat(msgs, n=0, max_tokens=2))
        expect(
            openai.BadRequestError, 400, "max_tokens", lambda: self.chat(msgs, max_tokens=self.max_model_len + 1)
        )
        expect(openai.BadRequestError, 400, "messages", lambda: self.client.chat.completions.create(model=self.model, messages=None))
        expect(
            openai.NotFoundError,
            404,
            None,
            lambda: self.client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=2),
        )
        expect(
            openai.BadRequestError,
            400,
            None,
            lambda: self.client.completions.create(model=self.model, prompt=[1] * self.max_model_len, max_tokens=1),
        )
        # A streamed request that is invalid fails before the stream starts.
        expect(
            openai.BadRequestError,
            400,
            "temperature",
            lambda: list(self.chat(msgs, temperature=-2.0, stream=True)),
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base_url", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("model", help="the served model name, e.g. sanmai-demo")
    ap.add_argument("--api-key", default="none")
    args = ap.parse_args()

    conv = Conversation(args.base_url, args.model, args.api_key)
    checks = [
        ("models list", conv.models_list),
        ("chat, not streamed", conv.chat_non_stream),
        ("chat streamed with usage vs whole", conv.chat_stream_matches_whole),
        ("logprobs and top_logprobs", conv.logprobs),
        ("n=2", conv.n_choices),
        ("stop string", conv.stop_string),
        ("tools with tool_choice=auto", conv.tools),
        ("structured output: schema, forced tool calls, choice", conv.structured_output),
        ("reasoning with thinking on", conv.reasoning),
        ("prefix cache across turns", conv.prefix_cache),
        ("completions: echo, logprobs, ids, stream", conv.completions),
        ("image as a data URL", conv.image),
        ("errors", conv.errors),
    ]
    failed = []
    for name, fn in checks:
        t0 = time.monotonic()
        try:
            fn()
        except Mismatch as e:
            failed.append(name)
            print(f"FAIL {name}: {e}", flush=True)
            continue
        except Exception as e:  # an SDK error or an unreadable answer is a failure too
            failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=4)
            continue
        print(f"ok   {name} ({time.monotonic() - t0:.2f}s)", flush=True)
    print(f"openai SDK {openai.__version__}")
    print(f"openai-sdk: {len(checks) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
