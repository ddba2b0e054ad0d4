"""The task kinds of the built-in model's training data, their value pools and the held-out split.

Every exchange is (messages, tools, enable_thinking, reply, check). The reply is what the model learns
to produce; `check` is what eval.py compares with a served model's answer.

Held out: an eval exchange's values (the number pair, the word or word list, the table row asked
about, the tool's arguments) never occur as that kind's values in training, and half of the eval
exchanges also use a phrasing training never saw. The words, names and cities themselves are shared
by all kinds: a model with a 64-wide tied embedding cannot write a token it has never seen, so what is
held out is the request, not the vocabulary.

Phrasings: each request pool's list below is (text, eval_only) pairs, and the eval split draws from
these lists only, exactly as it always has. Training phrases a request with one of a list's training
phrasings (LEGACY_SHARE of the time) or one of thousands composed by phrasings.py, none of which
contains an eval-only phrasing. `python3 leak_check.py` asserts that, that no held-out value comes out
of the training generator, and that the eval split is unchanged (its digest).
"""

import hashlib
import json

import phrasings as phrasings_mod

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

WORDS = """apple river stone cloud garden pencil window bottle candle forest mirror rocket basket
jacket tiger lemon orange silver planet castle bridge dragon button guitar hammer island kitten ladder
marble needle ocean pepper rabbit saddle ticket turtle violin wallet yellow zebra anchor banana carpet
dinner engine feather glove harbor jungle kettle lantern meadow napkin parrot ribbon sunset tomato
umbrella valley walnut blanket cactus dolphin falcon giraffe helmet jewel lizard magnet puzzle shadow
thunder velvet crystal desert honey iron juice muffin noodle olive pillow raven spider tulip wizard
barrel copper daisy eagle frost ginger lotus mango onion pebble rose salmon timber cherry bucket camel
donkey fossil grape horizon red blue green black white happy quick slow bright quiet warm cold
music paper water coffee summer winter morning evening garden city train bread""".split()
WORDS = sorted(set(WORDS))

NAMES = """Alice Bob Carol Dave Emma Frank Grace Henry Irene Jack Kate Leo Mia Noah Olga Paul Quinn
Rosa Sam Tina Umar Vera Will Xena Yuri Zoe Anna Ben Chloe Dan""".split()

CITIES = """Paris London Tokyo Berlin Madrid Rome Cairo Lima Oslo Sydney Toronto Seoul Dublin Vienna
Prague Lisbon Athens Boston Chicago Denver Miami Nairobi Mumbai Delhi Bangkok Moscow Warsaw Zurich
Geneva Helsinki Stockholm Amsterdam Brussels Munich Milan Istanbul Dubai Singapore Manila Jakarta""".split()

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CNY", "CHF", "CAD", "AUD"]
TOPICS = ["cats", "dogs", "pizza recipes", "chess rules", "jazz music", "electric cars", "solar panels",
          "the moon", "volcanoes", "coffee beans", "tennis history", "ancient rome", "deep sea fish",
          "mountain bikes", "rain forests", "space travel", "board games", "green tea", "old castles",
          "bird songs", "garden tools", "winter coats", "train tickets", "paper planes"]
SUBJECTS = ["the meeting", "lunch", "the report", "the trip", "the party", "the budget", "the dinner",
            "the plan", "the music", "the garden"]

