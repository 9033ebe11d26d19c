"""`areal eval TARGET... [--data PATH] [--n 8] [--k 1,8] [-o results.json]`: greedy accuracy, avg@k,
pass@k and maj@k of checkpoints or served models on held-out prompts. The orchestration is
runtime/evaluate/session.py; this parses, shows progress and the table, and writes where told."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from arealcli.commands.common import Device, console, err_console, fail, say_error
from arealcli.errors import UserError


def _opt(name: str, metavar: str, help: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(name, metavar=metavar, help=help, **kw)


Targets = Annotated[
    list[str],
    typer.Argument(
        metavar="TARGET",
        help="Model folders, run directories (their latest checkpoint), checkpoints, or http(s) URLs of "
        "OpenAI-compatible servers; several are compared in one table.",
    ),
]
Data = Annotated[
    str | None,
    _opt(
        "--data",
        "PATH",
        "Prompts with answers (a JSONL file, a folder, or a Hub dataset name); default: the run's "
        "eval_dataset.",
    ),
]
RecipeOpt = Annotated[
    Path | None,
    _opt(
        "--recipe",
        "RECIPE",
        "Take the tokenizer, eval_dataset, reward and generation settings from this recipe "
        "(default: the run's own recipe.yaml).",
    ),
]
Model = Annotated[str | None, _opt("--model", "NAME", "Run directory: which model.")]
Step = Annotated[int | None, _opt("--step", "N", "Run directory: the checkpoint of step N.", min=0)]
N = Annotated[int, _opt("--n", "N", "Samples per prompt (0: greedy only).", min=0)]
K = Annotated[str | None, _opt("--k", "K,K", "The k of avg@k, pass@k, maj@k (default: 1 and n).")]
Temperature = Annotated[float, _opt("--temperature", "T", "Sampling temperature.", min=0.0)]
TopP = Annotated[float, _opt("--top-p", "P", "Nucleus sampling mass.", min=0.01, max=1.0)]
MaxNewTokens = Annotated[
    int | None, _opt("--max-new-tokens", "N", "Longest response (default: the recipe's).", min=1)
]
Greedy = Annotated[bool, typer.Option("--greedy/--no-greedy", help="Also decode greedily (greedy_accuracy).")]
Workflow = Annotated[
    bool,
    typer.Option(
        "--workflow/--no-workflow",
        help="When the recipe's actor generates agentic episodes (a workflow): evaluate those, as training "
        "generates them (default), or plain completions.",
    ),
]
Reward = Annotated[
    str | None,
    _opt(
        "--reward",
        "NAME",
        "Reward function (default: the recipe's held-out one, or math); judge: the recipe's judge "
        "(reward: {judge: ...}) scores.",
    ),
]
BatchSize = Annotated[
    int | None, _opt("--batch-size", "N", "Prompts per generate call (default: the recipe's).", min=1)
]
Limit = Annotated[int | None, _opt("--limit", "N", "--data: the first N rows only.", min=1)]
Split = Annotated[str, _opt("--split", "NAME", "--data: the split to read.")]
PromptKey = Annotated[str, _opt("--prompt-key", "KEY", "--data: the prompt field.")]
AnswerKey = Annotated[str, _opt("--answer-key", "KEY", "--data: the answer field.")]
ChatTemplate = Annotated[
    bool, _opt("--apply-chat-template", "", "--data: render prompts with the chat template.")
]
Tokenizer = Annotated[
    str | None, _opt("--tokenizer", "PATH", "A tokenizer folder (URLs without a run or recipe).")
]
DeviceOpt = Annotated[Device, typer.Option(help="Local models: auto = cuda when available, else cpu.")]
Seed = Annotated[int, _opt("--seed", "N", "Seed of the sampling and of the intervals.")]
Output = Annotated[
    Path | None,
    typer.Option(
        "--output", "-o", metavar="FILE", help="Write results here (JSON), and the samples beside it."
    ),
]
SendKey = Annotated[
    bool,
    _opt(
        "--send-key",
        "",
        "URLs: send AREAL_API_KEY to those not on this machine too (loopback URLs get it always).",
    ),
]


def eval_(
    targets: Targets,
    data: Data = None,
    recipe: RecipeOpt = None,
    model: Model = None,
    step: Step = None,
    n: N = 8,
    k: K = None,
    temperature: Temperature = 1.0,
    top_p: TopP = 1.0,
    max_new_tokens: MaxNewTokens = None,
    greedy: Greedy = True,
    workflow: Workflow = True,
    reward: Reward = None,
    batch_size: BatchSize = None,
    limit: Limit = None,
    split: Split = "test",
    prompt_key: PromptKey = "prompt",
    answer_key: AnswerKey = "answer",
    chat_template: ChatTemplate = False,
    tokenizer: Tokenizer = None,
    device: DeviceOpt = Device.auto,
    seed: Seed = 0,
    output: Output = None,
    send_key: SendKey = False,
) -> None:
    """Evaluate models on held-out prompts: greedy accuracy, avg@k, pass@k, maj@k.

    Examples:
    areal eval runs/quickstart
    areal eval runs/quickstart --data data/max3/test.jsonl --n 8 --k 1,8 -o results.json
    areal eval runs/quickstart/checkpoints/step_* --n 0
    areal eval http://127.0.0.1:30000 --recipe recipes/quickstart.yaml --n 4
    """
    given = {**locals(), "device": device.value}  # every parameter, as given (first: nothing else yet)
    from arealcli.runtime.console.eval_table import eval_table
    from arealcli.runtime.evaluate import session as evaluate

    flags = evaluate.EvalFlags(**given)
    try:
        job = evaluate.plan(flags)
        _say_withheld_key(job.withheld_urls())
        reports = [evaluate.run_one(job, t, _progress) for t in job.targets]
    except UserError as e:
        raise fail(e.lines) from None
    for item, soft_wrap in eval_table(reports):
        console.print(item, soft_wrap=soft_wrap)
    if output is not None:
        samples = evaluate.write(output, reports, job.config())
        console.print(Text(f"results: {output}; samples: {samples}"), soft_wrap=True)


def _say_withheld_key(withheld: list[str]) -> None:
    """One line on stderr when AREAL_API_KEY is not sent to a URL target (not on this machine)."""
    from arealcli.runtime.serve.chat import withheld_note

    if withheld:
        say_error(withheld_note(", ".join(withheld)), title="note")


@contextlib.contextmanager
def _progress(label: str, total: int):
    """One target's progress bar on stderr (a terminal only), gone when it ends."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from arealcli.runtime.console.eval_table import short

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )
    with progress:
        task = progress.add_task(short(label), total=total)
        yield lambda m: progress.advance(task, m)
