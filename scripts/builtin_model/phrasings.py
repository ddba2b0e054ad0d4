"""The training phrasings of every request pool: composed from interchangeable parts, so that an unseen
phrasing reads as one of many seen ones.

A pool's core phrases ("reverse these words: {w}", "what is {a} plus {b}") are imperatives or
questions. Each is combined with an opener (politeness, a greeting, a question lead-in: "could you",
"please", "hey,", "quick question:"), a tail ("please", "for me", "now"), an end ("." "!" "?" none,
or one of them followed by a thank-you), and a case (as written, or all lower case). Tails and
thank-yous never follow a value the reply copies (the words of echo and reverse), so the value's end
stays unambiguous. Word-order variants (the value first, the question before the table) are cores of
their own.

The held-out phrasings (tasks.py's eval-only ones) never come out of it: `training(name)` drops every
composed phrasing that contains a held-out one of its pool, compared without case, punctuation or
spacing (`normalize`), and `python3 leak_check.py` verifies that the training generator can produce
none of them. A pool also keeps its earlier training phrasings (tasks.py's lists, not eval-only),
which a quarter of the training requests still use.
"""

import itertools
import re

# --------------------------------------------------------------------------------------------------
# The parts
# --------------------------------------------------------------------------------------------------

# Openers of an imperative core, and the ends that fit them.
PLAIN_OPENERS = ["", "please ", "kindly ", "now ", "ok, ", "hey, ", "hi, ", "hello! ", "go ahead and ",
                 "I want you to ", "I'd like you to ", "I need you to ", "quick task: ", "task: "]
ASK_OPENERS = ["can you ", "could you ", "would you ", "can you please ", "could you please ",
               "would you please ", "will you ", "hey, can you ", "hi, could you "]
# Lead-ins of a question core.
QUESTION_OPENERS = ["", "hey, ", "hi, ", "ok, ", "so, ", "quick question: ", "question: ", "tell me, "]

PLAIN_ENDS = [".", "!", "", ". Thanks!", ". Thank you.", "! Thanks."]
ASK_ENDS = ["?", "", ".", "? Thanks!", "? Thank you."]
QUESTION_ENDS = ["?", "", "? Thanks!", "? Thank you."]
PLAIN_TAILS = ["", " please", ", please", " for me", " now"]
QUESTION_TAILS = ["", ", please"]
# After a value the reply copies: no tail, no thank-you.
COPY_PLAIN_ENDS = [".", "!", ""]
COPY_ASK_ENDS = ["?", "", "."]


def normalize(text):
    """A phrasing without case, punctuation or spacing differences: the leak check compares these."""
    return " ".join(re.sub(r"[^a-z0-9{}']+", " ", text.lower()).split())


def _cap(text):
    return text[:1].upper() + text[1:] if text[:1].isalpha() else text


def compose(imperatives=(), questions=(), copy=False):
    """Every phrasing of the given cores: openers × tails × ends × case."""
    out = set()
    tails_p = [""] if copy else PLAIN_TAILS
    tails_q = [""] if copy else QUESTION_TAILS
    plain_ends = COPY_PLAIN_ENDS if copy else PLAIN_ENDS
    ask_ends = COPY_ASK_ENDS if copy else ASK_ENDS
    question_ends = COPY_ASK_ENDS if copy else QUESTION_ENDS

    def add(text):
        if text.lower().count("please") < 2:
            out.add(_cap(text))
            out.add(text.lower())

    for core in imperatives:
        tails = [""] if core.endswith("}") and copy else tails_p
        for o, t, e in itertools.product(PLAIN_OPENERS, tails, plain_ends):
            add(o + core + t + e)
        for o, t, e in itertools.product(ASK_OPENERS, tails, ask_ends):
            add(o + core + t + e)
    for core in questions:
        for o, t, e in itertools.product(QUESTION_OPENERS, tails_q, question_ends):
            add(o + core + t + e)
    return out


def _plain(sentences):
    """Fixed sentences (the value-first word orders, the tables): as written or all lower case, and with
    a greeting or a politeness word before them."""
    out = set()
    for s in sentences:
        for lead in ["", "Hi! ", "Hey, ", "Please: ", "Quick question. "]:
            out.add(lead + s)
            out.add((lead + s).lower())
    return out