# Training-only values: never drawn for the eval split, so the held-out prompts stay byte for byte the
# same (`leak_check.py`'s digest). They widen what training copies, so that copying, not recalling one
# of a few dozen values, is what a reply learns:
# - echo and reverse also copy these words, the cities' names and the topics' words. A tool call writes
#   its argument at the start of a line, where a word is spelled with other tokens than after a space
#   (" Mumbai" is one token, "Mumbai" at a line start is "M" "umbai"); echo and reverse replies start
#   a line too, so that spelling of a city or topic word is trained in some kind.
# - tool calls also take cities of EXTRA_CITIES (about 330, so that a city is copied from the request
#   rather than recalled: phase 9 wrote held-out cities as trained ones, Helsinki as Havana) and queries
#   of one to three random words;
# - counting to N goes up to TRAIN_COUNT_TO (the eval asks up to 15).
EXTRA_WORDS = """acorn badge beach bell berry blade board brick brush cabin canal canvas cargo chalk chess
clock coast comet coral cotton crane crown dawn diary drum dune ember fabric fence field flame flute
forge glacier globe grain gravel hatch hazel hill hive holly ink ivory jar kayak kite knot lake leaf lemonade
linen maple mask meadowlark melon mint moss nest nut oak orbit oven paddle palace peach pearl pine plum
pond poppy quill quartz rain reed ridge ring rope sail sand scarf shell shore silk skate sled smoke
snow sock spark spoon star straw stream sugar swan table tent tide tile tower trail tree tunnel vase
wagon wave wheat whale wind wing wool yarn""".split()
EXTRA_CITIES = """Porto Kyoto Osaka Hamburg Cologne Lyon Marseille Naples Venice Florence Seville Valencia Bergen
Krakow Budapest Bucharest Sofia Riga Tallinn Vilnius Edinburgh Glasgow Manchester Liverpool Cork Montreal
Vancouver Calgary Seattle Portland Houston Dallas Atlanta Phoenix Austin Havana Bogota Quito Santiago
Caracas Lagos Accra Dakar Tunis Casablanca Beirut Doha Muscat Karachi Lahore Dhaka Hanoi Busan Taipei
Perth Auckland Wellington Brisbane Adelaide
Nagoya Sapporo Fukuoka Shanghai Beijing Shenzhen Chengdu Wuhan Xian Nanjing Hangzhou Harbin Macau
Kolkata Chennai Bangalore Hyderabad Pune Jaipur Kathmandu Colombo Yangon Vientiane Penang Cebu Davao
Surabaya Bandung Medan Darwin Hobart Cairns Christchurch Dunedin Suva Apia Honolulu Anchorage Juneau
Boise Omaha Tulsa Memphis Nashville Louisville Detroit Cleveland Pittsburgh Baltimore Richmond
Raleigh Charlotte Orlando Tampa Savannah Tucson Albuquerque Sacramento Fresno Reno Spokane Tacoma
Winnipeg Regina Edmonton Halifax Quebec Ottawa Hamilton Windsor Monterrey Guadalajara Tijuana Cancun
Merida Oaxaca Panama Managua Tegucigalpa Kingston Nassau Recife Salvador Fortaleza Manaus Belem
Curitiba Cordoba Rosario Mendoza Montevideo Asuncion Arequipa Cusco Cali Medellin Cartagena
Maracaibo Guayaquil Cuenca Valparaiso Antofagasta Reykjavik Tromso Aarhus Malmo Gothenburg Uppsala
Turku Tampere Gdansk Poznan Wroclaw Brno Bratislava Ljubljana Zagreb Belgrade Sarajevo Skopje Tirana
Thessaloniki Patras Izmir Ankara Antalya Tbilisi Yerevan Baku Almaty Tashkent Bishkek Kazan Samara
Omsk Irkutsk Vladivostok Minsk Kyiv Odesa Lviv Kharkiv Chisinau Plovdiv Varna Constanta Cluj
Timisoara Graz Linz Salzburg Innsbruck Basel Bern Lausanne Lugano Bologna Turin Genoa Palermo
Catania Bari Verona Bilbao Malaga Granada Zaragoza Murcia Alicante Toulouse Nantes Bordeaux Lille
Strasbourg Nice Rennes Bremen Dresden Leipzig Hanover Stuttgart Nuremberg Frankfurt Dortmund Essen
Antwerp Ghent Bruges Rotterdam Utrecht Eindhoven Groningen Luxembourg Cardiff Belfast Bristol Leeds
Sheffield Newcastle Aberdeen Dundee Galway Limerick Alexandria Luxor Aswan Khartoum Mombasa Kampala
Kigali Dodoma Lusaka Harare Maputo Windhoek Gaborone Durban Pretoria Luanda Kinshasa Douala Abuja
Kano Bamako Niamey Rabat Fez Marrakesh Tangier Algiers Oran Tripoli Benghazi Amman Damascus Aleppo
Riyadh Jeddah Mecca Medina Kuwait Manama Sharjah Tehran Isfahan Shiraz Tabriz Mashhad Kabul Herat
Peshawar Islamabad Quetta Multan Chittagong Sylhet Mandalay Pattaya Hue Danang Haiphong Ulaanbaatar
Pyongyang Incheon Daegu Gwangju Kaohsiung Taichung Tainan""".split()
TRAIN_COUNT_TO = 30
# Share of the training draws of echo, reverse and tool arguments taken from the wider pools.
WIDE_SHARE = 0.5
TOPIC_WORDS = sorted({w for t in TOPICS for w in t.split()})
QUERY_WORDS = sorted(set(WORDS + EXTRA_WORDS + TOPIC_WORDS))
WIDE_WORDS = sorted(set(QUERY_WORDS + CITIES))


