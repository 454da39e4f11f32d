"""A toy image task with exact answers, for the vision-language quickstart, tests and benchmarks:
"what colour is the disc?", answered with one letter (r, g, b or y).

Images are drawn with PIL (one disc of random size and place on a light background, 56 x 56) and
written as PNG files next to the JSONL rows that name them, the layout `--image_key images` reads:
`{"input": "<image>Colour?", "images": ["images/train_00000.png"], "label": "r"}`. Nothing is
downloaded. `format_warm_start` teaches a tiny model the answer format (one of the four letters,
then the end token) on random answers, so RL starts from a policy that answers but knows nothing
about the images; `greedy_accuracy` measures held-out greedy answers.
"""

import json
import random
from pathlib import Path
from lightrft.utils.hf_api import LOAD_OPTIONS

COLOURS = {"r": (215, 40, 40), "g": (40, 170, 60), "b": (40, 80, 215), "y": (225, 200, 30)}
PROMPT = "<image>Colour?"
IMAGE_SIZE = 56


def draw_disc(colour: str, rng: random.Random):
    """A 56 x 56 RGB PIL image: one disc of `colour` (a key of COLOURS) on a light, slightly
    varying background, its radius and centre drawn from `rng`."""
    from PIL import Image, ImageDraw

    shade = rng.randint(225, 250)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (shade, shade, shade))
    radius = rng.randint(9, 20)
    x, y = rng.randint(radius, IMAGE_SIZE - radius), rng.randint(radius, IMAGE_SIZE - radius)
    ImageDraw.Draw(image).ellipse((x - radius, y - radius, x + radius, y + radius), fill=COLOURS[colour])
    return image


def colour_splits(out_dir: str | Path, n_train: int = 256, n_eval: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """Writes `out_dir`/train.jsonl and eval.jsonl with their PNG images under `out_dir`/images
    (paths in the rows are relative to `out_dir`); each split has the four colours in equal
    shares, shuffled. Returns the two JSONL paths."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for split, count in (("train", n_train), ("eval", n_eval)):
        letters = [list(COLOURS)[i % len(COLOURS)] for i in range(count)]
        rng.shuffle(letters)
        rows = []
        for i, letter in enumerate(letters):
            name = f"images/{split}_{i:05d}.png"
            draw_disc(letter, rng).save(out_dir / name)
            rows.append({"input": PROMPT, "images": [name], "label": letter, "output": letter})
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1]


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _load(folder: str | Path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **LOAD_OPTIONS)
    return model, processor


def _encode(processor, rows: list[dict], data_dir: Path, answers: list[str] | None = None) -> dict:
    """The processor's batch for `rows` (their images read from `data_dir`), prompts left-padded;
    with `answers`, each prompt followed by its answer and the end token (right-padded)."""
    from PIL import Image

    images = [[Image.open(data_dir / row["images"][0]).convert("RGB")] for row in rows]
    tokenizer = processor.tokenizer
    texts = [row["input"] for row in rows]
    if answers is not None:
        texts = [text + answer + tokenizer.eos_token for text, answer in zip(texts, answers)]
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


def format_warm_start(base: str | Path, out: str | Path, rows: list[dict], data_dir: str | Path, steps: int = 30,
                      lr: float = 3e-3, batch_size: int = 32, seed: int = 0) -> Path:
    """`base` trained for `steps` plain-PyTorch SFT steps on `rows` with *random* answers (a
    letter drawn uniformly, independent of the image), loss on the answer and end token only,
    saved to `out` with its processor: it learns to answer with one letter, not which one."""
    import torch

    data_dir = Path(data_dir)
    model, processor = _load(base)
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "right"
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    prompt_len = len(processor(text=[rows[0]["input"]], images=[[_blank()]])["input_ids"][0])
    for _ in range(steps):
        batch_rows = rng.sample(rows, min(batch_size, len(rows)))
        batch = _encode(processor, batch_rows, data_dir, [rng.choice(list(COLOURS)) for _ in batch_rows])
        labels = batch["input_ids"].clone()
        labels[:, :prompt_len] = -100                       # prompts are equal in length: the answer follows
        labels[batch["attention_mask"] == 0] = -100
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    tokenizer.padding_side = "left"
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return Path(out)


def _blank():
    from PIL import Image

    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))


def greedy_accuracy(folder: str | Path, rows: list[dict], data_dir: str | Path, batch_size: int = 64) -> float:
    """Fraction of `rows` whose greedy answer (up to 2 new tokens), stripped, is the row's label."""
    import torch

    model, processor = _load(folder)
    model.eval()
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    correct = 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            batch = _encode(processor, chunk, Path(data_dir))
            out = model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(text.strip() == row["label"] for text, row in zip(texts, chunk))
    return correct / len(rows)