# --------------------------------------------------------------------------------------------------
# The cores of each pool
# --------------------------------------------------------------------------------------------------


def _greetings():
    hellos = ["hello", "hi", "hey", "hiya", "hi there", "hey there", "hello there", "hello again",
              "good morning", "good evening", "good afternoon", "good day", "morning", "hey hey",
              "hello hello", "hi friend", "hey friend", "hello assistant", "hi assistant", "hello sanmai",
              "hi sanmai", "hey buddy", "yo", "hi all", "hello everyone", "heya", "hullo", "hallo", "hey hi",
              "oh hi", "well hello", "ahoy", "aloha", "hola", "bonjour", "ciao", "salut", "salutations",
              "g'day", "sup", "hey yo", "yo yo", "hi hi", "morning all", "evening all", "hey folks",
              "hello folks", "hi team", "hey pal", "hello mate", "hiya pal", "welcome back", "hey stranger"]
    follow = ["", ", how are you", ", how is it going", ", how are you doing", ", what's up",
              ", nice to see you", ", nice to meet you", ", who are you", " and welcome", ", are you there"]
    out = set()
    for h, f, e in itertools.product(hellos, follow, ["!", ".", "", "!!", "?"]):
        if e == "?" and not f:
            continue
        out.add(_cap(h + f + e))
        out.add(h + f + e)
    for s in ["say hi", "say hello", "say hello to me", "greet me", "please greet me", "say hi to me",
              "just say hello", "wave hello"]:
        for e in [".", "!", ""]:
            out.add(_cap(s + e))
            out.add(s + e)
    return out