def copy_words(r, split):
    """The words an echo or reverse request copies: WORDS, and in training (half the time) also
    EXTRA_WORDS, the cities and the topics' words."""
    if split == "eval" or r.random() >= WIDE_SHARE:
        return WORDS
    return WIDE_WORDS


def held_out(key, share=0.2):
    """Whether `key` (a kind and its values) belongs to the evaluation split, stably everywhere."""
    h = int(hashlib.sha256(repr(key).encode()).hexdigest()[:8], 16)
    return (h % 1000) < share * 1000


def in_split(key, split):
    return held_out(key) == (split == "eval")


def draw(rng, split, make, key, tries=500):
    """A value made by `make(rng)` whose key(value) is in `split`."""
    for _ in range(tries):
        v = make(rng)
        if in_split(key(v), split):
            return v
    raise RuntimeError("no value of this kind in the split")


# The share of training requests phrased as one of the pool's earlier training phrasings (tasks.py's
# lists); the others take one of the composed phrasings (phrasings.py).
LEGACY_SHARE = 0.25


class Phrasing:
    """Picks a request's phrasing from pool `name` of PHRASINGS. An eval exchange takes one of the pool's
    eval-only phrasings half the time, the other half one of its training phrasings of the list (still
    with held-out values): the same draws as when the lists were all training had. A training exchange
    takes one of the lists' training phrasings (LEGACY_SHARE) or one of the composed ones
    (`training_pool`), never an eval-only one."""

    def __init__(self, rng, split):
        self.rng, self.split, self.held, self.used = rng, split, False, []

    def __call__(self, name):
        phrasings = PHRASINGS[name]
        if self.split == "eval":
            held = self.rng.random() < 0.5
            pool = [p for p, e in phrasings if e == held]
            self.held = self.held or held
        elif self.rng.random() < LEGACY_SHARE:
            pool = [p for p, e in phrasings if not e]
        else:
            pool = training_pool(name)
        text = self.rng.choice(pool)
        self.used.append((name, text))
        return text


def training_pool(name):
    """Pool `name`'s training phrasings: composed (phrasings.py) without the eval-only ones, plus the
    list's own training phrasings."""
    phrasings = PHRASINGS[name]
    return phrasings_mod.training(name, legacy=[p for p, e in phrasings if not e],
                                  held=[p for p, e in phrasings if e])


def _digits_spelled(a, b, op):
    return f"I need to {'add' if op == '+' else 'subtract'} {b} {'to' if op == '+' else 'from'} {a}."


# --------------------------------------------------------------------------------------------------
# Task kinds: each returns (messages, tools, reply, reasoning, check)
# --------------------------------------------------------------------------------------------------

GREETINGS = [
    ("Hello!", False), ("Hi!", False), ("Hello", False), ("Hi there!", False), ("Hey!", False),
    ("Good morning!", False), ("Hello, how are you?", False), ("Hi, who are you?", False),
    ("hello", False), ("hey there", False), ("Good evening!", False), ("hi", False), ("say hi", False),
    ("Say hello.", False), ("Hey, how is it going?", False), ("Howdy!", True),
    ("Greetings!", True), ("Hello there, friend!", True), ("Hey, good afternoon!", True),
    ("hi, nice to meet you", True),
]
GREETING_REPLY = "Hello! How can I help you today?"
WHO_REPLY = "Hello! I am sanmai's small built-in assistant. How can I help you today?"


