"""The trainer: setup (models, backends, interfaces, data), the step loop, checkpoints, close.

Data parallel when torch.distributed is initialized (`areal train --nproc-per-node N`): every rank
builds the same models, takes its contiguous slice of each step's global batch (`dataset.batch_size`
prompts, whatever the world size) and of each evaluation batch; stats are averaged over ranks; rank 0
alone writes metrics, samples and checkpoint metadata, while every rank takes part in the (collective)
saves of the backends.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from arealcli.errors import TrainingDiverged, UserError
from arealcli.runtime import distributed
from arealcli.runtime.backends.base import source_lora
from arealcli.runtime.data.datasets import Batches
from arealcli.runtime.data.tokenizer import load_tokenizer, vocabulary_mismatch
from arealcli.runtime.engines.base import Engine
from arealcli.runtime.models.model import FinetuneSpec, Model, ModelSource, base_model_view, build_module
from arealcli.runtime.models.weights import load_hf_weights, load_plain
from arealcli.runtime.registry import make_backend, make_dataset, make_interface
from arealcli.runtime.run import checkpoint as ckpt
from arealcli.runtime.run.dataflow import Call, feeding_calls, run_calls
from arealcli.runtime.run.metrics import JSONLSink, MetricLogger, WandbSink, tensorboard_sink
from arealcli.runtime.run.rollout import RolloutProducer
from arealcli.runtime.run.session import given_servers
from arealcli.runtime.run.targets import step_of
from arealcli.runtime.run.weight_sync import WeightSync
from arealcli.schema.components.datasets import PAIR
from arealcli.schema.recipe import ModelSpec, Recipe, VisionArchConfig, on_rollout_side


def model_seeds(recipe: Recipe) -> dict[str, int]:
    """Each model's weight seed: the recipe's seed plus its place in the build order."""
    return {name: recipe.seed + i for i, name in enumerate(model_build_order(recipe))}


def model_build_order(recipe: Recipe) -> list[str]:
    """Models after the models they are initialized from (`areal check` has ruled out cycles)."""
    order: list[str] = []
    while len(order) < len(recipe.models):
        ready = [
            name
            for name, spec in recipe.models.items()
            if name not in order
            and all(src is None or src in order for src in (spec.init_from, spec.base_of))
        ]
        if not ready:
            raise UserError(f"init_from forms a cycle among {sorted(set(recipe.models) - set(order))}")
        order.extend(ready)
    return order


@dataclass
class Hooks:
    """What the driver plugs into a run: the console, stop signals, the thread policy."""

    progress: Callable[..., None] | None = None  # (step, total, stats, log_now) after every step
    stop_requested: Callable[[], None] | None = None  # before each step: raises when a stop was signalled
    thread_policy: Any = None  # runtime.threads.ThreadPolicy: torch threads follow the free cores
    note: Callable[[str], None] | None = None  # a line for the console (a generation server restarted)


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        recipe_dir: Path,
        run_dir: Path,
        resume: bool = False,
        progress=None,
        hooks: Hooks | None = None,
    ):
        self.recipe, self.recipe_dir, self.run_dir, self.resume = recipe, recipe_dir, run_dir, resume
        hooks = hooks or Hooks()
        self.progress = progress or hooks.progress
        self.stop_requested = hooks.stop_requested
        self.thread_policy = hooks.thread_policy
        self.note = hooks.note
        self.global_step = 0
        self.rank, self.world = distributed.rank(), distributed.world()
        self.saved_step: int | None = None
        self.ckpt_root = run_dir / "checkpoints"
        self.notes: list[str] = []
        self.models: dict[str, Model] = {}
        self.calls: list[Call] = []
        self.logger: MetricLogger | None = None
        self.producer: RolloutProducer | None = None
        self.resumed_from: Path | None = None

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        seed_rank(self.recipe.seed, self.rank)  # weights are seeded per model (the same on every rank)
        resume_from = self._setup_resume_point() if self.resume else None
        self._setup_data()
        self._setup_models(resume_from)
        self._setup_calls()
        if resume_from is not None:
            self._restore_trainer_state(resume_from)
        self.resumed_from = resume_from
        if resume_from is not None and self.global_step >= self.total_steps:
            return  # a finished run: nothing to train, no log or tracker to open
        self._setup_logging()
        # models with `weights_from` start from their source's current (possibly resumed) weights
        self.weight_sync = WeightSync(self.recipe, self.models, self.tokenizer, self.run_dir)
        self.weight_sync.sync()
        self._setup_rollout()
        if self.rank == 0 and not (self.resume and (self.run_dir / "recipe.yaml").exists()):
            write_resolved_recipe(self.recipe, self.run_dir, self.recipe_dir)  # no record of a failed start

    def _setup_resume_point(self) -> Path:
        """The newest intact checkpoint; damaged newer ones are set aside (kept for inspection)."""
        resume_from, damaged = ckpt.resume_checkpoint(self.ckpt_root, cleanup=self.rank == 0)
        for problem in damaged:
            self.notes.append(f"skipping a damaged checkpoint: {problem}; resuming from {resume_from.name}")
        distributed.barrier()
        if self.rank == 0:  # never picked up or pruned in its place
            for problem in damaged:
                bad = Path(problem.split(": ", 1)[0])
                bad.rename(bad.with_name(f"damaged-{bad.name}"))
        return resume_from

    def _setup_data(self) -> None:
        r = self.recipe
        self.tokenizer = recipe_tokenizer(r, self.recipe_dir)
        self.dataset = make_dataset(r.dataset, self.tokenizer, str(self.recipe_dir))
        self.notes += getattr(self.dataset, "notes", [])  # rows dropped or cut, for the console
        self.batches = Batches(self.dataset, r.dataset.batch_size, r.dataset.shuffle, r.seed)
        self.eval_batches = None
        if r.eval_dataset is not None:
            eval_ds = make_dataset(r.eval_dataset, self.tokenizer, str(self.recipe_dir))
            self.notes += getattr(eval_ds, "notes", [])
            self.eval_batches = Batches(eval_ds, min(r.eval_dataset.batch_size, len(eval_ds)), False, r.seed)
        epochs_steps = r.trainer.total_train_epochs * self.batches.steps_per_epoch
        self.total_steps = r.trainer.max_steps or epochs_steps

    def _setup_models(self, resume_from: Path | None) -> None:
        """Every model through its backend, sources before the models built from them; trained models
        get their checkpointed weights and backend state on resume."""
        r = self.recipe
        spec = FinetuneSpec(
            r.trainer.total_train_epochs,
            len(self.dataset),
            r.dataset.batch_size,
            self.total_steps,
            run_dir=str(self.run_dir),
        )
        self.trained = {c.model for c in r.dataflow.calls if c.type == "train_step" and c.model}
        # followers that stop following (`follow_until`): their weights are the run's to keep, saved
        self.kept = {name for name, m in r.models.items() if m.follow_until is not None}
        order = model_build_order(r)
        seeds = model_seeds(r)
        backends = {
            name: make_backend(given_servers(name, r.models[name].backend))
            for name in order
            if not r.models[name].base_of
        }
        specs = {name: resolved_spec(r, self.recipe_dir, name) for name in backends}
        for name, model_spec in specs.items():  # one vocabulary: a teacher or reward model reads our ids
            problem = model_spec.path and vocabulary_mismatch(self.tokenizer, model_spec.path)
            if problem:
                raise UserError(f"model {name!r}: {problem}")

        raw: dict[str, Any] = {}
        eager = self._eager_models(backends)
        for name in order:  # sources first: a model initialized from another copies its module as built
            if name in eager:
                source = specs[name].init_from
                raw[name] = build_module(
                    specs[name], self.tokenizer, seeds[name], raw.get(source) if source is not None else None
                )
        for name in order:
            base_of = r.models[name].base_of
            if base_of is not None:  # e.g. the reference model: the actor with adapters off
                self.models[name] = base_model_view(name, self.models[base_of])
                continue
            model = Model(name, raw.get(name), self.tokenizer, seed=seeds[name])
            # built anew on demand (seeded: the same module every time, in every process)
            model.source = ModelSource(
                specs[name], functools.partial(initial_module, r, self.recipe_dir, self.tokenizer, name)
            )
            backends[name].source_lora = source_lora(r, name)
            self.models[name] = self._initialize(backends[name], model, spec, resume_from)
        self.notes += stateless_engines(self.models, self.trained)
        if r.dataset.batch_size % distributed.dp_world():  # known once the backends are set up
            raise ValueError(batch_size_problem(r.dataset.batch_size, distributed.dp_world()))

    def _eager_models(self, backends: dict[str, Any]) -> set[str]:
        """Models whose torch module the trainer builds: those whose backend does not build its own
        weights, and the models they are initialized from."""
        eager = {name for name, backend in backends.items() if not backend.builds_weights}
        for name in reversed(model_build_order(self.recipe)):
            source = self.recipe.models[name].init_from
            if name in eager and source:
                eager.add(source)
        return eager

    def _initialize(self, backend, model: Model, spec: FinetuneSpec, resume_from: Path | None) -> Model:
        if resume_from is not None and model.name in self.kept:  # as saved; following again if not past N
            model = backend.initialize(model, spec)
            with ckpt.reading(resume_from / model.name):
                model.backend.update_weights(model, str(resume_from / model.name), 0)
            return model
        if resume_from is None or model.name not in self.trained:  # nothing to resume
            return backend.initialize(model, spec)
        if not backend.resumes_weights:
            with ckpt.reading(resume_from / model.name):
                load_hf_weights(model.module, resume_from / model.name)
        model = backend.initialize(model, spec)
        with ckpt.reading(resume_from / model.name):
            model.backend.load(model, str(resume_from / model.name))
        return model

    def _setup_calls(self) -> None:
        """One interface object per model and interface spec, shared by the calls that name them (the
        actor's generate, log-prob and train calls are one PPO actor); weightless calls get their own."""
        weightless = Model("<weightless>", None, self.tokenizer)  # for calls with `model: null`
        shared: dict[tuple[str, str], Any] = {}
        self.calls = []
        for c in self.recipe.dataflow.calls:
            key = (c.model or f"<call {c.name}>", c.interface.model_dump_json())
            if key not in shared:
                shared[key] = make_interface(c.interface)
            self.calls.append(Call(c, shared[key], self.models[c.model] if c.model else weightless))

    def _restore_trainer_state(self, resume_from: Path) -> None:
        """Step counters, model versions, interface state (KL controllers) and every rank's RNG."""
        with ckpt.reading(resume_from / "trainer_state.pt"):
            # tensors and plain data only: a crafted file cannot construct objects (run code) here
            state = load_plain(resume_from / "trainer_state.pt")
        self.global_step = state["global_step"]
        for name, version in state["versions"].items():
            self.models[name].version.__dict__.update(version)
        for call, cstate in zip(self.calls, state["interfaces"], strict=True):
            if cstate is not None:
                call.interface.load_state_dict(cstate)
        per_rank = state.get("rng_per_rank") or [state["rng"]]
        if self.rank < len(per_rank):
            ckpt.set_rng_state(per_rank[self.rank])
        else:  # more ranks than the checkpoint had: a fresh, deterministic stream
            seed_rank(self.recipe.seed + self.global_step, self.rank)
        self.saved_step = self.global_step
        if self.rank == 0:
            drop_metrics_after(self.run_dir / "metrics.jsonl", self.global_step)

    def _setup_logging(self) -> None:
        """metrics.jsonl, TensorBoard and W&B on rank 0 (the other ranks log nowhere)."""
        r = self.recipe
        sinks: list[Any] = []
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            sinks.append(JSONLSink(self.run_dir / "metrics.jsonl"))
            if r.trainer.tensorboard:
                tb = tensorboard_sink(self.run_dir / "tensorboard")
                if tb is None:
                    self.notes.append(
                        "no TensorBoard events: tensorboard is not installed (pip install tensorboard)"
                    )
                else:
                    sinks.append(tb)
            if r.trainer.wandb is not None:
                sinks.append(
                    WandbSink(r.trainer.wandb, r.experiment, self.run_dir, r.model_dump(mode="json"))
                )
        self.logger = MetricLogger(sinks)

    def _setup_rollout(self) -> None:
        """Asynchronous RL: the rollout side runs ahead on its own threads."""
        self.train_calls = self.calls
        if self.recipe.rollout is not None:
            self.producer = RolloutProducer(
                self.calls,
                self.data_batch,
                self.recipe.rollout.max_staleness,
                self.global_step,
                self.total_steps,
            )
            self.train_calls = [c for c in self.calls if not on_rollout_side(c.spec)]

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float]:
        t = self.recipe.trainer
        logger = self.logger
        assert logger is not None, "setup() comes first"
        last: dict[str, float] = {}
        if self.producer is not None:
            self.producer.start_producing()
        if t.eval_at_start and self.global_step == 0 and self.eval_batches is not None:
            last.update(self.evaluate())
            logger.log(0, last)
        while self.global_step < self.total_steps:
            if self.stop_requested is not None:
                # a stop signal whose exception was swallowed where it landed (e.g. in a finalizer run by
                # the garbage collector, which Python only prints) is raised again here
                self.stop_requested()
            epoch, epoch_step = divmod(self.global_step, self.batches.steps_per_epoch)
            for m in self.models.values():
                m.version.epoch, m.version.epoch_step = epoch, epoch_step
            t0 = time.perf_counter()
            before = self.weight_sync.versions()
            if self.producer is not None and self.producer.needed(self.global_step):
                batch, stats = self.producer.take(self.global_step)  # generated ahead, within the bound
                batch, train_stats = run_calls(self.train_calls, batch, self.global_step)
                stats.update(train_stats)
            else:
                batch, stats = run_calls(self.calls, self.data_batch(self.global_step), self.global_step)
            stats.update(self.weight_sync.sync(before))  # followers get the new weights before generating
            stats.update(self._faults())
            self.global_step += 1
            if t.samples_every_n_steps and self.global_step % t.samples_every_n_steps == 0:
                rows = distributed.all_gather_object(sample_rows(batch, self.tokenizer))
                if self.rank == 0:
                    write_samples(
                        self.run_dir / "samples" / f"step_{self.global_step:08d}.jsonl",
                        [row for part in rows for row in part],
                    )
            stats.update({"epoch": epoch, "timing/step_s": time.perf_counter() - t0})
            if self.thread_policy is not None:
                stats["sys/torch_threads"] = float(self.thread_policy.update())
                stats["sys/other_load"] = self.thread_policy.other_load
            stats = distributed.mean_over_ranks(stats)
            check_finite(stats, self.global_step, self.saved_step)
            last_step = self.global_step == self.total_steps
            if t.eval_every_n_steps and (self.global_step % t.eval_every_n_steps == 0 or last_step):
                stats.update(self.evaluate())
            log_now = self.global_step % t.log_every_n_steps == 0 or self.global_step == self.total_steps
            if log_now:
                logger.log(self.global_step, stats)
            if self.progress is not None:
                self.progress(self.global_step, self.total_steps, stats, log_now)
            last = stats
            if t.save_every_n_steps and self.global_step % t.save_every_n_steps == 0:
                self.save()
            if self.producer is not None:
                self.producer.publish(self.global_step)  # the next batches may start generating
        if self.saved_step != self.global_step:
            self.save()
        self.write_report()
        return last

    def _faults(self) -> dict[str, float]:
        """Generation servers restarted (or back) since the last step: said on the console, counted; and
        what interfaces have to say (a judge whose replies cannot be read)."""
        totals: dict[str, float] = {}
        for model in self.models.values():
            take = getattr(model.module, "take_faults", None)
            if take is None:
                continue
            lines, counts = take()
            self._say(lines)
            for k, v in counts.items():
                totals[k] = totals.get(k, 0.0) + v
        for call in self.calls:
            notes = getattr(call.interface, "take_notes", None)
            if notes is not None:
                self._say([f"step {self.global_step + 1}, call {call.spec.name}: {line}" for line in notes()])
        return totals

    def _say(self, lines: list[str]) -> None:
        for line in lines:
            if self.note is not None:
                self.note(line)
            else:
                logging.getLogger(__name__).warning(line)

    def describe(self, recipe_path: Path) -> list[tuple[str, str]]:
        """The header lines: what runs, where, how long."""
        r = self.recipe
        models = []
        for name, spec in r.models.items():
            source = spec.path or (f"init_from {spec.init_from}" if spec.init_from else None)
            if spec.config is not None:
                c = spec.config
                source = f"{c.family} {c.hidden_size}x{c.num_hidden_layers} from config"
            follow = f", follows {spec.weights_from}" if spec.weights_from else ""
            if spec.base_of:
                source, follow = f"base of {spec.base_of}, adapters off", ""
            models.append(
                f"{name} ({source}; {spec.backend.type_ if not spec.base_of else 'shared'}{follow}{_params(self.models.get(name))})"
            )
        calls = " -> ".join(
            c.name
            + (
                f"[{c.start_step}..{c.end_step - 1}]"
                if c.end_step
                else f"[{c.start_step}..]"
                if c.start_step
                else ""
            )
            for c in r.dataflow.calls
        )
        t = r.trainer
        rows = "pairs" if PAIR in getattr(self.dataset, "provides", ()) else "prompts"  # preference data
        cadence = [f"{self.total_steps} steps"]
        if t.eval_every_n_steps:
            cadence.append(f"eval every {t.eval_every_n_steps}")
        if t.save_every_n_steps:
            cadence.append(f"save every {t.save_every_n_steps}")
        lines = [
            ("experiment", f"{r.experiment}  ({recipe_path})"),
            ("run dir", str(self.run_dir)),
            ("models", "; ".join(models)),
            ("dataflow", calls),
            ("steps", ", ".join(cadence) + f"; batch {r.dataset.batch_size} {rows}; world {self.world}"),
        ]
        if r.rollout is not None:
            lines.append(("rollout", f"asynchronous, max_staleness {r.rollout.max_staleness}"))
        if self.resumed_from is not None:
            lines.append(("resuming", f"from {self.resumed_from} (step {self.global_step})"))
        return lines

    def write_report(self) -> Path | None:
        """report.png from metrics.jsonl (rank 0); a plotting failure is a note, never a failed run."""
        if self.rank != 0:
            return None
        from arealcli.runtime.console.report import plot

        try:
            return plot([self.run_dir], self.run_dir / "report.png", labels=[self.recipe.experiment])
        except Exception as e:  # matplotlib missing or broken: the run itself succeeded
            self.notes.append(f"no report.png: {type(e).__name__}: {e}")
            return None

    def data_batch(self, step: int):
        """This rank's slice of the dataset batch of `step` (a pure function of the step)."""
        epoch, epoch_step = divmod(step, self.batches.steps_per_epoch)
        return distributed.dp_slice(self.batches.batch(epoch, epoch_step))

    def evaluate(self) -> dict[str, float]:
        """Every train call's interface on the held-out batches, each rank on its slice of them.

        Held-out metrics are named for what they measure (`eval/accuracy`, `eval/nll`,
        `eval/reward/<name>`), not for the call; a name two calls both report is kept apart as
        `eval/<call>/<name>` for the later calls. The held-out batches pass first through the inference
        calls that make what an interface's evaluate reads besides the data (`feeding_calls`)."""
        out: dict[str, float] = {}
        evaluated: set[int] = set()
        for call in self.calls:
            if call.spec.type != "train_step" or id(call.interface) in evaluated:
                continue  # calls sharing one interface object evaluate once
            evaluated.add(id(call.interface))
            assert self.eval_batches is not None  # areal check: evaluation needs an eval_dataset
            batches = self.eval_batches.all_batches(min_size=distributed.dp_world())
            loader: Any = map(distributed.dp_slice, batches)
            feeding = feeding_calls(self.calls, call)  # dpo: the reference's log-probs of held-out pairs
            if feeding:
                loader = (run_calls(feeding, b, self.global_step)[0] for b in loader)
            samples = self.recipe.trainer.eval
            takes = samples is not None and "samples" in inspect.signature(call.interface.evaluate).parameters
            evaluate: Any = call.interface.evaluate  # `samples`: interfaces that sample (ppo_actor)
            found = evaluate(call.model, loader, samples=samples) if takes else evaluate(call.model, loader)
            for k, v in found.items():
                out[f"eval/{k}" if f"eval/{k}" not in out else f"eval/{call.spec.name}/{k}"] = v
        return distributed.mean_over_ranks(out)

    # ------------------------------------------------------------------ checkpoints

    def latest_saved_step(self) -> int | None:
        latest = ckpt.latest_checkpoint(self.ckpt_root)
        return step_of(latest) if latest else None

    def save(self) -> Path:
        """Collective: every rank writes its part of each model; rank 0 the trainer state."""
        rngs = distributed.all_gather_object(ckpt.rng_state())

        def write(tmp: Path) -> None:
            for name in sorted(self.trained):
                model, call = self.models[name], self._train_call(name)
                call.interface.save(model, str(tmp / name))
                model.backend.save(model, str(tmp / name))
            for name in sorted(self.kept):
                self.models[name].module.save_to_hf(self.tokenizer, str(tmp / name))
            if self.rank != 0:
                return
            torch.save(
                {
                    "global_step": self.global_step,
                    "versions": {n: vars(m.version).copy() for n, m in self.models.items()},
                    "interfaces": [c.interface.state_dict() for c in self.calls],
                    "rng": rngs[0],
                    "rng_per_rank": rngs,
                },
                tmp / "trainer_state.pt",
            )

        path = ckpt.write_checkpoint(
            self.ckpt_root,
            self.global_step,
            write,
            self.recipe.trainer.keep_last_n_checkpoints,
            is_main=self.rank == 0,
            barrier=distributed.barrier,
        )
        self.saved_step = self.global_step
        return path

    def _train_call(self, model_name: str) -> Call:
        return next(c for c in self.calls if c.spec.type == "train_step" and c.spec.model == model_name)

    def close(self) -> None:
        """Release what setup made, as far as it got (every attribute exists from the constructor on)."""
        if self.producer is not None:
            self.producer.stop()  # before the engines it generates on go away
        if self.logger is not None:
            self.logger.close()
        for model in self.models.values():
            if model.backend is not None:
                model.backend.destroy(model)
        if self.producer is not None:
            self.producer.join()  # its workers end once the engines they waited on are closed