ADD = dict(
    imperatives=["add {a} and {b}", "add up {a} and {b}", "compute {a} + {b}", "compute {a} plus {b}",
                 "calculate {a} + {b}", "calculate {a} plus {b}", "calculate {a}+{b}", "compute {a}+{b}",
                 "work out {a} + {b}", "work out {a} plus {b}", "solve {a} + {b}", "evaluate {a} + {b}",
                 "find {a} + {b}", "find {a} plus {b}", "tell me {a} + {b}", "tell me what {a} plus {b} is",
                 "give me {a} + {b}", "find the total of {a} and {b}", "sum up {a} and {b}",
                 "figure out {a} plus {b}", "do {a} + {b}", "add {b} onto {a}", "total {a} and {b}",
                 "take {a} and add {b}", "start with {a} and add {b}", "sum {a} and {b}",
                 "add {b} onto {a} and tell me the result", "put {b} on top of {a}", "top {a} up by {b}",
                 "take {a}, then add {b}", "take {a} plus {b}", "give me {a} and {b} added up",
                 "add together {a} and {b}", "combine {a} and {b}", "give me the sum: {a} + {b}",
                 "put {a} and {b} together", "increase {a} by {b}"],
    questions=["what is {a} + {b}", "what is {a} plus {b}", "what's {a} + {b}", "what's {a} plus {b}",
               "what is {a}+{b}", "what do {a} and {b} add up to", "what does {a} plus {b} make",
               "what does {a} + {b} equal", "what does {a} plus {b} equal", "how much does {a} plus {b} make",
               "how much are {a} and {b} together", "{a} + {b} =", "{a} + {b}", "{a} plus {b}", "{a}+{b}=",
               "what do you get if you add {a} and {b}", "what is the total of {a} and {b}",
               "{a} plus {b} is what", "what number is {a} plus {b}", "{a} and {b} added together is what",
               "what do {a} and {b} sum to", "how much do {a} and {b} sum to", "{a} and {b} summed is what",
               "what is {a} increased by {b}", "what is {b} more than {a}"],
)
SUB = dict(
    imperatives=["subtract {b} from {a}", "compute {a} - {b}", "compute {a} minus {b}", "calculate {a} - {b}",
                 "calculate {a}-{b}", "calculate {a} minus {b}", "work out {a} - {b}", "work out {a} minus {b}",
                 "solve {a} - {b}", "evaluate {a} - {b}", "find {a} - {b}", "find {a} minus {b}",
                 "tell me {a} minus {b}", "give me {a} - {b}", "deduct {b} from {a}", "remove {b} from {a}",
                 "figure out {a} minus {b}", "do {a} - {b}", "start with {a} and subtract {b}",
                 "take {a} and subtract {b}", "from {a}, subtract {b}", "find the difference of {a} and {b}",
                 "compute {a} take away {b}", "decrease {a} by {b}", "reduce {a} by {b}",
                 "take {b} off {a}", "take {b} off of {a}", "knock {b} off {a}", "take {a}, then subtract {b}",
                 "take {a} minus {b}", "take {a} and remove {b}", "from {a}, take away {b}",
                 "from {a}, take {b}", "cut {a} by {b}"],
    questions=["what is {a} - {b}", "what is {a} minus {b}", "what's {a} - {b}", "what's {a} minus {b}",
               "what is {a}-{b}", "what does {a} minus {b} equal", "what does {a} - {b} make",
               "how much does {a} minus {b} make", "what do you get if you subtract {b} from {a}",
               "what remains when {b} is subtracted from {a}", "what is the difference between {a} and {b}",
               "{a} - {b} =", "{a} - {b}", "{a} minus {b}", "{a}-{b}=", "{a} minus {b} is what",
               "what number is {a} minus {b}", "how much is left after removing {b} from {a}",
               "what is {a} take away {b}", "{a} take away {b}", "what is {b} less than {a}",
               "what is {a} decreased by {b}", "what remains of {a} after removing {b}",
               "what is {a} with {b} taken off", "what do you get if you take {b} off {a}",
               "how much is {a} once {b} is taken off", "what is {a} less {b}", "how much remains if {b} is removed from {a}",
               "what is left after subtracting {b} from {a}"],
)
COUNT_TO = dict(
    imperatives=["count to {n}", "count from 1 to {n}", "count up to {n}", "count from one to {n}",
                 "count 1 to {n}", "count all the way to {n}", "count from 1 up to {n}", "list 1 to {n}",
                 "list numbers 1 to {n}", "write the numbers 1 to {n}", "write out the numbers from 1 to {n}",
                 "give me the numbers from 1 to {n}", "print the numbers 1 through {n}", "show me 1 to {n}",
                 "say the numbers from 1 to {n}", "enumerate 1 to {n}", "count from 1 through {n}",
                 "start at 1 and count to {n}", "count upward to {n}", "list the numbers up to {n}"],
    questions=["what are the numbers from 1 to {n}", "how do you count to {n}", "what comes from 1 to {n}"],
)
COUNT_RANGE = dict(
    imperatives=["count from {a} to {b}", "list the numbers from {a} to {b}", "count from {a} up to {b}",
                 "count {a} to {b}", "count from {a} through {b}", "count from {a} till {b}",
                 "start at {a} and count to {b}", "start counting at {a} and stop at {b}",
                 "begin at {a} and count up to {b}", "list {a} to {b}", "list the numbers {a} through {b}",
                 "write the numbers from {a} to {b}", "write out {a} to {b}", "give me the numbers from {a} to {b}",
                 "print the numbers {a} to {b}", "say the numbers from {a} to {b}", "enumerate {a} to {b}",
                 "go from {a} to {b}", "count upward from {a} to {b}", "starting at {a}, count to {b}"],
    questions=["what are the numbers from {a} to {b}", "which numbers go from {a} to {b}"],
)
_ECHO_ANY = ["repeat {w}", "say {w}", "echo {w}", "echo: {w}", "repeat exactly: {w}", "copy this: {w}",
             "reply with {w}", "output {w}", "print {w}", "write {w}", "type {w}", "say only {w}",
             "answer with {w}", "respond with just {w}", "say back {w}", "echo back: {w}", "write back: {w}"]
ECHO_WORD = dict(imperatives=_ECHO_ANY + [
    "repeat this word: {w}", "repeat the word {w}", "say the word {w}", "say this word back: {w}",
    "repeat the following word: {w}", "write the word {w}", "type the word {w}", "copy this word: {w}",
    "reply with the word {w}", "echo the word {w}", "repeat this one word: {w}"])
