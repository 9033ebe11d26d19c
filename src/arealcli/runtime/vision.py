"""Vision-language models: images in, token ids and position ids out.

A Qwen2-VL-family model reads an image as a run of placeholder tokens in its text: `<|vision_start|>`,
one `<|image_pad|>` per merged patch group, `<|vision_end|>`. The image processor cuts an image (resized
so both sides are multiples of patch_size * merge_size) into patches of patch_size^2 pixels: `pixel_values`
(patches, channels * temporal_patch_size * patch_size^2) and `image_grid_thw` (t, h, w) in patches; the
vision tower merges merge_size^2 neighbouring patches into one token, so the image takes
t * h * w / merge_size^2 `<|image_pad|>` tokens. The model's forward puts the tower's outputs at those
tokens, in order.

Positions are three-dimensional (M-RoPE): text tokens advance all three (time, height, width) together;
an image's tokens share the time of its start and take their row and column in the merged grid, and the
text after it continues at one past the largest position before. A sequence's positions are a function
of its own tokens and grids only (`positions`), so sequences packed side by side keep theirs.

In a batch (`SequenceSample`), the images ride with their sequences under `IMAGE_KEYS`: `pixel_values`
(one entry per patch) and `image_grid_thw` (one per image); a sample without images has none of either.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arealcli.errors import DataError

if TYPE_CHECKING:  # torch is imported where it is used: `areal check` reads images without it
    import torch

# The images of a vision-language batch: they go with their sequences wherever those go
# (`SequenceSample.select` keeps them).
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
IMAGE_MARK = "<image>"  # where an image goes in a prompt's text (no mark: the images come first)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
# how Qwen2-VL's own chat template writes one image: start, one pad, end
OWN_IMAGE_TEXT = VISION_TOKENS[0] + VISION_TOKENS[2] + VISION_TOKENS[1]
FORMATS = {"PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM"}
MAX_IMAGE_BYTES = 64 << 20
# the most pixels an image may have before it is decoded (a small file can hold a huge image): 32 Mpx is
# 5792 x 5792, far above what a vision-language model reads (its processor resizes to max_pixels)
MAX_IMAGE_PIXELS = 1 << 25


def text_config(config) -> Any:
    """The language model's config: a vision-language config's `text_config`, else the config itself."""
    return getattr(config, "text_config", None) or config


def base_module(module) -> Any:
    """The transformers model under a peft wrapper (or the module itself)."""
    get = getattr(module, "get_base_model", None)
    return get() if callable(get) else module


def is_vision(module) -> bool:
    """Whether the module is a vision-language model (its config has a `vision_config`)."""
    config = getattr(base_module(module), "config", None)
    return getattr(config, "vision_config", None) is not None


def config_is_vision(path: str | Path) -> bool:
    """Whether the model folder's config.json describes a vision-language model."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def vision_models(recipe, recipe_dir: Path) -> list[str]:
    """The models of a recipe that read images: a qwen2_vl config, a vision-language folder (local or in
    the Hugging Face cache), or a copy or follower of one (`base_of`, `weights_from`)."""
    from arealcli.schema.paths import locate

    def reads(name: str, seen: frozenset[str] = frozenset()) -> bool:
        m = recipe.models[name]
        if m.config is not None and m.config.family == "qwen2_vl":
            return True
        if m.path and (found := locate(m.path, recipe_dir)) is not None and config_is_vision(found):
            return True
        source = m.weights_from or m.base_of or m.init_from
        return source in recipe.models and source not in seen and reads(source, seen | {name})

    return [name for name in recipe.models if reads(name)]


def vision_model(recipe, recipe_dir: Path) -> str | None:
    """The first model of a recipe that reads images and is built from its own config or folder (see
    `vision_models`: its image processor is the run's), or None."""
    own = [n for n in vision_models(recipe, recipe_dir) if recipe.models[n].config or recipe.models[n].path]
    return next(iter(own), None)


# ---------------------------------------------------------------------- reading images


