"""The model behind `areal serve`: a transformers causal LM, our KV-cache sampler, weights reloaded in place."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from arealcli.runtime import vision
from arealcli.runtime.generation import decoder as lean_decoder
from arealcli.runtime.generation import sampling as generation
from arealcli.runtime.generation.adapters import ADAPTER_CONFIG, Adapter, AdapterError, ServedAdapters
from arealcli.runtime.models.lora import apply_adapter_update, lora_scale
from arealcli.runtime.models.model import DTYPES, auto_class
from arealcli.runtime.models.value_head import is_classifier_dir
from arealcli.runtime.models.weights import load_state, own_names
from arealcli.runtime.wire.sglang import Sampling

Images = tuple[torch.Tensor, torch.Tensor]  # one prompt's (pixel_values, image_grid_thw)


@dataclass
class RowResult:
    output_ids: list[int]
    logprobs: list[float]
    stopped_by: int | str | None  # the stop token or stop text that ended the sample, if any


class ModelRunner:
    # the base weights adapter-only updates apply to: (its folder, its tensors), kept once read
    _lora_base: tuple[str, dict[str, torch.Tensor]] | None = None

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "float32"):
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        if not (Path(model_path) / "config.json").exists():
            raise FileNotFoundError(f"{model_path} is not a Hugging Face model directory (no config.json)")
        if is_classifier_dir(model_path):
            raise ValueError(
                "it holds a reward model (a sequence classifier), which scores responses and does not write "
                f"them; `areal eval {model_path}` reports its pairwise accuracy on preference pairs"
            )
        self.model_path = self.tokenizer_path = str(model_path)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        )
        self.dtype = DTYPES[dtype]
        config = AutoConfig.from_pretrained(model_path)
        module = auto_class(config).from_pretrained(model_path, dtype=self.dtype)
        tokenizer = self._load_tokenizer(model_path)
        if tokenizer is not None and vision.config_is_vision(model_path):  # reads images: its processor
            tokenizer = vision.with_images(tokenizer, vision.folder_image_processor(model_path))
        self._attach(module, config, tokenizer)

    @classmethod
    def in_memory(
        cls, module, tokenizer, name: str, device: str = "auto", dtype: str = "float32"
    ) -> ModelRunner:
        """A runner over a module already built in this process (the `local` backend): no files."""
        self = cls.__new__(cls)
        self.model_path = self.tokenizer_path = name
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        )
        self.dtype = DTYPES[dtype]
        self._attach(module.to(self.dtype), module.config, tokenizer)
        return self

    def _attach(self, module, config, tokenizer) -> None:
        self.module = module.to(self.device).eval()
        self.adapters = ServedAdapters(self.module)  # LoRA adapters requests pick by name (`load_adapter`)
        self.tokenizer = tokenizer
        # a vision-language model's image encoder (runtime/vision.py), None for a text model
        self.images = vision.encoder_of(tokenizer) if tokenizer is not None else None
        self.placeholders = vision.placeholder_ids(self.module) if vision.is_vision(self.module) else []
        self.vocab_size = self.module.get_input_embeddings().num_embeddings
        self.context_length = int(getattr(config, "max_position_embeddings", 1 << 20))
        self.model_type = getattr(config, "model_type", None)
        self.architectures = getattr(config, "architectures", None)
        eos = getattr(self.module.generation_config, "eos_token_id", None)
        eos = config.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)

    @staticmethod
    def _load_tokenizer(path: str):
        """The directory's tokenizer, or None (then only input_ids requests are served, like
        SGLang's --skip-tokenizer-init)."""
        from arealcli.runtime.data.tokenizer import from_directory

        if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        try:
            return from_directory(path)
        except Exception:  # an unloadable tokenizer must not stop a token-id server
            return None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer: send input_ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_texts(self, ids: list[int]) -> list[str] | None:
        return None if self.tokenizer is None else [self.tokenizer.decode([t]) for t in ids]

    def autocast(self):
        """The autocast context generation runs in (reduced precision on CUDA only)."""
        if self.dtype != torch.float32 and self.device.type == "cuda":
            return torch.autocast(self.device.type, dtype=self.dtype)
        return torch.autocast(self.device.type, enabled=False)

    def stop_ids(self, sampling: Sampling) -> set[int]:
        """The tokens that end a sample: the model's end tokens (unless ignore_eos) and stop_token_ids."""
        return (set() if sampling.ignore_eos else self.eos_ids) | set(sampling.stop_token_ids)

    def row_decoder(self) -> lean_decoder.RowDecoder | None:
        """A KV cache for continuous batching, or None when the module has no lean decoder (then batches
        run whole, through `generate`)."""
        if not lean_decoder.supports(self.module) or self.placeholders:
            return None
        dtype = next(self.module.parameters()).dtype
        if self.dtype != torch.float32 and self.device.type == "cuda":
            dtype = self.dtype
        return lean_decoder.RowDecoder(self.module, self.device, dtype)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        max_new_tokens: int,
        should_abort: Callable[[], bool],
        adapter: str | None = None,
        images: list[Images] | None = None,
    ) -> list[RowResult]:
        """Sample up to `max_new_tokens` for every prompt with the same params (and the same adapter, or
        the base); stops early on abort. `images`: each prompt's (pixel_values, image_grid_thw), whose
        placeholder tokens it holds (a vision-language model)."""
        eos = set() if sampling.ignore_eos else self.eos_ids
        g = sampling.hyperparameters(max_new_tokens)
        texts = None
        if sampling.stop:
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.model_path} has no tokenizer: stop texts need one (use stop_token_ids)"
                )
            texts = generation.StopTexts(sampling.stop, self.decode)
        with self.autocast(), self.adapters.use([adapter] * len(prompts)):
            res = generation.generate(
                self.module,
                prompts,
                g,
                eos,
                self.pad_id,
                self.device,
                should_abort=should_abort,
                stop_texts=texts,
                images=images,
            )
        stop = self.stop_ids(sampling)

        def stopped_by(ids: list[int], trunc: bool) -> int | str | None:
            if trunc or not ids:
                return None
            if ids[-1] in stop:
                return ids[-1]
            return texts.matched(ids) if texts is not None else None

        return [
            RowResult(ids, lps, stopped_by(ids, trunc))
            for ids, lps, trunc in zip(res.output_ids, res.logprobs, res.no_eos, strict=True)
        ]

    @torch.no_grad()
    def score(
        self,
        rows: list[tuple[list[int], int]],
        top_n: int = 0,
        g=None,
        adapter: str | None = None,
        images: list[Images | None] | None = None,
    ) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        """For each (ids, start), start >= 1: the log-prob of ids[p] after ids[:p] for p = start ..
        len(ids) - 1, and (top_n > 0) the top_n most likely tokens there as (token, log-prob), best first.
        One forward pass over ids (no cache; rows right-padded into batches of a bounded size), the
        log-softmax in fp32: the model's own distribution, or with `g` (GenerationHyperparameters) the one
        sampling draws from (temperature, top-k, top-p). A row with `images` is scored alone, with them;
        a vision-language model's image placeholders are never a next token (as in generation)."""
        budget = max(1024, (1 << 29) // max(1, self.vocab_size))  # tokens per forward: bounds the logits
        out: list[tuple[list[float], list[list[tuple[int, float]]]]] = []
        at = 0
        while at < len(rows):
            end, longest = at + 1, len(rows[at][0])
            alone = images is not None and images[at] is not None
            while (
                not alone
                and end < len(rows)
                and (images is None or images[end] is None)
                and max(longest, len(rows[end][0])) * (end - at + 1) <= budget
            ):
                longest = max(longest, len(rows[end][0]))
                end += 1
            with self.adapters.use([adapter] * (end - at)):
                out += self._score_batch(rows[at:end], top_n, g, images[at] if alone and images else None)
            at = end
        return out

    def _score_batch(self, rows: list[tuple[list[int], int]], top_n: int, g, image: Images | None) -> list:
        L = max(len(ids) for ids, _ in rows)
        batch = torch.full((len(rows), L), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(rows), L, dtype=torch.long, device=self.device)
        for b, (ids, start) in enumerate(rows):
            if not 1 <= start <= len(ids):
                raise ValueError(f"score: start must be in [1, {len(ids)}] (got {start})")
            batch[b, : len(ids)] = torch.tensor(ids, device=self.device)
            mask[b, : len(ids)] = 1
        padded = any(len(ids) < L for ids, _ in rows)  # right padding: real tokens see only real ones
        seeing = {}
        if image is not None:  # one row: its pixels, and positions from its image grid
            seeing = vision.joined([image], [0], self.device)
            seeing["position_ids"] = vision.positions(self.module, batch[0], seeing.get("image_grid_thw"))[
                :, None
            ]
        with self.autocast():
            logits = self.module(
                input_ids=batch, attention_mask=mask if padded else None, use_cache=False, **seeing
            ).logits
        if self.placeholders:
            logits[..., self.placeholders] = vision.EXCLUDED_LOGIT
        results = []
        for b, (ids, start) in enumerate(rows):
            lps: list[float] = []
            tops: list[list[tuple[int, float]]] = []
            for lo in range(start, len(ids), 1024):  # positions in chunks: fp32 copies stay small
                hi = min(lo + 1024, len(ids))
                lg = logits[b, lo - 1 : hi - 1].float()
                logp = torch.log_softmax(lg if g is None else generation.process_logits(lg, g), dim=-1)
                target = torch.tensor(ids[lo:hi], device=logp.device)
                lps += logp.gather(-1, target[:, None])[:, 0].tolist()
                if top_n > 0:
                    values, best = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
                    tops += [
                        list(zip(t, v, strict=True))
                        for t, v in zip(best.tolist(), values.tolist(), strict=True)
                    ]
            results.append((lps, tops))
        return results

    def load_weights(self, path: str, root: str | None = None) -> None:
        """Load an HF export in place; every tensor is read and checked first, so a bad directory leaves
        the weights untouched. With `root` (a server confined to one folder), see `read_folder`.

        A folder holding a LoRA adapter (peft's format: a LoRA run's adapter-only update) applies to the
        base weights in the folder above it: that base is read once (and again when an update names
        another), kept, and each update loads W + (B A) * scale into the adapted layers; the base itself
        is never rebuilt or re-read."""
        state, adapter = read_folder(path, root)
        if adapter is not None:
            self._apply_adapters(path, state, lora_scale(adapter), root)
            return
        state = own_names(self.module, state)  # a vision-language model's saved names
        self._check_fits(path, state)
        load_state(self.module, state, f"weights {path}")
        self.model_path = str(path)
        self._lora_base = None  # a full load: the next adapter update reads its base again

    def load_adapter(self, name: str, path: str, root: str | None = None, version: str = "") -> Adapter:
        """Serve the LoRA adapter in folder `path` (peft's format, or a LoRA run's adapter-only update) as
        `name`, beside the base and the other adapters; a new folder under a served name replaces it. Read
        like weights (`read_weights`: confined below `root` when given) and checked before it is served."""
        state, config = read_folder(path, root)
        if config is None:
            raise AdapterError(f"{path} has no {ADAPTER_CONFIG}: not a LoRA adapter folder (peft's format)")
        return self.adapters.add(name, path, state, config, version)

    def _apply_adapters(
        self, path: str, update: dict[str, torch.Tensor], scale: float, root: str | None
    ) -> None:
        base_dir = os.path.dirname(os.path.normpath(path))
        fresh = self._lora_base is None or self._lora_base[0] != base_dir
        base = (base_dir, read_weights(base_dir, root)) if fresh else self._lora_base
        assert base is not None
        if fresh:
            self._check_fits(base_dir, base[1])
        # checked against the base before anything loads
        merged = apply_adapter_update(base[1], update, scale)
        own = self.module.state_dict()
        wrong = [k for k, v in merged.items() if k not in own or tuple(own[k].shape) != tuple(v.shape)]
        if wrong:
            raise ValueError(f"the adapter update in {path} does not fit the served model: {wrong[:5]}")
        if fresh:  # the base under the layers the adapters leave alone (embeddings, norms)
            load_state(self.module, base[1], f"weights {base_dir}")
        with torch.no_grad():
            for key, value in merged.items():
                own[key].copy_(value)
        self._lora_base = base
        self.model_path = str(path)

    def _check_fits(self, path: str, state: dict[str, torch.Tensor]) -> None:
        own = {k: tuple(v.shape) for k, v in self.module.state_dict().items()}
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        unexpected = sorted(set(shapes) - set(own))
        missing = sorted(k for k in set(own) - set(shapes) if not k.endswith("lm_head.weight"))
        wrong = sorted(k for k in set(own) & set(shapes) if own[k] != shapes[k])
        if unexpected or missing or wrong:
            raise ValueError(
                f"the weights in {path} do not fit the served model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
            )


class WeightsRefused(PermissionError):
    """A weight folder a confined server does not load from (outside its root, or a symbolic link)."""


def read_weights(path: str, root: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files of folder `path` (see `read_folder`)."""
    return read_folder(path, root)[0]


def read_folder(path: str, root: str | None = None) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Every tensor of the `*.safetensors` files of folder `path`, and its adapter_config.json when it
    holds one (a LoRA adapter in peft's format), else None.

    The folder is opened once, and its files are opened through that open folder (never by path again),
    so what is checked is what is read. With `root`: neither the folder nor a file in it may be a symbolic
    link (O_NOFOLLOW), and the opened folder's real location (the kernel's, /proc/self/fd) must lie below
    `root`'s: swapping the folder or a file for a link, before or after any check, cannot make the server
    read from elsewhere. Without `root` (a server not confined) links are followed (e.g. a Hugging Face
    cache snapshot, whose files are links).

    Refusals (confined only) raise WeightsRefused; a folder that does not exist, or has no weights,
    FileNotFoundError; any other failure to open an OSError that says why (its strerror)."""
    nofollow = os.O_NOFOLLOW if root is not None else 0
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | nofollow)
    except OSError as e:
        if root is not None and (
            e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and os.path.islink(path))
        ):
            raise WeightsRefused(
                f"{path} is a symbolic link: this server loads no weights through links"
            ) from None
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(f"no *.safetensors weights in {path}: it does not exist") from None
        raise OSError(f"cannot open the weight folder {path}: {e.strerror}") from None
    try:
        if root is not None:
            where = os.readlink(f"/proc/self/fd/{folder}")
            if not Path(where).is_relative_to(os.path.realpath(root)):
                raise WeightsRefused(
                    f"{path} is not below {root}: this server loads weights only from below it"
                )
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        state: dict[str, torch.Tensor] = {}
        for name in names:
            state.update(_read_file(folder, name, path, nofollow))
        return state, _read_config(folder, path, nofollow)
    finally:
        os.close(folder)


