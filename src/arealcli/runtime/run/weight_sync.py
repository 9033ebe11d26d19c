"""Models whose weights follow another (`weights_from: actor`), e.g. a generation server copy of the actor.

After every step that trained a source model, every follower gets its weights before the next step's
generation:
- in memory, when the follower's backend copies tensors (`local`) and the source's engine holds its
  weights whole in this process (hf): the source's tensors are copied into the follower's, no files.
  A LoRA source sends its base weights and adapters at the first update and the adapters alone after
  (the base does not train), to followers that apply adapters;
- otherwise through disk: the weights are exported (HF format, merged with LoRA, atomically) to
  `<run_dir>/weights/<source>/v<version>` and the follower loads them through its backend's
  `update_weights` (servers: `/update_weights_from_disk`, vLLM's reload). Only the newest `keep_last`
  exports are kept. A LoRA source's followers on servers that take adapter updates (embedded servers,
  `lora_updates: adapters`) get the base once, `weights/<source>/base`, and then the adapters alone,
  `weights/<source>/base/a<version>`, which the server merges into its copy of the base.
  `weight_sync/<source>_bytes` is what a step's update wrote.
A follower's `version.global_step` is the source version it holds: generated samples record it. A
follower with `follow_until: N` takes updates up to the source's version N and keeps those weights after
(a reference model frozen where an SFT warm-up ends); the trainer saves it in checkpoints.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime import distributed
from arealcli.runtime.models.model import Model
from arealcli.runtime.models.weights import WeightsInMemory
from arealcli.runtime.run.checkpoint import is_disk_full
from arealcli.schema.recipe import Recipe


def folder_bytes(path: Path) -> int:
    """Bytes of the files directly in `path` (an export, or an adapter update: what a follower reads)."""
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


class WeightSync:
    def __init__(self, recipe: Recipe, models: dict[str, Model], tokenizer: Any, run_dir: Path, keep_last=2):
        self.models, self.tokenizer, self.run_dir, self.keep_last = models, tokenizer, run_dir, keep_last
        self.followers: dict[str, list[str]] = {}
        self.until = {n: s.follow_until for n, s in recipe.models.items() if s.follow_until is not None}
        for name, spec in recipe.models.items():
            if spec.weights_from is not None:
                self.followers.setdefault(spec.weights_from, []).append(name)
        self.has_base: set[str] = set()  # followers holding a LoRA source's base: adapters suffice
        self.whole: dict[str, bool] = {}  # sources whose engine holds its weights whole in this process
        self.base_written: set[str] = set()  # LoRA sources whose base this run exported (adapter updates)

    def versions(self) -> dict[str, int]:
        return {src: self.models[src].version.global_step for src in self.followers}

    def sync(self, before: dict[str, int] | None = None) -> dict[str, float]:
        """Push every source trained since `before` (all of them when None) to its followers."""
        stats: dict[str, float] = {}
        for src, following in self.followers.items():
            version = self.models[src].version.global_step
            followers = [n for n in following if version <= self.until.get(n, version)]
            if not followers or (before is not None and before.get(src) == version):
                continue
            t0 = time.perf_counter()
            in_memory = [n for n in followers if self._in_memory(src, n)]
            on_disk = [n for n in followers if n not in in_memory]
            for name in in_memory:
                follower = self.models[name]
                follower.backend.update_weights_in_memory(follower, self.weights_for(src, name), version)
                follower.version.global_step = version
            adapters = [n for n in on_disk if self._adapters_only(src, n)]
            full = [n for n in on_disk if n not in adapters]
            written = 0
            # the base beside the adapters only for followers that merge them into it
            adapters_export = functools.partial(
                self.export_adapters, with_base=any(self._merges(n) for n in adapters)
            )
            for names, export in ((adapters, adapters_export), (full, self.export)):
                if not names:
                    continue
                path, nbytes = export(src, version)
                written += nbytes
                for name in names:
                    follower = self.models[name]
                    follower.backend.update_weights(follower, str(path), version)
                    follower.version.global_step = version
            stats[f"timing/weight_sync_{src}_s"] = time.perf_counter() - t0
            if on_disk:
                stats[f"weight_sync/{src}_bytes"] = float(written)
        return stats

    def _in_memory(self, src: str, name: str) -> bool:
        """Can the follower take the source's tensors in memory?"""
        if not getattr(self.models[name].backend, "weights_in_memory", False):
            return False
        if src not in self.whole:  # the same for the whole run: ask once
            probe = getattr(self.models[src].module, "weights_in_memory", None)
            self.whole[src] = probe is not None and probe(adapters_apart=True) is not None
        return self.whole[src]

    def _adapters_only(self, src: str, name: str) -> bool:
        """Does follower `name` take adapter-only updates of `src` (a LoRA model whose engine writes them)?"""
        engine = self.models[src].module
        return (
            getattr(self.models[name].backend, "applies_adapter_updates", False)
            and getattr(engine, "lora", False)
            and hasattr(engine, "save_adapter_update")
        )

    def _merges(self, name: str) -> bool:
        """Does follower `name` merge adapter updates into the base exported beside them (else it serves
        them apart, over the base weights its servers hold already)?"""
        return getattr(self.models[name].backend, "merges_adapters", True)

    def export_adapters(self, src: str, version: int, with_base: bool = True) -> tuple[Path, int]:
        """`weights/<src>/base/a<version>`: the adapters alone, applying to the base weights in
        `weights/<src>/base`, written (`with_base`: some follower merges into it) at the first update of
        this run (a resumed run writes it again)."""
        base = self.run_dir / "weights" / src / "base"
        engine = self.models[src].module
        written = 0
        if with_base and src not in self.base_written:
            written += folder_bytes(self._atomic(base, engine.save_base, src, version))
            self.base_written.add(src)
        final = self._atomic(base / f"a{version}", engine.save_adapter_update, src, version)
        self._prune(base, "a", version)
        return final, written + folder_bytes(final)

    def export(self, src: str, version: int) -> tuple[Path, int]:
        """`weights/<src>/v<version>`: an HF export (LoRA merged)."""
        root = self.run_dir / "weights" / src
        save = functools.partial(self.models[src].module.save_to_hf, self.tokenizer)  # collective if sharded
        final = self._atomic(root / f"v{version}", save, src, version)
        self._prune(root, "v", version)
        return final, folder_bytes(final)

    def _atomic(self, final: Path, write: Callable[[str], None], src: str, version: int) -> Path:
        """`write(folder)` into a temporary folder beside `final`, then renamed to it (rank 0 moves
        files; `write` runs on every rank, a collective for sharded backends). A full disk is the user's
        to fix: said, with nothing half-written left."""
        tmp = final.with_name(f".tmp-{final.name}")
        if distributed.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        distributed.barrier()
        try:
            write(str(tmp))
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e, final.parent):
                raise UserError(
                    f"no space left on {final.parent} while exporting {src}'s weights (version {version})"
                ) from None
            raise
        distributed.barrier()
        if distributed.rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        distributed.barrier()
        return final

    def _prune(self, root: Path, prefix: str, version: int) -> None:
        """Of the `<prefix><N>` folders in `root`, keep the newest `keep_last` up to `version` (this one
        always); newer ones were left by a run that went past the checkpoint it was resumed from."""
        if distributed.rank() == 0:
            found = {int(p.name[1:]): p for p in root.glob(f"{prefix}*") if p.name[1:].isdigit()}
            kept = sorted(v for v in found if v <= version)[-self.keep_last :]
            for v, old in found.items():
                if v not in kept:
                    shutil.rmtree(old, ignore_errors=True)
        distributed.barrier()

    def weights_for(self, src: str, name: str) -> WeightsInMemory:
        """What follower `name` needs of `src`'s weights now: all of them (LoRA merged), or, to a follower
        that applies adapters, a LoRA source's base and adapters once and then the adapters alone."""
        apart = getattr(self.models[name].backend, "applies_adapters", False)
        weights: WeightsInMemory = self.models[src].module.weights_in_memory(adapters_apart=apart)
        if weights.adapters is None:
            return weights
        if name in self.has_base:
            return WeightsInMemory(adapters=weights.adapters, lora_config=weights.lora_config)
        self.has_base.add(name)
        return weights