def _params(model) -> str:
    """`, 180k of 690k params train` for an in-process model that trains a part of its weights."""
    counts = (
        model.module.parameter_counts() if model is not None and isinstance(model.module, Engine) else None
    )
    if counts is None or counts[0] in (0, counts[1]):
        return ""
    trained, total = counts

    def short(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"

    return f", {short(trained)} of {short(total)} params train"


def drop_metrics_after(path: Path, step: int) -> None:
    """Resume: the rows the interrupted attempt logged after the checkpoint are trained again; drop them
    so every step has one row."""
    import json

    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return  # nothing to drop: the file is left as it is
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def check_finite(stats: dict[str, float], step: int, saved_step: int | None) -> None:
    """Stop at the first step whose loss or gradient norm is not finite (NaN or inf).

    An optimizer step with a non-finite gradient norm is skipped by the engine; going on would only
    train on garbage or not at all, so the run stops here with what to look at.
    """
    bad = sorted(
        k for k, v in stats.items() if k.rsplit("/", 1)[-1] in ("loss", "grad_norm") and not math.isfinite(v)
    )
    if bad:
        kept = f"the checkpoint of step {saved_step} is kept" if saved_step else "no checkpoint was written"
        raise TrainingDiverged(
            f"step {step}: {', '.join(f'{k} = {stats[k]}' for k in bad)} — training stopped ({kept}). "
            "Usual causes: a learning rate too high, reward shaping values too large, or bad data"
        )


def seed_rank(seed: int, rank: int) -> None:
    """Sampling RNGs: a distinct, deterministic stream per rank (rank 0 uses the recipe's seed)."""
    torch.manual_seed(seed + 100_003 * rank)
    random.seed(seed + 100_003 * rank)


def batch_size_problem(batch_size: int, world: int) -> str:
    return (
        f"dataset.batch_size ({batch_size}) must be divisible by the number of data-parallel ranks "
        f"({world}): each takes an equal slice of every step's batch. Change dataset.batch_size or "
        "--nproc-per-node/--nnodes"
    )


def sample_id(id_: Any) -> dict[str, Any]:
    """A sample's id as fields: `prompt_id` (the dataset row) and `sample` (j of n) for generated ones."""
    if isinstance(id_, tuple) and len(id_) == 2:
        return {"prompt_id": id_[0], "sample": id_[1]}
    return {"prompt_id": id_}


def sample_rows(batch, tokenizer) -> list[dict]:
    """Generated responses of a step, readable: prompt, response, reward, truncated."""
    if "prompt_mask" not in batch.data or "rewards" not in batch.data:
        return []
    rows = []
    for i, (ids, pm) in enumerate(
        zip(batch.unpack("packed_input_ids"), batch.unpack("prompt_mask"), strict=True)
    ):
        pm = pm.bool()
        row = {
            **sample_id(batch.ids[i]),
            "prompt": tokenizer.decode(ids[pm].tolist()),
            "response": tokenizer.decode(ids[~pm].tolist()),
            "reward": float(batch.data["rewards"][i]),
        }
        if "seq_no_eos_mask" in batch.data:
            row["truncated"] = bool(batch.data["seq_no_eos_mask"][i])
        if "answers" in batch.meta:
            row["answers"] = batch.meta["answers"][i]
        if "version" in batch.meta:
            row["version"] = batch.meta["version"][i]  # policy version that generated the response
        if "version_last" in batch.meta:
            row["version_last"] = batch.meta["version_last"][i]  # differs when an update interrupted it
        rows.append(row)
    return rows


def write_samples(path: Path, rows: list[dict]) -> None:
    import json

    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def resolved_recipe_data(recipe: Recipe, recipe_dir: Path) -> dict:
    """The resolved recipe as data, local paths absolute: what `recipe.yaml` in the run directory holds."""
    from arealcli.schema.resume import with_absolute_paths

    return with_absolute_paths(recipe.model_dump(mode="json"), recipe_dir)


def write_resolved_recipe(recipe: Recipe, run_dir: Path, recipe_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    data = resolved_recipe_data(recipe, recipe_dir)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def stateless_engines(models: dict[str, Model], trained: set[str]) -> list[str]:
    """A note for each trained model whose engine keeps no state for resume (a plugin's engine that
    does not implement `save_state`): its checkpoints hold the weights, a resume restarts its optimizer."""
    out = []
    for name in sorted(trained):
        engine = models[name].module
        if isinstance(engine, Engine) and type(engine).save_state is Engine.save_state:
            out.append(
                f"model {name}: its engine ({type(engine).__name__}) does not implement save_state, so "
                "checkpoints hold its weights only: a --resume restarts its optimizer (and anything else it "
                "keeps) from scratch"
            )
    return out


def resolve_path(path: str, recipe_dir: Path) -> str:
    """A local path (absolute or relative to the recipe), a Hub name's cached snapshot, or the Hub name
    itself (transformers then downloads it when online)."""
    from arealcli.schema.paths import REPO_ID, locate, resolve

    found = locate(path, recipe_dir)
    if found is not None:
        return str(found)
    return path if REPO_ID.match(path) else str(resolve(path, recipe_dir))


def recipe_tokenizer(recipe: Recipe, recipe_dir: Path) -> Any:
    """The run's tokenizer: the recipe's `tokenizer`, else the first model's folder's; with an image
    encoder (`runtime.vision`) when a model of the run reads images."""
    from arealcli.runtime import vision

    first_path = next((m.path for m in recipe.models.values() if m.path), None)
    spec = recipe.tokenizer
    if spec is not None and spec.path:  # relative to the recipe, or a Hub name
        spec = spec.model_copy(update={"path": resolve_path(spec.path, recipe_dir)})
    seeing = vision.vision_model(recipe, recipe_dir)
    tok = load_tokenizer(spec, first_path and resolve_path(first_path, recipe_dir), vision=seeing is not None)
    if seeing is None:
        return tok
    m = recipe.models[seeing]
    if m.config is not None:
        v = m.config.vision or VisionArchConfig()
        processor = vision.small_image_processor(v.patch_size, v.spatial_merge_size, v.max_pixels)
    else:
        processor = vision.folder_image_processor(resolve_path(m.path or "", recipe_dir))
    return vision.with_images(tok, processor)


def resolved_spec(recipe: Recipe, recipe_dir: Path, name: str) -> ModelSpec:
    """Model `name`'s spec with its path resolved (see `resolve_path`)."""
    spec = recipe.models[name]
    return spec.model_copy(update={"path": resolve_path(spec.path, recipe_dir)}) if spec.path else spec


def initial_module(recipe: Recipe, recipe_dir: Path, tokenizer: Any, name: str) -> Any:
    """Model `name`'s torch module at step 0 as the recipe describes it: seeded, so the same every
    time and in every process (what the trainer builds, and what a cluster launcher exports for the
    servers it starts)."""
    source = recipe.models[name].init_from
    source_module = initial_module(recipe, recipe_dir, tokenizer, source) if source else None
    spec = resolved_spec(recipe, recipe_dir, name)
    return build_module(spec, tokenizer, model_seeds(recipe)[name], source_module)
