"""What surrounds a task's request in training: system prompts, earlier turns, and agent-like
contexts (a long system prompt of instructions and many tools the request does not need, as coding
agents send), plus requests the model cannot serve, which it declines in one sentence.

Agent contexts teach the model that the last user message decides the reply, whatever comes before
it, and that a tool is called only when the request asks for what the tool does.
"""

import phrasings
import tasks

SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant.", "Answer briefly.",
           "You are a friendly assistant. Keep answers short.", "Be helpful and precise."]

FILLER = [
    "You are an interactive assistant that helps users with their tasks.",
    "Your primary goal is to help users safely and efficiently.",
    "Follow the instructions below and use the available tools when they help.",
    "Always answer concisely and directly.",
    "Never invent facts that you do not know.",
    "When you are unsure, ask the user a short question.",
    "Use the tools only when the request needs them.",
    "Keep your replies short: one or two sentences are usually enough.",
    "Do not explain what you are going to do unless the user asks.",
    "Respect the conventions of the project you are working in.",
    "Prefer small, safe changes over large ones.",
    "Read the relevant files before you change them.",
    "Run the tests after a change when there are tests.",
    "Write clear commit messages that explain why a change was made.",
    "Do not reveal secrets such as passwords or keys.",
    "If a command could delete data, explain it before you run it.",
    "Format code blocks with the right language name.",
    "Paths are absolute unless the user says otherwise.",
    "The user may interrupt you at any time.",
    "Remember the user's preferences for the rest of the conversation.",
    "Answer in the language the user writes in.",
    "Avoid long introductions and summaries.",
    "When a tool fails, report the error and stop.",
    "Plan multi-step work as a short list of steps.",
    "Check your work before you report that a task is done.",
    "Today is a normal working day.",
    "The environment runs on a Linux machine.",
    "Output is shown in a terminal that renders Markdown.",
    "Tool results may be long; read only what you need.",
    "Do not call the same tool twice with the same arguments.",
]
HEADERS = ["# Core Rules", "## Tone and Style", "## Tools", "# Workflow", "## Safety", "## Examples",
           "# Memory", "## Output Format", "# Environment", "## Final Reminder"]

AGENT_TOOLS = [
    ("read_file", "Reads and returns the content of a file. Handles text files and reports an error for a "
     "missing file. Use offset and limit to read large files in parts.",
     {"path": "The absolute path of the file to read.", "offset": "The line to start from.",
      "limit": "How many lines to read."}),
    ("write_file", "Writes content to a file, creating it and its directories when they do not exist. "
     "The user sees the change before it is applied.",
     {"file_path": "The absolute path of the file.", "content": "The text to write."}),
    ("list_directory", "Lists the names of the files and directories in a directory.",
     {"path": "The absolute path of the directory.", "ignore": "Glob patterns to leave out."}),
    ("run_shell_command", "Runs a shell command and returns its output, its exit code and its signal. "
     "Commands run in the project's directory. Long-running commands may be run in the background.",
     {"command": "The exact command to run.", "description": "A short description of the command.",
      "directory": "Where to run it."}),
    ("grep_search", "Searches the contents of files for a regular expression and returns the matching "
     "lines with their file paths and line numbers.",
     {"pattern": "The regular expression.", "path": "Where to search.", "glob": "Which files to search."}),
    ("glob", "Finds files whose paths match a glob pattern, newest first.",
     {"pattern": "The glob pattern, e.g. src/**/*.ts.", "path": "The directory to search in."}),
    ("edit", "Replaces text in a file. The old text must match exactly, including its whitespace.",
     {"file_path": "The absolute path of the file.", "old_string": "The text to replace.",
      "new_string": "The new text."}),
    ("web_fetch", "Fetches a web page and answers a question about its content.",
     {"url": "The address of the page.", "prompt": "What to find in it."}),
    ("todo_write", "Creates and updates a structured list of the tasks of the current session.",
     {"todos": "The whole updated list."}),
    ("save_memory", "Saves a fact to remember across sessions.", {"fact": "The fact to remember."}),
    ("task", "Starts a helper agent for a complex task that needs many steps.",
     {"description": "A short description of the task.", "prompt": "The task for the helper."}),
    ("skill", "Runs one of the skills installed for this project.", {"name": "The skill's name."}),
]