def task_greeting(rng, split, ph):
    user = ph("greeting")
    reply = WHO_REPLY if "who are you" in user.lower() else GREETING_REPLY
    reasoning = "The user greets me. I greet them back."
    return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "greeting"}


ARITH = {
    "+": [("What is {a} + {b}?", False), ("What is {a} plus {b}?", False), ("Add {a} and {b}.", False),
          ("Compute {a} + {b}.", False), ("{a} + {b} = ?", False), ("Calculate {a}+{b}.", False),
          ("How much is {a} plus {b}?", True), ("Please add {a} to {b}.", True), ("Sum of {a} and {b}?", True)],
    "-": [("What is {a} - {b}?", False), ("What is {a} minus {b}?", False),
          ("Subtract {b} from {a}.", False), ("Compute {a} - {b}.", False), ("{a} - {b} = ?", False),
          ("Calculate {a}-{b}.", False), ("How much is {a} minus {b}?", True),
          ("Take {b} away from {a}.", True), ("What is left if you take {b} from {a}?", True)],
}


def task_arithmetic(rng, split, ph):
    def make(r):
        op = r.choice("+-")
        a, b = r.randint(0, 50), r.randint(0, 50)
        if op == "-" and b > a:
            a, b = b, a
        return op, a, b

    op, a, b = draw(rng, split, make, lambda v: ("arithmetic",) + v)
    r = a + b if op == "+" else a - b
    user = ph("add" if op == "+" else "sub").format(a=a, b=b)
    reply = f"{a} {op} {b} = {r}"
    reasoning = f"{_digits_spelled(a, b, op)} {a} {op} {b} = {r}."
    return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "number", "answer": r}


COUNT_TO = [("Count to {n}.", False), ("Count from 1 to {n}.", False), ("Please count up to {n}.", False),
            ("count to {n}", False), ("List the numbers from 1 to {n}.", True), ("Can you count to {n}?", True)]
COUNT_RANGE = [("Count from {a} to {b}.", False), ("List the numbers from {a} to {b}.", False),
               ("Please count from {a} up to {b}.", False), ("Count up from {a} to {b}.", True),
               ("Can you count from {a} to {b}?", True)]


def task_counting(rng, split, ph):
    if rng.random() < 0.4:
        top = 15 if split == "eval" else TRAIN_COUNT_TO
        a, b = 1, draw(rng, split, lambda r: r.randint(2, top), lambda n: ("count_to", n))
        user = ph("count_to").format(n=b)
    else:
        a, b = draw(rng, split, lambda r: (lambda x: (x, x + r.randint(2, 8)))(r.randint(1, 25)),
                    lambda v: ("count_range",) + v)
        user = ph("count_range").format(a=a, b=b)
    reply = ", ".join(str(i) for i in range(a, b + 1))
    reasoning = f"I count from {a} to {b}."
    return [{"role": "user", "content": user}], None, reply, reasoning, {"type": "exact", "answer": reply}


ECHO_WORD = [("Repeat this word: {w}", False), ("Say {w}.", False), ("Echo: {w}", False),
             ("Please repeat the word {w}.", False), ("Repeat after me: {w}", True),
             ("Just say the word {w}.", True)]
ECHO_PHRASE = [("Repeat after me: {w}", False), ("Echo: {w}", False), ("Say this back to me: {w}", False),
               ("Repeat these words: {w}", False), ("Please repeat: {w}", True),
               ("Can you say {w}?", True)]


def task_echo(rng, split, ph):
    n = rng.choice([1, 1, 2, 3])
    words = draw(rng, split, lambda r: tuple(r.sample(copy_words(r, split), n)), lambda v: ("echo",) + v)
    w = " ".join(words)
    user = ph("echo_word" if n == 1 else "echo_phrase").format(w=w)
    reasoning = f"The user wants me to repeat: {w}."
    return [{"role": "user", "content": user}], None, w, reasoning, {"type": "exact", "answer": w}