def open_image(value: Any, base_dir: Path):
    """An RGB PIL image from a dataset value: a path (relative to the data file's folder), a `data:` URL
    (base64), raw bytes, a `{"bytes": ..., "path": ...}` record (parquet, Hugging Face `Image` features)
    or a PIL image. Raises DataError saying what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str) and value.startswith("data:"):
        head, _, payload = value.partition(",")
        if ";base64" not in head:
            raise DataError("a data: URL image must be base64 (data:image/png;base64,...)")
        try:
            value = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise DataError("a data: URL image is not valid base64") from None
    if isinstance(value, str):
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise DataError(f"image {value} does not exist (looked for {path})")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise DataError(f"image {value} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
        value = path.read_bytes()
    if not isinstance(value, bytes | bytearray):
        kind = type(value).__name__
        raise DataError(f"an image must be a path, a data: URL, bytes or an image record, got {kind}")
    try:
        image = Image.open(io.BytesIO(value))
        if image.format not in FORMATS:
            raise DataError(f"image format {image.format} is not supported ({', '.join(sorted(FORMATS))})")
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise DataError(
                f"the image is {image.width} x {image.height} pixels: more than {MAX_IMAGE_PIXELS >> 20} Mpx"
            )
        image.load()
    except UnidentifiedImageError:
        raise DataError(f"not an image ({', '.join(sorted(FORMATS))} are read)") from None
    except (OSError, Image.DecompressionBombError) as e:
        raise DataError(f"not a readable image: {e}") from None
    return image.convert("RGB")


def sent_image(value: Any):
    """An RGB PIL image sent in a request: a `data:image/...;base64,` URL or bare base64 bytes. Nothing
    else: a server fetches no URL and reads no file for a client."""
    if isinstance(value, str) and not value.startswith("data:"):
        try:
            value = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise DataError(
                "an image in a request is a data: URL or base64 image bytes (this server fetches no URLs "
                "and reads no files)"
            ) from None
    if not isinstance(value, str | bytes):
        raise DataError(f"an image in a request is a data: URL or base64 text, got {type(value).__name__}")
    return open_image(value, Path("."))


def image_data_url(path: str | Path) -> str:
    """A local image file as a `data:` URL, checked to be an image first (DataError says what is wrong):
    how `areal chat --image` sends a picture, to a model here or to a server."""
    from PIL import Image

    file = Path(path).expanduser()
    open_image(str(file), Path.cwd())
    with Image.open(file) as raw:
        kind = (raw.format or "png").lower()
    return f"data:image/{kind};base64," + base64.b64encode(file.read_bytes()).decode()


def images_in(value: Any) -> list[Any]:
    """A row's image field as a list: one image, or a list of them (null: none)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


# ---------------------------------------------------------------------- encoding