OTHER_REQUESTS = [
    "Write a poem about the sea.", "Explain quantum physics to me.", "Fix the bug in my code.",
    "What is the meaning of life?", "Translate this text into French.", "Summarize the last meeting.",
    "Refactor the whole project to use async.", "Who won the football match yesterday?",
    "Write an essay on climate change.", "Plan a two week trip through Asia.",
    "Analyze the recent conversation and update the memory files.", "Review my pull request.",
    "Design a database schema for a shop.", "Tell me a long story about dragons.",
]
DECLINE = "Sorry, I can only help with simple things: greetings, sums, counting, repeating words, small tables and tools."


def agent_tools(rng):
    chosen = rng.sample(AGENT_TOOLS, rng.randint(4, len(AGENT_TOOLS)))
    return [tasks._tool(n, d, {k: {"type": "string", "description": v} for k, v in props.items()},
                        [next(iter(props))]) for n, d, props in chosen]


def long_system(rng, sentences):
    out = [rng.choice(FILLER[:3])]
    for _ in range(sentences):
        if rng.random() < 0.08:
            out.append("\n\n" + rng.choice(HEADERS) + "\n\n")
        elif rng.random() < 0.3:
            out.append("\n- " + rng.choice(FILLER))
        else:
            out.append(" " + rng.choice(FILLER))
    return "".join(out).strip()


def setup_turns(rng):
    user = (f"Here is the context for our chat.\nToday's date is {rng.choice(['Monday', 'Friday', 'Sunday'])}, "
            f"{rng.choice(['March', 'June', 'October'])} {rng.randint(1, 28)}.\nI'm working in the directory: "
            f"/home/{rng.choice(tasks.NAMES).lower()}/{rng.choice(tasks.WORDS)}")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": "Got it. Thanks for the context!"}]


def other_pool():
    """The declined requests' phrasings: the list above and the composed ones (phrasings.py: the task
    kinds' openers, tails and ends around requests none of the kinds serves)."""
    return phrasings.training("other", legacy=OTHER_REQUESTS)


def other_request(rng):
    """A request none of the task kinds serves, answered by a one-sentence decline."""
    pool = OTHER_REQUESTS if rng.random() < tasks.LEGACY_SHARE else other_pool()
    if rng.random() < 0.5:
        user = rng.choice(pool)
    else:
        user = rng.choice(pool) + " " + long_system(rng, rng.randint(2, 30))
    return [{"role": "user", "content": user}], None, DECLINE, "This is not something I can do.", {"type": "decline"}


def surround(rng, kind, messages, tools, agent_share=0.07):
    """The request's messages and tools with a system prompt, earlier turns or an agent context."""
    r = rng.random()
    if r < agent_share:
        system = long_system(rng, rng.choice([10, 40, 100, 200]))
        extra = agent_tools(rng)
        tools = extra + (tools or []) if rng.random() < 0.5 else (tools or []) + extra
        history = setup_turns(rng) if rng.random() < 0.6 else []
        return [{"role": "system", "content": system}] + history + messages, tools
    if r < agent_share + 0.15:
        return [{"role": "system", "content": rng.choice(SYSTEMS)}] + messages, tools
    if r < agent_share + 0.25 and kind != "greeting":
        prev = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": tasks.GREETING_REPLY}]
        return prev + messages, tools
    if r < agent_share + 0.3 and not tools:
        # Tools the request does not need: the reply is still text.
        return messages, [tasks.TOOLS[t] for t in rng.sample(sorted(tasks.TOOLS), rng.randint(1, 3))]
    return messages, tools
