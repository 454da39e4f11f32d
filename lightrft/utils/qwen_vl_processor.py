"""`QwenVLImageText`: a Qwen-VL processor for images and text built from a model folder's
tokenizer and image processor, for machines where transformers' own cannot be built (its video
processor needs torchvision, which PyPI has no CPU build of for this torch)."""

import json
import os
from pathlib import Path

IMAGE_PAD = "<|image_pad|>"
# transformers' processor class of each model type, named in an export's processor_config.json.
PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     "qwen3_vl": "Qwen3VLProcessor"}


class QwenVLImageText:
    """A Qwen-VL processor for images and text where transformers' cannot be built (its video
    processor needs torchvision): the folder's tokenizer and image processor, each `<|image_pad|>`
    of a prompt expanded to its image's merged patch count, as `Qwen2_5_VLProcessor` does.
    `save_pretrained` writes both and names `processor_class` (transformers' processor for the
    model, e.g. "Qwen2_5_VLProcessor") in processor_config.json, which `AutoProcessor` builds where
    torchvision is."""

    image_token = IMAGE_PAD

    def __init__(self, tokenizer, image_processor, processor_class: str | None = None):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.merge = int(getattr(image_processor, "merge_size", 2))
        self.processor_class = processor_class

    def __call__(self, text: list[str], images: list[list] | None = None, add_special_tokens: bool = True, **_):
        if images is not None and len(images) != len(text):
            raise ValueError(f"{len(text)} texts and {len(images)} image lists")
        expanded = []
        for i, prompt in enumerate(text):
            pieces = prompt.split(IMAGE_PAD)
            grids = []
            if images is not None and images[i]:
                grids = self.image_processor(images=list(images[i]), return_tensors="pt")["image_grid_thw"].tolist()
            if len(grids) != len(pieces) - 1:
                raise ValueError(f"the text has {len(pieces) - 1} {IMAGE_PAD} markers for {len(grids)} images")
            out = pieces[0]
            for grid, piece in zip(grids, pieces[1:]):
                out += IMAGE_PAD * (grid[0] * grid[1] * grid[2] // self.merge ** 2) + piece
            expanded.append(out)
        return {"input_ids": [self.tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"] for t in expanded]}

    def save_pretrained(self, path: str | os.PathLike, **kwargs) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(path, **kwargs)
        self.image_processor.save_pretrained(path, **kwargs)
        if self.processor_class:
            (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": self.processor_class}) + "\n")
