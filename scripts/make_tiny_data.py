"""Generate the synthetic data of the ``tiny`` preset: instruction rows (Alpaca schema) and a classification set.

Everything comes from one fixed seed, so running this twice writes byte-identical files.

Instruction rows are ``{"instruction", "input", "output", "family"}``. The task families are split in two:

* PRETRAIN_FAMILIES (arithmetic, string transforms, list tasks, one-line Python functions) go to
  ``pretrain.jsonl``; only ``scripts/pretrain_tiny.py`` reads it.
* HELD_OUT_FAMILIES never appear in ``pretrain.jsonl``. They go to ``instructions_train.jsonl`` and
  ``instructions_eval.jsonl``, the data of the fine-tuning lessons: the pretrained model has never seen these
  tasks, so exact match starts near zero and fine-tuning visibly teaches them. No eval input occurs in train.

Preference pairs (``preferences_train.jsonl``, ``preferences_eval.jsonl``, for DPO) are built from the instruction
rows, one per row of the same split: ``{"prompt", "chosen", "rejected", "corruption", "family"}``, the prompt as the
course formats it, the reference answer chosen, and a corrupted one rejected, with the corruption said: a count off by
one, or a lambda whose body uses a name it does not take, or another input's answer.

The classification set is ``{"text", "label"}``: short sentences about one of four topics (label names in
``classification_labels.json``). Some sentences carry a word from another topic and a few labels are flipped,
so a small encoder learns it quickly but not perfectly.

Run from the repository root::

    python scripts/make_tiny_data.py            # writes assets/tiny/data/
    python scripts/make_tiny_data.py --out DIR  # somewhere else (the tests use this)
"""

from __future__ import annotations

import argparse
import json
import random
import re
import zlib
from pathlib import Path

from my_utils.core.data import format_prompt

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "assets" / "tiny" / "data"
SEED = 1234

N_PRETRAIN = 24000
N_INSTRUCTIONS_TRAIN = 3000
N_INSTRUCTIONS_EVAL = 200
N_CLASSIFICATION_TRAIN = 2000
N_CLASSIFICATION_EVAL = 300

WORDS = """
able acid aged also area army away baby back ball band bank base bath bear beat bell belt bird blue boat body bone
book boot born both bowl cake call calm camp card care cart case cash cast cell chip city clay club coal coat code
cold cook cool copy corn cost crew crop dark data date dawn deal deep desk diet dish door down draw drum duck dust
duty earn east easy edge face fact fair farm fast fear feet file film fine fire fish flag flat flow folk food foot
fork form fuel game gate gift girl glad goal gold golf good grey grow hair half hall hand hard harm hat head heat
help hero hill hint hold hole home hope horn host hour huge idea iron item jazz join joke jump junk keen kind king
kite lake lamp land lane last leaf left lens life lift lime line lion list load loan lock long loud love luck mail
main mark mask meal milk mind mint moon nest news nice note oven pack page pain park path pear pen pink plan pond
rain ring road rock roof rope rose ruby safe salt sand seed ship shoe silk sing snow soap song soup star stem tail
team tent tide tree vase wall wave wind wing wolf wood yard year zero apple bread chair cloud dance eagle field
grape happy house juice lemon light money music ocean paper piano plant queen river robot sheep smile sugar table
tiger train water whale zebra garden pencil rabbit silver window yellow basket candle forest
""".split()

