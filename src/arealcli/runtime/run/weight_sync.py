"""Models whose weights follow another (`weights_from: actor`), e.g. a generation server copy of the actor.

After every step that trained a source model, its weights are exported (HF format, atomically) to
`<run_dir>/weights/<source>/v<version>` and every follower loads them through its backend's
`update_weights` — before the next step's generation. Only the newest `keep_last` exports are kept.
A follower's `version.global_step` is the source version it holds: generated samples record it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime import distributed
from arealcli.runtime.models.model import Model
from arealcli.runtime.run.checkpoint import is_disk_full
from arealcli.schema.recipe import Recipe


class WeightSync:
    def __init__(self, recipe: Recipe, models: dict[str, Model], tokenizer: Any, run_dir: Path, keep_last=2):
        self.models, self.tokenizer, self.run_dir, self.keep_last = models, tokenizer, run_dir, keep_last
        self.followers: dict[str, list[str]] = {}
        for name, spec in recipe.models.items():
            if spec.weights_from is not None:
                self.followers.setdefault(spec.weights_from, []).append(name)

    def versions(self) -> dict[str, int]:
        return {src: self.models[src].version.global_step for src in self.followers}

    def sync(self, before: dict[str, int] | None = None) -> dict[str, float]:
        """Push every source trained since `before` (all of them when None) to its followers."""
        stats: dict[str, float] = {}
        for src, followers in self.followers.items():
            version = self.models[src].version.global_step
            if before is not None and before.get(src) == version:
                continue
            t0 = time.perf_counter()
            path = self.export(src, version)
            for name in followers:
                follower = self.models[name]
                follower.backend.update_weights(follower, str(path), version)
                follower.version.global_step = version
            stats[f"timing/weight_sync_{src}_s"] = time.perf_counter() - t0
        return stats

    def export(self, src: str, version: int) -> Path:
        root = self.run_dir / "weights" / src
        final = root / f"v{version}"
        tmp = root / f".tmp-v{version}"
        if distributed.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        distributed.barrier()
        try:
            self.models[src].module.save_to_hf(self.tokenizer, str(tmp))  # collective for sharded backends
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e, root):
                raise UserError(
                    f"no space left on {root} while exporting {src}'s weights (version {version})"
                ) from None
            raise
        distributed.barrier()
        if distributed.rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            exports = {int(p.name[1:]): p for p in root.glob("v*") if p.name[1:].isdigit()}
            # Newer than this one: left by a run that went past the checkpoint it was resumed from.
            # Of the rest, the newest `keep_last` stay (this one always).
            newer = [p for v, p in exports.items() if v > version]
            kept = sorted(v for v in exports if v <= version)[-self.keep_last :]
            for v, old in exports.items():
                if old in newer or v not in kept:
                    shutil.rmtree(old, ignore_errors=True)
        distributed.barrier()
        return final
