#!/usr/bin/env python3
"""The leak check of the built-in model's data: the training generator (tasks.py, phrasings.py,
context.py) can produce no held-out phrasing and no held-out value, and the eval split eval.py draws
is unchanged (its digest).

    python3 leak_check.py
"""

import hashlib
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import context  # noqa: E402
import data  # noqa: E402
import phrasings  # noqa: E402
import tasks  # noqa: E402

# sha256 of the eval split of 50 exchanges a kind (seed 0, as eval.py draws it) as JSON with sorted
# keys: the held-out prompts the committed model was scored on. More training phrasings must not move it.
EVAL_DIGEST = "bb588c7ca1fea4b78b3d768f77ebed7e975d151e84c6146b7b27b5377a10f79d"


def check(samples_per_kind=3000):
    """Asserts that the training generator can produce no held-out phrasing and no held-out value, and
    that the eval split is unchanged; returns the figures (distinct training phrasings per kind)."""
    normalize, leaks = phrasings.normalize, phrasings.leaks
    problems, pools = [], {}
    for name, lst in tasks.PHRASINGS.items():
        held = sorted({normalize(p) for p, e in lst if e})
        pool = tasks.training_pool(name)
        dropped = [p for p in phrasings._compose_pool(name) if leaks(p, held)]
        problems += [f"{name}: training phrasing {p!r} contains a held-out one" for p in pool if leaks(p, held)]
        problems += [f"{name}: list phrasing {p!r} missing" for p, e in lst if not e and p not in pool]
        pools[name] = {"training": len(pool), "eval_only": len(held), "composed_dropped": len(dropped)}

    # The generator itself: every phrasing a training request used is one of its pool's, no value it drew
    # is held out; every eval value is.
    plain_draw, drawn = tasks.draw, []

    def recording(rng, split, make, key, tries=500):
        v = plain_draw(rng, split, make, key, tries)
        drawn.append((split, key(v)))
        return v

    tasks.draw = recording
    try:
        rng = random.Random("leak check")
        seen = {}
        for kind in tasks.KINDS:
            for _ in range(samples_per_kind):
                ph = tasks.Phrasing(rng, "train")
                tasks.TASKS[kind](rng, "train", ph)
                for name, text in ph.used:
                    held = [normalize(p) for p, e in tasks.PHRASINGS[name] if e]
                    if text not in tasks.training_pool(name) or leaks(text, held):
                        problems.append(f"{kind}: training request phrased {text!r}")
                    seen.setdefault(kind, set()).add(text)
        train_keys = {k for s, k in drawn}
        drawn.clear()
        examples = data.generate("eval", 50 * len(tasks.KINDS), 0, tasks.KINDS)
        eval_keys = {k for s, k in drawn}
    finally:
        tasks.draw = plain_draw
    problems += [f"training value {k!r} is held out" for k in train_keys if tasks.held_out(k)]
    problems += [f"eval value {k!r} is not held out" for k in eval_keys if not tasks.held_out(k)]
    problems += [f"eval value {k!r} drawn in training" for k in eval_keys & train_keys]
    digest = hashlib.sha256(json.dumps(examples, sort_keys=True).encode()).hexdigest()
    if digest != EVAL_DIGEST:
        problems.append(f"the eval split changed: {digest}")

    per_kind = {}
    for kind, names in tasks.KIND_POOLS.items():
        before = {p for n in names for p, e in tasks.PHRASINGS[n] if not e}
        after = set().union(*(tasks.training_pool(n) for n in names))
        per_kind[kind] = {"before": len(before), "after": len(after), "sampled": len(seen[kind])}
    per_kind["other"] = {"before": len(context.OTHER_REQUESTS), "after": len(context.other_pool())}
    return {"ok": not problems, "problems": problems[:20], "distinct_training_phrasings": per_kind,
            "pools": pools, "training_samples": samples_per_kind * len(tasks.KINDS),
            "training_values": len(train_keys), "eval_values": len(eval_keys), "eval_digest": digest}


def main(argv):
    if argv[1:]:
        print("usage: python3 leak_check.py", file=sys.stderr)
        return 2
    report = check()
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