CODE_TASKS = [  # (what the function returns, function names, number of arguments, returned expression)
    ("sum of {a} and {b}", ["add", "add_numbers", "total"], 2, "{a} + {b}"),
    ("difference of {a} and {b}", ["subtract", "diff", "minus"], 2, "{a} - {b}"),
    ("product of {a} and {b}", ["multiply", "product", "times"], 2, "{a} * {b}"),
    ("larger of {a} and {b}", ["larger", "maximum", "bigger"], 2, "max({a}, {b})"),
    ("smaller of {a} and {b}", ["smaller", "minimum", "lesser"], 2, "min({a}, {b})"),
    ("remainder of {a} divided by {b}", ["remainder", "modulo", "mod"], 2, "{a} % {b}"),
    ("average of {a} and {b}", ["average", "mean", "midpoint"], 2, "({a} + {b}) / 2"),
    ("square of {a}", ["square", "squared", "sq"], 1, "{a} * {a}"),
    ("absolute value of {a}", ["absolute", "abs_value", "magnitude"], 1, "abs({a})"),
    ("double of {a}", ["double", "twice", "times_two"], 1, "2 * {a}"),
    ("half of {a}", ["half", "halve", "split"], 1, "{a} / 2"),
    ("negative of {a}", ["negate", "negative", "opposite"], 1, "-{a}"),
    ("cube of {a}", ["cube", "cubed", "third_power"], 1, "{a} ** 3"),
    ("length of the string {a}", ["length", "str_len", "size"], 1, "len({a})"),
    ("string {a} in uppercase", ["shout", "upper", "to_upper"], 1, "{a}.upper()"),
    ("string {a} in lowercase", ["lower", "to_lower", "quiet"], 1, "{a}.lower()"),
    ("string {a} reversed", ["reverse", "backwards", "flip"], 1, "{a}[::-1]"),
    ("first element of the list {a}", ["first", "head", "front"], 1, "{a}[0]"),
    ("last element of the list {a}", ["last", "final", "tail"], 1, "{a}[-1]"),
    ("sum of the list {a}", ["list_sum", "sum_all", "add_all"], 1, "sum({a})"),
    ("largest element of the list {a}", ["list_max", "max_item", "top"], 1, "max({a})"),
]
ARG_NAMES = [("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"), ("u", "v"), ("i", "j"), ("c", "d"), ("h", "k"), ("r", "t"), ("f", "g")]


def digits(rng: random.Random, low: int = 3, high: int = 6) -> list[int]:
    """A short list of random digits."""
    return [rng.randrange(10) for _ in range(rng.randint(low, high))]


def spaced(values: list[int]) -> str:
    return " ".join(str(v) for v in values)


# Each family function returns (instruction, input, output); an empty input puts the data in the instruction.
def add(rng):
    a, b = rng.randrange(21), rng.randrange(21)
    return rng.choice([
        (f"What is {a} + {b}?", ""),
        ("Add the two numbers.", f"{a} and {b}"),
        ("Compute the sum.", f"{a} + {b}"),
    ]) + (str(a + b),)


def subtract(rng):
    a = rng.randrange(21)
    b = rng.randrange(a + 1)
    return rng.choice([
        (f"What is {a} - {b}?", ""),
        ("Subtract the second number from the first.", f"{a} and {b}"),
        ("Compute the difference.", f"{a} - {b}"),
    ]) + (str(a - b),)


def uppercase(rng):
    w = rng.choice(WORDS)
    return rng.choice([
        ("Convert the word to uppercase.", w),
        ("Write this word in capital letters.", w),
        (f"Write {w} in uppercase.", ""),
    ]) + (w.upper(),)


def reverse_word(rng):
    w = rng.choice(WORDS)
    return rng.choice([
        ("Reverse the letters of the word.", w),
        ("Spell this word backwards.", w),
        (f"Write {w} backwards.", ""),
    ]) + (w[::-1],)


def count_letters(rng):
    w = rng.choice(WORDS)
    return rng.choice([
        ("How many letters are in the word?", w),
        ("Count the letters in this word.", w),
        (f"How many letters does {w} have?", ""),
    ]) + (str(len(w)),)


def first_letter(rng):
    w = rng.choice(WORDS)
    return rng.choice([
        ("What is the first letter of the word?", w),
        ("Give the first letter of this word.", w),
        (f"What letter does {w} start with?", ""),
    ]) + (w[0],)


def list_max(rng):
    xs = digits(rng)
    return rng.choice([
        ("What is the largest number in the list?", spaced(xs)),
        ("Find the maximum.", spaced(xs)),
        (f"Which is the biggest of {spaced(xs)}?", ""),
    ]) + (str(max(xs)),)


def list_min(rng):
    xs = digits(rng)
    return rng.choice([
        ("What is the smallest number in the list?", spaced(xs)),
        ("Find the minimum.", spaced(xs)),
        (f"Which is the smallest of {spaced(xs)}?", ""),
    ]) + (str(min(xs)),)


def list_sort(rng):
    xs = digits(rng)
    return rng.choice([
        ("Sort the numbers in ascending order.", spaced(xs)),
        ("Sort this list from smallest to largest.", spaced(xs)),
        (f"Sort {spaced(xs)} in increasing order.", ""),
    ]) + (spaced(sorted(xs)),)