@dataclass
class ImageEncoder:
    """Turns images into what a vision-language model reads: pixel patches, grids, placeholder tokens."""

    processor: Any  # a transformers image processor (Qwen2-VL's)
    image_token_id: int
    start_token_id: int
    end_token_id: int

    @property
    def merge_size(self) -> int:
        return int(getattr(self.processor, "merge_size", 2))

    def encode(self, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values (patches, D), image_grid_thw (n, 3)) of PIL images; empty for none."""
        import torch

        if not images:
            return torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    @property
    def patch_dim(self) -> int:
        p = self.processor
        return 3 * int(getattr(p, "temporal_patch_size", 2)) * int(getattr(p, "patch_size", 14)) ** 2

    def tokens(self, grid: torch.Tensor) -> list[int]:
        """The placeholder tokens of one image of grid (t, h, w)."""
        n = int(grid.prod()) // self.merge_size**2
        return [self.start_token_id, *[self.image_token_id] * n, self.end_token_id]

    def tokenize(self, tokenizer, text: str, grids: torch.Tensor) -> list[int]:
        """`text` tokenized with each image's placeholder tokens where its `IMAGE_MARK` is (in order), or,
        without marks, all of them before the text. The text pieces are tokenized apart (no special
        tokens added)."""
        pieces = text.split(IMAGE_MARK)
        n = grids.shape[0]
        if len(pieces) == 1:
            pieces = [""] * n + [text]
        elif len(pieces) - 1 != n:
            raise DataError(f"the prompt has {len(pieces) - 1} {IMAGE_MARK} marks for {n} images")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
            if i < n:
                ids += self.tokens(grids[i])
        return ids

    def prompt_ids(self, tokenizer, prompt: str | list[int], grids: torch.Tensor) -> list[int]:
        """A request's prompt with its images' placeholders: text with `IMAGE_MARK`s or the model's own
        `<|vision_start|><|image_pad|><|vision_end|>` per image (as Qwen2-VL's chat template writes
        them), or token ids holding one `<|image_pad|>` per image (expanded to the image's tokens) or
        already all of them."""
        n = grids.shape[0]
        if isinstance(prompt, str):
            return self.tokenize(tokenizer, prompt.replace(OWN_IMAGE_TEXT, IMAGE_MARK), grids)
        runs: list[tuple[int, int]] = []  # (start, length) of each run of image_token_id
        for i, t in enumerate(prompt):
            if t != self.image_token_id:
                continue
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        if len(runs) != n:
            raise DataError(f"the prompt has {len(runs)} runs of image tokens for {n} images")
        out: list[int] = []
        at = 0
        for (start, length), grid in zip(runs, grids, strict=True):
            want = int(grid.prod()) // self.merge_size**2
            if length not in (1, want):
                raise DataError(f"an image of {want} tokens has {length} placeholder tokens in the prompt")
            out += prompt[at:start] + [self.image_token_id] * want
            at = start + length
        return out + prompt[at:]

    def request(self, tokenizer, prompt: str | list[int], sent: list[Any]) -> tuple[list[int], Any]:
        """A request's prompt ids with its images' placeholders (`prompt_ids`), and the images as the model
        reads them: (pixel_values, image_grid_thw). `sent`: data: URLs or base64 (`sent_image`)."""
        pixels, grids = self.encode([sent_image(x) for x in sent])
        return self.prompt_ids(tokenizer, prompt, grids), (pixels, grids)


IMAGE_ENCODER = "arealcli_images"  # the attribute of a run's tokenizer that holds its ImageEncoder


def encoder_of(tokenizer) -> ImageEncoder | None:
    """The run's image encoder (set by `with_images` when a model reads images), or None."""
    return getattr(tokenizer, IMAGE_ENCODER, None)


def with_images(tokenizer, processor) -> Any:
    """Give the run's tokenizer an image encoder: `processor` with the tokenizer's vision tokens."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    unk = getattr(tokenizer, "unk_token_id", None)
    missing = [t for t, i in zip(VISION_TOKENS, ids, strict=True) if i is None or i == unk]
    if missing:
        raise DataError(f"the tokenizer has no {', '.join(missing)}: it cannot place images in text")
    start, end, pad = ids
    setattr(tokenizer, IMAGE_ENCODER, ImageEncoder(processor, pad, start, end))
    return tokenizer


def save_tokenizer(tokenizer, save_dir: str | Path) -> None:
    """`tokenizer.save_pretrained(save_dir)`, and the image processor of a run that reads images
    (preprocessor_config.json): a saved vision-language model folder reads images on its own."""
    tokenizer.save_pretrained(str(save_dir))
    encoder = encoder_of(tokenizer)
    if encoder is not None:
        encoder.processor.save_pretrained(str(save_dir))


def small_image_processor(patch_size: int = 14, merge_size: int = 2, max_pixels: int = 224 * 224):
    """Qwen2-VL's image processor (the Pillow one: no torchvision needed) for small images: any image of at
    least one merged patch group keeps its size (rounded to patch_size * merge_size)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = patch_size * merge_size
    return Qwen2VLImageProcessorPil(
        min_pixels=side * side, max_pixels=max_pixels, patch_size=patch_size, merge_size=merge_size
    )


def folder_image_processor(path: str | Path):
    """The image processor saved with a model (preprocessor_config.json), built as its Pillow variant."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    file = Path(path) / "preprocessor_config.json"
    if not file.is_file():
        raise DataError(f"{path} has no preprocessor_config.json: no image processor to read images with")
    config = json.loads(file.read_text())
    size = config.get("size") or {}
    keep = {
        k: config[k]
        for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
        if k in config
    }
    min_pixels = config.get("min_pixels", size.get("shortest_edge"))
    max_pixels = config.get("max_pixels", size.get("longest_edge"))
    if min_pixels is not None:
        keep["min_pixels"] = min_pixels
    if max_pixels is not None:
        keep["max_pixels"] = max_pixels
    return Qwen2VLImageProcessorPil(**keep)


# ---------------------------------------------------------------------- positions


def positions(module, ids: torch.Tensor, grids: torch.Tensor | None) -> torch.Tensor:
    """(3, L) M-RoPE position ids of one sequence `ids` (L,) whose images have `grids` (n, 3) in order."""
    import torch

    if grids is None or grids.shape[0] == 0:
        return torch.arange(ids.shape[0], device=ids.device).expand(3, -1)
    model = base_module(module).model
    image_token = base_module(module).config.image_token_id
    pos, _ = model.get_rope_index(
        ids[None], mm_token_type_ids=(ids == image_token).int()[None], image_grid_thw=grids.to(ids.device)
    )
    return pos[:, 0]


def placeholder_ids(module) -> list[int]:
    """The tokens that stand for image (and video) features: a sequence must hold exactly as many as its
    images have features, so generation never samples them, and the trainer's log-probs leave them out
    too (`placeholder_bias`): the policy is the model's distribution over the other tokens."""
    model = base_module(module)
    vocab = model.get_input_embeddings().num_embeddings
    ids = (model.config.image_token_id, getattr(model.config, "video_token_id", None))
    return [i for i in ids if i is not None and 0 <= i < vocab]


# The logit a placeholder token gets: exp() of it is 0 next to any real logit, and unlike -inf it keeps
# p * log p (entropies) at 0 rather than NaN.
EXCLUDED_LOGIT = -1e4


def placeholder_bias(module, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The LM head's bias with the placeholders (`placeholder_ids`) excluded: the distribution the
    trainer computes is the one generation samples from."""
    ids = placeholder_ids(module)
    if not ids:
        return bias
    out = weight.new_zeros(weight.shape[0]) if bias is None else bias.clone()
    out[ids] = EXCLUDED_LOGIT
    return out


def per_sample_images(mb) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """[(pixel_values, image_grid_thw)] of each sample of a batch with images, else None."""
    if "image_grid_thw" not in mb.data:
        return None
    return list(zip(mb.unpack("pixel_values"), mb.unpack("image_grid_thw"), strict=True))


def joined(
    images: Sequence[tuple[torch.Tensor, torch.Tensor] | None], order: list[int], device
) -> dict[str, torch.Tensor]:
    """The forward keywords of the images of samples `order` (their tokens in that order; None: a sample
    without images): pixel_values and image_grid_thw concatenated; nothing when none has an image."""
    import torch

    held = [x for x in (images[i] for i in order) if x is not None and x[1].shape[0]]
    if not held:
        return {}
    return {
        "pixel_values": torch.cat([x[0] for x in held]).to(device),
        "image_grid_thw": torch.cat([x[1] for x in held]).to(device),
    }


def stacked(images: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Several (pixel_values, image_grid_thw) of one sequence, in order, as one (at least one given: a
    sequence without images has empty ones, as `ImageEncoder.encode([])` makes them)."""
    import torch

    return torch.cat([x[0] for x in images]), torch.cat([x[1] for x in images])


def prompt_inputs(
    module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    images: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None,
    device,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """For a left-padded prompt batch ids (B, P) with mask `attn`: the prefill's image keywords, and the
    (3, B, P) M-RoPE positions, each row's last one its largest (so `pos[..., -1:] + 1` is where the
    next token goes)."""
    extra = joined(images, list(range(len(images))), device) if images else {}
    if not extra:
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        return {}, pos[None].expand(3, -1, -1)
    model = base_module(module)
    pos, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        image_grid_thw=extra["image_grid_thw"],
        attention_mask=attn,
    )
    return extra, pos