ECHO_WORD_PLAIN = ["{w}. Say it back.", "{w} - repeat that.", "The word is {w}. Repeat it.",
                   "Here is a word: {w}. Repeat it.", "Word: {w}. Echo it.", "{w}. Echo that word."]
ECHO_PHRASE = dict(imperatives=_ECHO_ANY + [
    "repeat after me: {w}", "say this back to me: {w}", "repeat these words: {w}", "repeat: {w}", "say: {w}",
    "repeat this: {w}", "repeat this phrase: {w}", "repeat the words {w}", "say exactly: {w}",
    "type this: {w}", "reply with: {w}", "say these words: {w}", "echo these words: {w}",
    "copy these words: {w}", "repeat the following: {w}"])
ECHO_PHRASE_PLAIN = ["{w}. Say that back.", "{w} - repeat that.", "The phrase is {w}. Repeat it.",
                     "Here are some words: {w}. Say them back.", "Words: {w}. Echo them.",
                     "{w}. Repeat those words."]
REVERSE = dict(
    imperatives=["reverse the order of these words: {w}", "reverse: {w}", "say these words backwards: {w}",
                 "write these words in reverse order: {w}", "reverse these words: {w}", "reverse the words {w}",
                 "reverse the word order: {w}", "put these words in reverse order: {w}",
                 "list these words backwards: {w}", "say {w} backwards", "say {w} in reverse",
                 "read these words backwards: {w}", "flip the order of these words: {w}",
                 "invert the order of: {w}", "give me these words in reverse order: {w}",
                 "write {w} in reverse order", "reverse the sequence: {w}", "reverse the list: {w}",
                 "turn this around: {w}", "order these words from last to first: {w}",
                 "write these words from last to first: {w}", "backwards: {w}", "reverse order: {w}",
                 "reverse the order of {w}", "say the words {w} in reverse order"],
    questions=["what is {w} reversed", "what is {w} backwards", "what are these words in reverse order: {w}",
               "how do these words read backwards: {w}", "what does {w} look like reversed",
               "what is the reverse of {w}", "what would {w} be in reverse order", "what are {w} in reverse order",
               "what is the backward order of these words: {w}", "what order do {w} have when reversed"],
)
REVERSE_PLAIN = ["{w}. Reverse them.", "{w} - reverse that.", "Words: {w}. Now say them backwards.",
                 "Here are some words: {w}. Reverse their order.", "{w}. Say them from last to first.",
                 "List: {w}. Reverse it."]

TABLES = {
    "age": (["Ages: {table}.", "Here are ages: {table}.", "{table} (ages).", "Their ages: {table}.",
             "People and ages: {table}.", "Ages of the group: {table}.", "Age list: {table}.",
             "These are the ages: {table}.", "Here is a table of ages: {table}.", "Name and age: {table}."],
            ["How old is {name}?", "What is {name}'s age?", "What age is {name}?", "Tell me how old {name} is.",
             "{name} is how old?", "What's {name}'s age?", "Give me {name}'s age.", "And {name}'s age?",
             "How many years old is {name}?", "Tell me the age of {name}.", "How old is {name}"]),
    "score": (["Scores: {table}.", "Game scores: {table}.", "Points: {table}.", "Results: {table}.",
               "Final scores: {table}.", "Here are the scores: {table}.", "Quiz points: {table}.",
               "Score table: {table}.", "{table} (scores).", "The scoreboard: {table}."],
              ["What did {name} score?", "What is {name}'s score?", "How many points does {name} have?",
               "How many points did {name} get?", "What score did {name} get?", "What's {name}'s score?",
               "Give me {name}'s score.", "How much did {name} score?", "Tell me {name}'s points.",
               "What are {name}'s points?", "What did {name} score"]),
    "city": (["Homes: {table}.", "Who lives where: {table}.", "{table} (home cities).", "Home cities: {table}.",
              "Where people live: {table}.", "Cities: {table}.", "Here are home towns: {table}.",
              "Each person's city: {table}.", "Residents: {table}.", "Name and city: {table}."],
             ["Where does {name} live?", "What is {name}'s city?", "Which city does {name} live in?",
              "What city is {name} from?", "Where is {name}'s home?", "In which city does {name} live?",
              "What's {name}'s home city?", "Tell me where {name} lives.", "Where is {name} based?",
              "Which town is {name} in?", "Where does {name} live"]),
}


