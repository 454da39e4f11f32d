"""Images in prompt data: reading a row's `images` column and turning a prompt with images into
what the model and the engines take (`ImagePrompts`).

A row's images are a list (or one value) of: a file path (relative to the data file's folder), a
`data:image/...;base64,` URI or bare base64, raw bytes, a `{"bytes": ...}` or `{"path": ...}` object
(the shape Hugging Face `datasets` Image columns and parquet exports hold), or a PIL image. The
prompt marks where each image goes: a chat content part `{"type": "image"}`, or the processor's
image marker (`<image>`) in the text; a prompt with fewer or more markers than images is a bad row.

Only raster formats are opened (`IMAGE_FORMATS`): Pillow would hand an EPS or PDF image to
Ghostscript, running the file's PostScript. An image is refused past `MAX_IMAGE_BYTES` before it is
read, and past `MAX_IMAGE_PIXELS` before it is decoded (a small file can claim a huge canvas).
"""

import base64
import binascii
import io
from pathlib import Path
from typing import Any, Mapping, Sequence

from torch import Tensor

from lightrft.datasets.validation import DatasetRowError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
MAX_IMAGE_BYTES = 64 * 2**20          # a file or a decoded base64 / bytes value
MAX_IMAGE_PIXELS = 36_000_000         # 6000 x 6000: far above what a vision encoder takes in


def image_values(row: Mapping, key: str, source: str, index: int) -> list:
    """The image entries of `row[key]`: [] when the field is absent or null (a text-only row), a
    list as is, any other value as a list of one."""
    value = row.get(key) if isinstance(row, Mapping) else None
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def open_image(value: Any, base_dir: Path | None, source: str, index: int, field: str):
    """The RGB PIL image an entry of an images column names (module doc), or a `DatasetRowError`
    naming `field` (e.g. "images[1]") and what was wrong."""
    from PIL import Image, UnidentifiedImageError

    def bad(reason: str, hint: str = "give a readable image file, its bytes, or base64 of them"):
        return DatasetRowError(source, index, field, reason, hint, kind="bad image")

    if isinstance(value, Image.Image):
        # An image object opened elsewhere decodes on first use: its format and size are checked first.
        if value.format is not None and value.format not in IMAGE_FORMATS:
            raise bad(f"an image in {value.format} format, which lightrft does not open (formats: "
                      f"{', '.join(IMAGE_FORMATS)})", "convert it to PNG or JPEG")
        _check_pixels(value, bad)
        return value.convert("RGB")
    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise bad(f"an image object needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, str):
        data = _base64_image(value)
        if data is None:
            path = Path(value).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            if not path.is_file():
                raise bad(f"no image file {str(path)!r} (and not base64)",
                          "give a path relative to the data file's folder, an absolute path, or base64")
            try:
                if path.stat().st_size > MAX_IMAGE_BYTES:
                    raise bad(f"{str(path)!r} is {path.stat().st_size / 2**20:.0f} MiB, over the "
                              f"{MAX_IMAGE_BYTES // 2**20} MiB an image may take", "resize or recompress it")
                data = path.read_bytes()
            except OSError as err:
                raise bad(f"cannot read {str(path)!r}: {err.strerror or err}") from None
        value = data
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise bad(f"expected a path, bytes, base64 or an image object, got {type(value).__name__}")
    if len(value) > MAX_IMAGE_BYTES:
        raise bad(f"the image is {len(value) / 2**20:.0f} MiB, over the {MAX_IMAGE_BYTES // 2**20} MiB an image "
                  "may take", "resize or recompress it")
    try:
        image = Image.open(io.BytesIO(bytes(value)), formats=IMAGE_FORMATS)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise bad(f"not a readable image in a format lightrft opens ({', '.join(IMAGE_FORMATS)}): "
                  f"{type(err).__name__}: {err}") from None
    with image:
        _check_pixels(image, bad)             # from the header, before anything is decoded
        try:
            image.load()
            return image.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise bad(f"not a readable image ({type(err).__name__}: {err})") from None


def _check_pixels(image, bad) -> None:
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise bad(f"the image is {width} x {height} pixels, over the {MAX_IMAGE_PIXELS:,} an image may have "
                  "(a vision encoder resizes it to far fewer)", "resize it before training")


def _base64_image(text: str) -> bytes | None:
    """The bytes of a data URI or of bare base64 text long enough to be an image, else None."""
    if text.startswith("data:"):
        head, _, payload = text.partition(",")
        if ";base64" not in head:
            return None
        text = payload
    elif len(text) < 64 or "." in text:
        return None                       # a path: base64 has no "." and an image takes more than 64 characters
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def flatten_image_parts(messages: list, marker: str, key: str, source: str, index: int) -> list:
    """`messages` with each content given as parts (`[{"type": "text", "text": ...}, {"type":
    "image"}]`) joined into one string, `marker` standing for each image part; string contents
    pass as they are. Malformed parts are row errors on `key[i].content`."""
    flat = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                where = f"{key}[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind == "image":
                    pieces.append(marker)
                else:
                    raise DatasetRowError(source, index, where,
                                          f"a content part must be {{'type': 'text', 'text': ...}} or "
                                          f"{{'type': 'image'}}, got {part!r:.60}", kind="bad chat message")
            message = {**message, "content": "".join(pieces)}
        flat.append(message)
    return flat


class ImagePrompts:
    """A model folder's processor and family, as the prompt dataset uses them: `expand` tokenises a
    prompt with its images (each marker becomes the image's placeholder run) and `media` computes
    the images' model inputs (`ModelFamily.image_media`). `marker` is the text that stands for one
    image in a prompt."""

    def __init__(self, processor: Any, family: Any):
        if not isinstance(getattr(processor, "image_token", None), str):
            raise ValueError(f"the processor {type(processor).__name__} names no image token, so prompts cannot "
                             "mark where an image goes")
        self.processor, self.family = processor, family
        self.marker, self.aliases = family.image_marker(processor)

    def with_markers(self, text: str) -> str:
        """`text` with each text that stands for an image marker (a bare `<image>` for a model
        whose marker is another) replaced by the model's marker."""
        for alias in self.aliases:
            if alias != self.marker:
                text = text.replace(alias, self.marker)
        return text

    def count_markers(self, text: str) -> int:
        return text.count(self.marker)

    def expand(self, text: str, images: Sequence, add_special_tokens: bool) -> list[int]:
        """The token ids of `text` with each image marker expanded to the image's placeholder run."""
        out = self.processor(text=[text], images=[list(images)] if images else None,
                             add_special_tokens=add_special_tokens)
        return [int(t) for t in out["input_ids"][0]]

    def marker_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of `text` with one image marker per image (what vLLM expands itself)."""
        return list(self.processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def media(self, images: Sequence) -> dict[str, Tensor]:
        """The model inputs of one prompt's images. Shape: per key, (N images (or tiles), ...)"""
        return self.family.image_media(self.processor, list(images))
