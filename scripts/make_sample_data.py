#!/usr/bin/env python3
"""Generate a small synthetic sentiment data set in the Amazon Polarity layout.

    python scripts/make_sample_data.py --output DIR [--train-size N] [--test-size M]
        [--seed S] [--format jsonl|csv|parquet]

writes DIR/train.<ext> and DIR/test.<ext> with the columns label (0 negative,
1 positive), title and content. Nothing is downloaded.

The reviews are learnable but not trivial: each has three opinion sentences about
aspects of a product, all with the label's polarity. One opinion in ten is negated ("the
battery is not great": a negative opinion made of a positive word), so counting positive
and negative words is not quite enough: a model has to read the word before the
adjective. Neutral filler sentences, a title that disagrees with the label three times in
ten, and 2% flipped labels add noise; the tiny model reaches about 0.93-0.95.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from pathlib import Path

POSITIVE = (
    "great", "excellent", "wonderful", "fantastic", "superb", "lovely", "perfect", "solid",
    "reliable", "delightful", "impressive", "sturdy", "comfortable", "brilliant",
)  # fmt: skip
NEGATIVE = (
    "terrible", "awful", "poor", "horrible", "disappointing", "flimsy", "useless", "broken",
    "cheap", "defective", "annoying", "mediocre", "noisy", "fragile",
)  # fmt: skip
NEGATORS = ("not", "never", "hardly", "far from", "not at all")
INTENSIFIERS = ("", "", "", "very ", "really ", "quite ", "extremely ", "rather ")
PRODUCTS = (
    "blender", "headset", "charger", "phone case", "desk lamp", "toy robot", "rain jacket",
    "kettle", "backpack", "keyboard", "novel", "cookbook", "water bottle", "speaker",
    "coffee grinder", "yoga mat", "alarm clock", "drill", "monitor stand", "tent",
)  # fmt: skip
ASPECTS = (
    "quality", "price", "battery", "sound", "packaging", "design", "delivery", "fit",
    "build", "finish", "manual", "color", "size", "weight", "handle", "screen",
)  # fmt: skip
FILLERS = (
    "I bought it for my sister.",
    "It arrived on a Tuesday.",
    "The box was blue.",
    "I have used it for two weeks.",
    "My neighbour has the same one.",
    "I ordered it after reading the reviews.",
    "It came with a spare part.",
    "We use it every morning.",
    "This was a birthday present.",
    "I compared three brands before buying.",
)
OPINION_TEMPLATES = (
    "The {aspect} is {adj}.",
    "The {aspect} feels {adj}.",
    "Honestly the {aspect} seems {adj}.",
    "I found the {aspect} {adj}.",
)
VERDICTS = ("Overall, make up your own mind.", "That is all I can say.", "")

LABEL_NOISE = 0.02
NEGATION_RATE = 0.1
TITLE_AGREES = 0.7
OPINIONS = 3
FORMATS = ("jsonl", "csv", "parquet")


def _opinion(rng: random.Random, polarity: int) -> str:
    """One sentence whose meaning has ``polarity`` (1 positive, 0 negative)."""
    negated = rng.random() < NEGATION_RATE
    # A negated opinion uses the opposite adjective: "not great" is negative.
    positive_word = (polarity == 1) != negated
    adjective = rng.choice(POSITIVE if positive_word else NEGATIVE)
    phrase = (
        f"{rng.choice(NEGATORS)} {adjective}"
        if negated
        else f"{rng.choice(INTENSIFIERS)}{adjective}"
    )
    template = rng.choice(OPINION_TEMPLATES)
    return template.format(aspect=rng.choice(ASPECTS), adj=phrase)


def make_review(rng: random.Random) -> dict[str, object]:
    """One labelled review: {label, title, content}."""
    label = rng.randint(0, 1)
    sentences = [_opinion(rng, label) for _ in range(OPINIONS)]
    for _ in range(rng.randint(0, 2)):
        sentences.insert(rng.randint(0, len(sentences)), rng.choice(FILLERS))
    product = rng.choice(PRODUCTS)
    sentences.insert(0, f"I got this {product}.")
    verdict = rng.choice(VERDICTS)
    if verdict:
        sentences.append(verdict)
    title_polarity = label if rng.random() < TITLE_AGREES else 1 - label
    title_word = rng.choice(POSITIVE if title_polarity else NEGATIVE)
    title = f"{title_word.capitalize()} {product}"
    if rng.random() < LABEL_NOISE:
        label = 1 - label
    return {"label": label, "title": title, "content": " ".join(sentences)}


def make_split(size: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    return [make_review(rng) for _ in range(size)]


def write_split(rows: list[dict[str, object]], path: Path, fmt: str) -> None:
    """Write ``rows`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    if fmt == "jsonl":
        with tmp.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    elif fmt == "csv":
        with tmp.open("w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["label", "title", "content"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(
            rows,
            schema=pa.schema(
                [("label", pa.int64()), ("title", pa.string()), ("content", pa.string())]
            ),
        )
        pq.write_table(table, tmp)
    tmp.replace(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="directory to write")
    parser.add_argument("--train-size", type=int, default=2000, help="training examples")
    parser.add_argument("--test-size", type=int, default=500, help="test examples")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--format", choices=FORMATS, default="jsonl", help="file format")
    args = parser.parse_args(argv)
    for name in ("train_size", "test_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.output.mkdir(parents=True, exist_ok=True)
        # Different seeds for the splits: the test set is not a copy of the training set.
        for split, size, seed in (
            ("train", args.train_size, args.seed * 2),
            ("test", args.test_size, args.seed * 2 + 1),
        ):
            path = args.output / f"{split}.{args.format}"
            write_split(make_split(size, seed), path, args.format)
            print(f"wrote {path} ({size} examples)")
    except OSError as exc:
        print(f"make_sample_data.py: error: {args.output}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