def _table(attr):
    intros, questions = TABLES[attr]
    out = set()
    for i, q in itertools.product(intros, questions):
        for s in (f"{i} {q}", f"{i}\n{q}", f"{q} {i}"):
            out.add(s)
            out.add(s.lower())
    return out


TOOLS = {
    "get_weather": dict(
        imperatives=["check the weather in {city}", "get the weather for {city}", "tell me the weather in {city}",
                     "show me the weather in {city}", "look up the weather in {city}",
                     "give me the weather for {city}", "find out the weather in {city}",
                     "report the weather in {city}", "get me the current weather in {city}",
                     "tell me the forecast for {city}", "check if it is raining in {city}",
                     "give me the forecast for {city}", "check the forecast in {city}"],
        questions=["what's the weather in {city}", "what is the weather like in {city}",
                   "how is the weather in {city}", "how's the weather in {city} today", "is it raining in {city}",
                   "is it sunny in {city}", "is it warm in {city} today", "is it snowing in {city}",
                   "what's the temperature in {city}", "how hot is it in {city}", "weather for {city}",
                   "weather in {city}", "{city} weather", "in {city}, what's the weather",
                   "what's the forecast for {city}", "is it hot in {city}", "is it cloudy in {city} today"]),
    "get_time": dict(
        imperatives=["tell me the local time in {city}", "check the time in {city}", "get the time in {city}",
                     "tell me the time in {city}", "show me the time in {city}", "look up the local time in {city}",
                     "find out what time it is in {city}", "give me the current time in {city}",
                     "check the clock in {city}"],
        questions=["what time is it in {city}", "what's the time in {city} right now", "what is the local time in {city}",
                   "what's the current time in {city}", "what time is it now in {city}", "what hour is it in {city}",
                   "current time in {city}", "local time in {city}", "time in {city}",
                   "do you know what time it is in {city}", "{city}: what time is it",
                   "what does the clock say in {city}"]),
    "search_web": dict(
        imperatives=["search the web for {topic}", "look up {topic} online", "find information about {topic}",
                     "search online for {topic}", "look up {topic}", "find something about {topic}",
                     "do a web search on {topic}", "find articles about {topic}", "research {topic} on the web",
                     "search the internet for {topic}", "find me pages about {topic}", "look for {topic} on the web",
                     "browse the web for {topic}", "get me search results for {topic}", "run a search on {topic}",
                     "do a google search for {topic}", "search google for {topic}", "use google to look up {topic}",
                     "search for {topic} online", "do a quick google on {topic}", "find {topic} on google",
                     "check google for {topic}", "use the web to find {topic}"],
        questions=["web search: {topic}", "what does the web say about {topic}", "any news about {topic}",
                   "what can you find online about {topic}", "google search: {topic}"]),
    "set_timer": dict(
        imperatives=["set a timer for {minutes} minutes", "start a {minutes} minute timer", "remind me in {minutes} minutes",
                     "set a {minutes} minute timer", "start a timer for {minutes} minutes",
                     "count down {minutes} minutes", "set an alarm for {minutes} minutes from now",
                     "wake me in {minutes} minutes", "put a timer on for {minutes} minutes",
                     "set the timer to {minutes} minutes", "make a timer for {minutes} minutes",
                     "ping me in {minutes} minutes", "alert me after {minutes} minutes", "time me for {minutes} minutes",
                     "clock {minutes} minutes", "keep time for {minutes} minutes", "run a timer of {minutes} minutes"],
        questions=["timer for {minutes} minutes", "{minutes} minute timer", "I want a {minutes} minute timer"]),
    "convert_currency": dict(
        imperatives=["convert {amount} {src} to {dst}", "change {amount} {src} into {dst}",
                     "convert {amount} {src} into {dst}", "exchange {amount} {src} to {dst}",
                     "exchange {amount} {src} for {dst}", "turn {amount} {src} into {dst}",
                     "change {amount} {src} to {dst}", "give me {amount} {src} in {dst}",
                     "calculate {amount} {src} in {dst}"],
        questions=["how much is {amount} {src} in {dst}", "what is {amount} {src} in {dst}", "{amount} {src} to {dst}",
                   "{amount} {src} in {dst}", "how many {dst} is {amount} {src}",
                   "how many {dst} do I get for {amount} {src}", "what's {amount} {src} in {dst}",
                   "what do {amount} {src} come to in {dst}"]),
    "send_email": dict(
        imperatives=["send an email to {to} about {subject}", "email {to} with the subject {subject}",
                     "write {to} an email about {subject}", "send {to} an email about {subject}",
                     "email {to} about {subject}", "write an email to {to} about {subject}",
                     "drop {to} an email about {subject}", "shoot {to} an email about {subject}",
                     "compose an email to {to} about {subject}", "send {to} a note about {subject}",
                     "notify {to} by email about {subject}", "email {to} concerning {subject}",
                     "about {subject}, send {to} an email"],
        questions=["email to {to} about {subject}", "an email for {to} about {subject}"]),
}