def code_task(rng):
    """A random CODE_TASKS entry: (what the function returns, function names, arguments, returned expression)."""
    description, names, n_args, expression = rng.choice(CODE_TASKS)
    args = dict(zip("ab", rng.choice(ARG_NAMES)[:n_args]))
    if "string" in description:
        args = {"a": rng.choice(["s", "text", "word"])}
    elif "list" in description:
        args = {"a": rng.choice(["xs", "items", "values"])}
    return description.format(**args), names, ", ".join(args.values()), expression.format(**args)


def python_function(rng):
    what, names, args, expression = code_task(rng)
    name = rng.choice(names)
    code = f"def {name}({args}): return {expression}"
    return rng.choice([
        (f"Write a Python function that returns the {what}.", ""),
        (f"Write a Python function named {name} that returns the {what}.", ""),
        ("Write a one-line Python function.", f"{name}: the {what}"),
    ]) + (code,)


def last_letter(rng):
    w = rng.choice(WORDS)
    return rng.choice([
        ("What is the last letter of the word?", w),
        ("Give the last letter of this word.", w),
        (f"What letter does {w} end with?", ""),
    ]) + (w[-1],)


# Held-out families reuse what pretraining taught (digit lists, one-line Python) in a new task. Their data always
# sits in `input`, so that train and eval can be split on it.
def list_length(rng):
    xs = digits(rng)
    return rng.choice([
        "How many numbers are in the list?",
        "Count the numbers in this list.",
        "How long is this list?",
    ]), spaced(xs), str(len(xs))


def python_lambda(rng):
    what, _, args, expression = code_task(rng)
    return rng.choice([
        "Write a Python lambda that returns this.",
        "Turn this into a Python lambda.",
        "Write a lambda expression for this.",
    ]), what, f"lambda {args}: {expression}"


PRETRAIN_FAMILIES = {
    "add": add,
    "subtract": subtract,
    "uppercase": uppercase,
    "reverse_word": reverse_word,
    "count_letters": count_letters,
    "first_letter": first_letter,
    "last_letter": last_letter,
    "list_max": list_max,
    "list_min": list_min,
    "list_sort": list_sort,
    "python_function": python_function,
}
HELD_OUT_FAMILIES = {
    "list_length": list_length,
    "python_lambda": python_lambda,
}
EVAL_SHARE = 3  # inputs whose CRC-32 is divisible by this (about a third) are reserved for eval


def make_pretrain(rng: random.Random, n: int) -> list[dict]:
    """``n`` rows drawn uniformly from the pretraining families."""
    rows = []
    for _ in range(n):
        family = rng.choice(sorted(PRETRAIN_FAMILIES))
        instruction, input_, output = PRETRAIN_FAMILIES[family](rng)
        rows.append({"instruction": instruction, "input": input_, "output": output, "family": family})
    return rows