REVERSE = [("Reverse the order of these words: {w}", False), ("Reverse: {w}", False),
           ("Say these words backwards: {w}", False), ("Write these words in reverse order: {w}", False),
           ("Please reverse the word order of: {w}", True), ("What is the reverse order of {w}?", True)]


def task_reverse(rng, split, ph):
    n = rng.randint(2, 5)
    words = draw(rng, split, lambda r: tuple(r.sample(copy_words(r, split), n)), lambda v: ("reverse",) + v)
    w = " ".join(words)
    user = ph("reverse").format(w=w)
    r = " ".join(reversed(words))
    reasoning = f"The words are {w}. From the last to the first: {r}."
    return [{"role": "user", "content": user}], None, r, reasoning, {"type": "exact", "answer": r}


TABLE_Q = {
    "age": [("Ages: {table}. How old is {name}?", False), ("Here are ages: {table}. What is {name}'s age?", False),
            ("{table} (ages). How old is {name}?", False), ("Given these ages: {table}. Tell me {name}'s age.", True)],
    "score": [("Scores: {table}. What did {name} score?", False), ("Game scores: {table}. What is {name}'s score?", False),
              ("Points: {table}. How many points does {name} have?", False),
              ("{table} (points). How many points does {name} have?", True)],
    "city": [("Homes: {table}. Where does {name} live?", False), ("Who lives where: {table}. Where does {name} live?", False),
             ("{table} (home cities). What is {name}'s city?", False),
             ("Here is where people live: {table}. Which city is {name} in?", True)],
}


def task_table(rng, split, ph):
    attr = rng.choice(sorted(TABLE_Q))

    def make(r):
        k = r.randint(2, 4)
        names = r.sample(NAMES, k)
        vals = r.sample(CITIES, k) if attr == "city" else r.sample(range(18, 81) if attr == "age" else range(1, 100), k)
        return tuple(names), tuple(vals), r.randrange(k)

    names, vals, i = draw(rng, split, make, lambda v: ("table", attr, v[0][v[2]], v[1][v[2]]))
    table = ", ".join(f"{n} {v}" for n, v in zip(names, vals))
    user = ph("table_" + attr).format(table=table, name=names[i])
    reply = {"age": f"{names[i]} is {vals[i]}.", "score": f"{names[i]} scored {vals[i]}.",
             "city": f"{names[i]} lives in {vals[i]}."}[attr]
    reasoning = f"The table says {names[i]} {vals[i]}."
    check = {"type": "word", "answer": vals[i]} if attr == "city" else {"type": "number", "answer": vals[i]}
    return [{"role": "user", "content": user}], None, reply, reasoning, check


def _tool(name, desc, props, required):
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": required}}}


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
                    ("Tell me the weather forecast for {city}.", True), ("Is it cold in {city} now?", True)],
    "get_time": [("What time is it in {city}?", False), ("Tell me the local time in {city}.", False),
                 ("What's the time in {city} right now?", False), ("Do you know the current time in {city}?", True),
                 ("Give me the clock time in {city}.", True)],
    "search_web": [("Search the web for {topic}.", False), ("Look up {topic} online.", False),
                   ("Find information about {topic}.", False), ("Can you search for {topic}?", True),
                   ("Please google {topic}.", True)],
    "set_timer": [("Set a timer for {minutes} minutes.", False), ("Start a {minutes} minute timer.", False),
                  ("Remind me in {minutes} minutes.", False), ("Please time {minutes} minutes for me.", True),
                  ("I need a timer of {minutes} minutes.", True)],
    "convert_currency": [("Convert {amount} {src} to {dst}.", False),
                         ("How much is {amount} {src} in {dst}?", False),
                         ("Change {amount} {src} into {dst}.", False),
                         ("What are {amount} {src} worth in {dst}?", True)],
    "send_email": [("Send an email to {to} about {subject}.", False),
                   ("Email {to} with the subject {subject}.", False),
                   ("Write {to} an email about {subject}.", False),
                   ("Please mail {to} regarding {subject}.", True)],
}