def _open_in(folder: int, name: str, path: str, nofollow: int) -> int:
    """File `name` of the open folder `folder`, opened for reading without blocking (O_NONBLOCK: no effect
    on a regular file, so that a FIFO named like weights is refused at once rather than holding the update
    lock forever waiting for a writer), and checked to be a regular file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | nofollow, dir_fd=folder)
    except OSError as e:
        if nofollow and e.errno == errno.ELOOP:
            raise WeightsRefused(
                f"{path}/{name} is a symbolic link: this server loads no weights through links"
            ) from None
        if e.errno == errno.ENOENT:
            raise
        raise OSError(f"cannot open {path}/{name}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}/{name} is not a regular file")
    return fd


def _read_config(folder: int, path: str, nofollow: int) -> dict | None:
    """The folder's adapter_config.json (a LoRA adapter), or None when it has none."""
    try:
        fd = _open_in(folder, ADAPTER_CONFIG, path, nofollow)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(1 << 20)
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}/{ADAPTER_CONFIG} is not a JSON object")
    return config


def _read_file(folder: int, name: str, path: str, nofollow: int) -> dict[str, torch.Tensor]:
    """The tensors of file `name` of the open folder `folder`, read through one open file."""
    from safetensors.torch import load, load_file

    fd = _open_in(folder, name, path, nofollow)
    try:
        opened = f"/proc/self/fd/{fd}"  # this very file (mapped, not copied), whatever its name is now
        if os.path.exists(opened):
            return load_file(opened)
        with os.fdopen(os.dup(fd), "rb") as f:  # no /proc: read it whole
            return load(f.read())
    finally:
        os.close(fd)