def make_held_out(rng: random.Random, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Train and eval rows of the held-out families; an input goes to eval or train by its CRC-32, never both."""
    per_family_eval = n_eval // len(HELD_OUT_FAMILIES)
    per_family_train = n_train // len(HELD_OUT_FAMILIES)
    train, evaluation = [], []
    for family in sorted(HELD_OUT_FAMILIES):
        family_train, family_eval = [], []
        while len(family_train) < per_family_train or len(family_eval) < per_family_eval:
            instruction, input_, output = HELD_OUT_FAMILIES[family](rng)
            row = {"instruction": instruction, "input": input_, "output": output, "family": family}
            if zlib.crc32(input_.encode()) % EVAL_SHARE == 0:
                if len(family_eval) < per_family_eval and row not in family_eval:  # distinct eval rows
                    family_eval.append(row)
            elif len(family_train) < per_family_train:
                family_train.append(row)
        train += family_train
        evaluation += family_eval
    rng.shuffle(train)
    rng.shuffle(evaluation)
    return train, evaluation


TOPICS = {  # label name -> topical words
    "sports": ["match", "goal", "team", "coach", "player", "league", "score", "stadium", "referee", "season",
               "tennis", "football", "runner", "trophy", "penalty"],
    "food": ["soup", "bread", "recipe", "chef", "dinner", "salad", "cheese", "kitchen", "dessert", "flavor",
             "noodles", "bakery", "spice", "lunch", "pasta"],
    "weather": ["rain", "storm", "sunshine", "forecast", "wind", "snow", "cloud", "thunder", "fog", "heatwave",
                "temperature", "drizzle", "frost", "breeze", "humidity"],
    "technology": ["laptop", "software", "robot", "battery", "network", "phone", "server", "app", "keyboard",
                   "screen", "update", "chip", "browser", "password", "camera"],
}
SUBJECTS = ["my friend", "the teacher", "our neighbor", "a student", "my sister", "the manager", "everyone",
            "the old man", "my cousin", "a reporter"]
TEMPLATES = [
    "{subject} talked about the {w1} all evening.",
    "{subject} said the {w1} was better than the {w2}.",
    "yesterday {subject} wrote a long post about the {w1}.",
    "{subject} could not stop thinking about the {w1} and the {w2}.",
    "the news today was mostly about the {w1}.",
    "{subject} asked me what I think of the new {w1}.",
    "I read that the {w1} will change next week.",
    "{subject} was surprised by the {w1} this morning.",
    "there was a lot of talk about the {w1} and the {w2} at work.",
    "{subject} complained that the {w1} was a disaster.",
]
DISTRACTOR_RATE = 0.3  # a word of another topic replaces one topical word
LABEL_NOISE = 0.05  # a label is replaced by a random one


def make_classification(rng: random.Random, n: int, labels: list[str], seen: set[str]) -> list[dict]:
    """``n`` distinct sentences (none already in ``seen``, which is updated) with integer labels."""
    rows = []
    while len(rows) < n:
        label = rng.randrange(len(labels))
        w1, w2 = rng.sample(TOPICS[labels[label]], 2)
        if rng.random() < DISTRACTOR_RATE:
            w2 = rng.choice(TOPICS[rng.choice([name for name in labels if name != labels[label]])])
        text = rng.choice(TEMPLATES).format(subject=rng.choice(SUBJECTS), w1=w1, w2=w2)
        text = text[0].upper() + text[1:]
        if text in seen:
            continue
        seen.add(text)
        if rng.random() < LABEL_NOISE:
            label = rng.randrange(len(labels))
        rows.append({"text": text, "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def corrupt(row: dict, rows: list[dict], rng: random.Random) -> tuple[str, str]:
    """A wrong answer to ``row`` and what was done to it (never the right answer)."""
    if row["family"] == "list_length":
        count = int(row["output"])
        return str(count + 1 if count == 0 or rng.random() < 0.5 else count - 1), "the count off by one"
    head, body = row["output"].split(": ", 1)
    name = head.split()[-1].split(",")[0]  # the lambda's (first) parameter
    word = re.compile(rf"\b{re.escape(name)}\b")
    if rng.random() < 0.5 and word.search(body):
        return f"{head}: {word.sub('x' if name != 'x' else 'y', body)}", "a name the lambda does not take"
    other = rng.choice([r for r in rows if r["family"] == row["family"] and r["output"] != row["output"]])
    return other["output"], "another input's answer"


def make_preferences(rng: random.Random, rows: list[dict]) -> list[dict]:
    """One preference pair per instruction row: its answer chosen, a corruption of it rejected."""
    pairs = []
    for row in rows:
        rejected, corruption = corrupt(row, rows, rng)
        pairs.append({"prompt": format_prompt(row), "chosen": row["output"], "rejected": rejected,
                      "corruption": corruption, "family": row["family"]})
    return pairs


def generate(out: Path) -> dict[str, int]:
    """Write every data file to ``out``; return the number of rows per file."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    labels = list(TOPICS)
    files: dict[str, list[dict]] = {"pretrain.jsonl": make_pretrain(rng, N_PRETRAIN)}
    files["instructions_train.jsonl"], files["instructions_eval.jsonl"] = make_held_out(
        rng, N_INSTRUCTIONS_TRAIN, N_INSTRUCTIONS_EVAL
    )
    seen: set[str] = set()
    files["classification_eval.jsonl"] = make_classification(rng, N_CLASSIFICATION_EVAL, labels, seen)
    files["classification_train.jsonl"] = make_classification(rng, N_CLASSIFICATION_TRAIN, labels, seen)
    preference_rng = random.Random(SEED + 1)  # its own: the files above stay as they were
    for split in ("train", "eval"):
        files[f"preferences_{split}.jsonl"] = make_preferences(preference_rng, files[f"instructions_{split}.jsonl"])
    for name, rows in files.items():
        write_jsonl(out / name, rows)
    (out / "classification_labels.json").write_text(json.dumps(labels) + "\n", encoding="utf-8")
    return {name: len(rows) for name, rows in files.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Seed and sizes are fixed in the script.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT.relative_to(ROOT)})")
    args = parser.parse_args()
    counts = generate(args.out)
    for name, n in counts.items():
        print(f"{n:6d} rows  {args.out / name}")


if __name__ == "__main__":
    main()