# Requests none of the kinds serves (declined): the same openers, so that what decides is the request.
OTHER = dict(
    imperatives=["write a poem about the sea", "explain quantum physics to me", "fix the bug in my code",
                 "translate this text into French", "summarize the last meeting",
                 "refactor the whole project to use async", "write an essay on climate change",
                 "plan a two week trip through Asia", "analyze the recent conversation and update the memory files",
                 "review my pull request", "design a database schema for a shop", "tell me a long story about dragons",
                 "draw a picture of a horse", "compose a song about winter", "write a cover letter for me",
                 "teach me Spanish", "recommend a good movie", "book a table at a restaurant",
                 "order a pizza", "debug this function", "write unit tests for my module",
                 "explain how a car engine works", "describe the history of Rome", "improve my essay",
                 "make a shopping list for a party", "write a story about a lost robot"],
    questions=["what is the meaning of life", "who won the football match yesterday", "why is the sky blue",
               "how do airplanes fly", "what should I cook tonight", "who wrote this book",
               "how does the stock market work", "what is the best programming language",
               "why do cats purr", "how do I learn to swim", "what happened in the news today",
               "how do vaccines work"],
)


# --------------------------------------------------------------------------------------------------
# The pools
# --------------------------------------------------------------------------------------------------


def _compose_pool(name):
    if name == "greeting":
        return _greetings()
    if name == "add":
        return compose(**ADD)
    if name == "sub":
        return compose(**SUB)
    if name == "count_to":
        return compose(**COUNT_TO)
    if name == "count_range":
        return compose(**COUNT_RANGE)
    if name == "echo_word":
        return compose(**ECHO_WORD, copy=True) | _plain(ECHO_WORD_PLAIN)
    if name == "echo_phrase":
        return compose(**ECHO_PHRASE, copy=True) | _plain(ECHO_PHRASE_PLAIN)
    if name == "reverse":
        return compose(**REVERSE, copy=True) | _plain(REVERSE_PLAIN)
    if name.startswith("table_"):
        return _table(name[len("table_"):])
    if name.startswith("tool_"):
        return compose(**TOOLS[name[len("tool_"):]])
    if name == "other":
        return compose(**OTHER)
    raise KeyError(name)


def leaks(text, held):
    """The held-out phrasings (normalized) that `text` contains: equal, or as a part of it."""
    t = f" {normalize(text)} "
    return [h for h in held if f" {h} " in t]


_POOLS = {}


def training(name, legacy=(), held=()):
    """The training phrasings of pool `name`: its composed phrasings without any that contains a held-out
    one (`held`: the pool's eval-only phrasings), plus the pool's earlier training phrasings (`legacy`),
    as a sorted list (the same order everywhere)."""
    if name not in _POOLS:
        held_n = sorted({normalize(h) for h in held})
        pool = {p for p in _compose_pool(name) if not leaks(p, held_n)}
        _POOLS[name] = sorted(pool | set(legacy))
    return _POOLS[name]