# The phrasing pools by name: each list's (text, eval_only) pairs. Eval draws from these lists only.
PHRASINGS = {
    "greeting": GREETINGS, "add": ARITH["+"], "sub": ARITH["-"], "count_to": COUNT_TO,
    "count_range": COUNT_RANGE, "echo_word": ECHO_WORD, "echo_phrase": ECHO_PHRASE, "reverse": REVERSE,
    **{f"table_{a}": q for a, q in TABLE_Q.items()}, **{f"tool_{n}": q for n, q in TOOL_ASKS.items()},
}
# The pools each kind's requests are phrased from.
KIND_POOLS = {"greeting": ["greeting"], "arithmetic": ["add", "sub"], "counting": ["count_to", "count_range"],
              "echo": ["echo_word", "echo_phrase"], "reverse": ["reverse"],
              "table": [f"table_{a}" for a in sorted(TABLE_Q)],
              "tool_call": [f"tool_{n}" for n in sorted(TOOL_ASKS)],
              "tool_result": [f"tool_{n}" for n in sorted(TOOL_ASKS)]}

def _tool_args(r, name, split):
    wide = split == "train" and name in ("get_weather", "get_time", "search_web") and r.random() < WIDE_SHARE
    if name in ("get_weather", "get_time"):
        city = r.choice(EXTRA_CITIES + CITIES if wide else CITIES)
        return {"city": city}, {"city": city}
    if name == "search_web":
        topic = " ".join(r.sample(QUERY_WORDS, r.randint(1, 3))) if wide else r.choice(TOPICS)
        return {"query": topic}, {"topic": topic}
    if name == "set_timer":
        m = r.randint(1, 90)
        return {"minutes": m}, {"minutes": m}
    if name == "convert_currency":
        amount = r.randint(1, 999)
        src, dst = r.sample(CURRENCIES, 2)
        return {"amount": amount, "from_currency": src, "to_currency": dst}, {"amount": amount, "src": src, "dst": dst}
    to, subject = r.choice(NAMES), r.choice(SUBJECTS)
    return {"to": to, "subject": subject}, {"to": to, "subject": subject}


def _tool_request(rng, split, ph, kind):
    name = rng.choice(sorted(TOOLS))
    args, slots = draw(rng, split, lambda r: _tool_args(r, name, split),
                       lambda v: (kind, name, json.dumps(v[0], sort_keys=True)))
    user = ph("tool_" + name).format(**slots)
    others = [t for t in sorted(TOOLS) if t != name]
    chosen = [name] + rng.sample(others, rng.randint(0, 3))
    rng.shuffle(chosen)
    return name, args, user, [TOOLS[t] for t in chosen]


def task_tool_call(rng, split, ph):
    name, args, user, tools = _tool_request(rng, split, ph, "tool_call")
    reply = {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
    reasoning = f"The user asks for {name.replace('_', ' ')}. I call {name}."
    return [{"role": "user", "content": user}], tools, reply, reasoning, {"type": "tool_call", "name": name, "arguments": args}


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
        v = rng.randint(1, 1999)
        return {"result": v, "currency": args["to_currency"]}, \
            f"{args['amount']} {args['from_currency']} is {v} {args['to_currency']}.", [str(v)]
    return {"status": "sent"}, f"I sent the email to {args['to']} about {args['subject']}.", [args["to"]]


def task_tool_result(rng, split, ph):
    name, args, user, tools = _tool_request(rng, split, ph, "tool_result")
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
    result, reply, must = _tool_result(rng, name, args)
    messages = [{"role": "user", "content": user}, call, {"role": "tool", "content": json.dumps(result)}]
    reasoning = "The tool returned the answer. I tell the user."
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

# Training mix: weights per kind (the harder kinds get more: copying from the prompt and two-digit sums).
MIX = {"greeting": 1.5, "arithmetic": 6, "counting": 2.5, "echo": 3, "reverse": 4.5, "table": 3,
       "tool_call": 5, "tool_result": 1.5}
