"""Generate the visual task of the vision-language quickstart (deterministic: same seed, same files).

Each row is a small picture and a question about it:
  {"image": "images/train-0007.png", "prompt": "<image>colour:", "answer": "blue"}
The picture (28 x 28 pixels) is a filled square or disc of one of six colours (each channel jittered a
little) on a grey background of random brightness, at a random place and size. The answer is the shape's
colour name. Train and test pictures are drawn independently (no picture is in both).

Usage: python scripts/make_colour_data.py [--out data/colours] [--train 600] [--test 120] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
    "purple": (150, 50, 190),
    "orange": (240, 140, 30),
}
SIZE = 28


def picture(rng: random.Random, colour: tuple[int, int, int]):
    from PIL import Image, ImageDraw

    grey = rng.randint(60, 200)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    side = rng.randint(8, 18)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    fill = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in colour)
    draw = ImageDraw.Draw(image)
    box = (x, y, x + side - 1, y + side - 1)
    (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=fill)
    return image


def write_split(out: Path, split: str, n: int, rng: random.Random) -> None:
    names = sorted(COLOURS)
    rows = []
    for i in range(n):
        name = names[rng.randrange(len(names))]
        rel = f"images/{split}-{i:04d}.png"
        picture(rng, COLOURS[name]).save(out / rel, optimize=True)
        rows.append({"image": rel, "prompt": "<image>colour:", "answer": name})
    with open(out / f"{split}.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "data" / "colours"))
    p.add_argument("--train", type=int, default=600)
    p.add_argument("--test", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    write_split(out, "train", a.train, rng)
    write_split(out, "test", a.test, rng)
    print(f"wrote {a.train} + {a.test} rows to {out}")


if __name__ == "__main__":
    main()
