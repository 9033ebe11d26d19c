"""`areal chat`: piped (replies as plain text, equal to greedy decoding of the same prompts), the
conversation rendered with the chat template (history, --system, /reset, a message too long for the
context), plain completion, a run directory's checkpoint, an `areal serve` URL, a real terminal (tmux),
and clear errors for targets that are not there."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from arealcli.errors import UserError
from arealcli.main import app
from arealcli.runtime.data.tokenizer import char_tokenizer, from_directory
from arealcli.runtime.run.targets import find_model, generating_model
from tests.conftest import tiny_module

# A chat template over the character vocabulary: `s:...`, `u:...`, `a:...` lines, then `a:` to answer.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
MAX_NEW = 6


def save_model(path: Path, seed: int, template: str | None = None) -> Path:
    tok = char_tokenizer()
    if template is not None:
        tok.chat_template = template
    tiny_module(tok, seed=seed).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Greedy:
    """Greedy continuations of prompts under a saved model, one full forward pass per token (no KV
    cache): the reference the chat's replies are checked against."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tok = from_directory(str(model_dir))

    def __call__(self, prompt: str, max_new: int = MAX_NEW) -> str:
        ids = self.tok.encode(prompt, add_special_tokens=False)
        out: list[int] = []
        with torch.no_grad():
            for _ in range(min(max_new, self.module.config.max_position_embeddings - len(ids))):
                token = int(self.module(torch.tensor([ids + out])).logits[0, -1].argmax())
                if token == self.module.generation_config.eos_token_id:
                    break
                out.append(token)
        return self.tok.decode(out, skip_special_tokens=True)


def render(model_dir: Path, messages: list[dict[str, str]]) -> str:
    return from_directory(str(model_dir)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def chat(*args: str | Path, input: str):
    """`areal chat` in-process with stdin piped (not a terminal)."""
    return CliRunner().invoke(app, ["chat", *map(str, args)], input=input)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("plain-model"), seed=0)


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("chat-model"), seed=1, template=TEMPLATE)


SAMPLING = ("--temperature", "0", "--max-new-tokens", str(MAX_NEW))
COMPLETION_INPUT = 'a:\nb:\\\nc\n"""\nx\ny\n"""\n\n/exit\nnever:\n'


def completion_replies(model_dir: Path) -> str:
    greedy = Greedy(model_dir)
    return "".join(greedy(p) + "\n" for p in ("a:", "b:\nc", "x\ny"))


# two exchanges, /reset, a message longer than the 64-token context, one more exchange, /history
CHAT_INPUT = "a\nb\n/reset\nb\n" + "z" * 80 + "\nc\n/history\n"


def chat_replies(model_dir: Path, system: str) -> list[str]:
    sys_msg = [{"role": "system", "content": system}]
    greedy = Greedy(model_dir)

    def reply(history: list[dict[str, str]], text: str) -> str:
        out = greedy(render(model_dir, [*sys_msg, *history, {"role": "user", "content": text}]))
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": out}]
        return out

    first: list[dict[str, str]] = []
    second: list[dict[str, str]] = []
    return [reply(first, "a"), reply(first, "b"), reply(second, "b"), reply(second, "c")]


def check_conversation(stdout: str, replies: list[str]) -> None:
    """Each reply on its own line(s), then /history: the conversation since /reset, not before it."""
    printed = "".join(r + "\n" for r in replies)
    assert stdout.startswith(printed), (stdout, replies)
    history = stdout[len(printed) :]
    assert "conversation: 2 exchange(s)" in history and "system> s\n" in history
    assert f"you> b\nmodel> {replies[2]}\nyou> c\nmodel> {replies[3]}\n" in history
    assert "you> a" not in history


# --------------------------------------------------------------------------- piped, in this process


def test_piped_completion_is_greedy_decoding_of_each_message(plain):
    result = chat(plain, *SAMPLING, input=COMPLETION_INPUT)
    assert result.exit_code == 0, result.output
    # `\` continues a line, \"\"\" blocks keep their lines, an empty line is skipped, /exit ends it all
    assert result.stdout == completion_replies(plain)


def test_piped_chat_keeps_history_system_and_reset(templated):
    result = chat(templated, *SAMPLING, "--system", "s", input=CHAT_INPUT)
    assert result.exit_code == 0, result.output
    # replies equal to greedy decoding of the conversations rendered with the template
    check_conversation(result.stdout, chat_replies(templated, "s"))
    # the over-long message is an error on stderr and the conversation goes on without it
    assert "the prompt is" in result.stderr and "context holds 64" in result.stderr


def test_completion_flag_ignores_the_template(templated):
    result = chat(templated, *SAMPLING, "--completion", input=COMPLETION_INPUT)
    assert result.exit_code == 0, result.output
    assert result.stdout == completion_replies(templated)


# --------------------------------------------------------------------------- targets


def fake_checkpoint(run: Path, step: int, models: list[str], recipe: str | None = None) -> Path:
    step_dir = run / "checkpoints" / f"step_{step:08d}"
    for m in models:
        (step_dir / m).mkdir(parents=True)
        (step_dir / m / "config.json").write_text("{}")
    (step_dir / "trainer_state.pt").write_text("")
    (run / "checkpoints" / "LATEST").write_text(step_dir.name + "\n")
    if recipe is not None:
        (run / "recipe.yaml").write_text(recipe)
    return step_dir


GRPO_WITH_FOLLOWER = """
models:
  actor: {}
  actor_gen: {weights_from: actor}
  critic: {value_head: true}
dataflow:
  calls:
  - {name: gen, model: actor_gen, type: generate}
  - {name: train, model: actor, type: train_step}
"""


def test_a_run_directory_means_the_model_it_generates_with(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 4, ["actor", "critic"])
    step_dir = fake_checkpoint(run, 8, ["actor", "critic"], GRPO_WITH_FOLLOWER)
    found = find_model(run)
    assert (found.model_dir, found.step, found.model) == (step_dir / "actor", 8, "actor")
    assert find_model(run, "critic", 4).model_dir == run / "checkpoints" / "step_00000004" / "critic"
    assert find_model(step_dir).model == "actor"  # one checkpoint given directly
    # without a recipe the critic is still a candidate: ambiguous
    assert generating_model({}, ["actor", "critic"]) is None
    assert generating_model({"models": {"critic": {"value_head": True}}}, ["actor", "critic"]) == "actor"
    with pytest.raises(UserError, match=r"no checkpoint of step 5 \(kept: 4, 8\)"):
        find_model(run, step=5)
    with pytest.raises(UserError, match=r"no model 'ref' \(saved: actor, critic\)"):
        find_model(run, "ref")


def test_targets_that_are_not_there_are_clear_errors(tmp_path, plain):
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path: "neither a model folder",
    }
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    cases[tmp_path / "empty-run"] = "no complete checkpoint yet"
    two = tmp_path / "two"
    fake_checkpoint(two, 2, ["a", "b"])
    cases[two] = "holds several models (a, b): pick one with --model NAME"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no model type, no weights
    cases[broken] = "cannot load the model in"
    for target, message in cases.items():
        result = chat(target, input="")
        assert result.exit_code == 2, (target, result.output)
        assert message in result.stderr and "Traceback" not in result.output
    result = chat(plain, "--step", "3", input="")
    assert result.exit_code == 2 and "model folder: --model and --step" in result.stderr


def test_an_unreachable_url_is_a_clear_error():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = chat(f"http://127.0.0.1:{port}", input="")
    assert result.exit_code == 2 and "cannot reach http://127.0.0.1" in result.stderr


# --------------------------------------------------------------------------- an areal serve URL


def test_url_of_areal_serve_gives_the_replies_of_the_local_model(plain, templated, tmp_path):
    from arealcli.runtime.clients import launcher
    from arealcli.schema.components.backends import SGLangBackendArgs

    args = SGLangBackendArgs(launch="embedded", device="cpu", extra_args=["--num-threads", "1"])
    servers = []
    try:
        for name, model in (("plain", plain), ("chat", templated)):
            servers += launcher.launch(args, str(model), tmp_path / "logs", name)
        launcher.wait_ready(servers, 90)
        plain_url, chat_url = (f"http://{s.address}" for s in servers)
        result = chat(chat_url + "/v1", *SAMPLING, "--system", "s", input=CHAT_INPUT)
        assert result.exit_code == 0, result.output
        check_conversation(result.stdout, chat_replies(templated, "s"))
        assert "leaves no room" in result.stderr  # the server's own words on the over-long message
        # a server without a chat template: plain completion, found out by itself
        result = chat(plain_url, *SAMPLING, input=COMPLETION_INPUT)
        assert result.exit_code == 0, result.output
        assert result.stdout == completion_replies(plain)
    finally:
        launcher.stop(servers)


# --------------------------------------------------------------------------- a real terminal


class Tmux:
    """A tmux server of its own (its own socket) running one command in an 80x30 window."""

    def __init__(self, command: str, cwd: Path):
        self.socket = f"areal-chat-test-{uuid.uuid4().hex[:8]}"
        self.tmux("new-session", "-d", "-s", "t", "-x", "80", "-y", "30", "-c", str(cwd), command)
        self.tmux("set-option", "-t", "t", "remain-on-exit", "on")

    def tmux(self, *args: str) -> str:
        cmd = ["tmux", "-L", self.socket, *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def send(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, text: str, after: int = 0, timeout_s: float = 90) -> str:
        """The screen once `text` appears on it more than `after` times (a bounded wait, not a timing
        check; tmux drops the spaces at the end of a line)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = self.screen()
            if screen.count(text) > after:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} did not appear:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_chat_in_a_terminal_with_a_trained_run(ws, cli):
    recipe = ws.recipe(trainer={"max_steps": 10, "tensorboard": False})
    assert cli("train", recipe, "-o", ws.root / "run").exit_code == 0
    command = shlex.join([sys.executable, "-m", "arealcli.main", "chat", "run", *SAMPLING])
    term = Tmux(f"{command}; echo chat-ended-$?", ws.root)
    try:
        greedy = Greedy(ws.root / "run" / "checkpoints" / "step_00000010" / "default")
        want = [greedy("c:"), greedy("K:\nx")]  # while the chat starts
        screen = term.wait_for("you>")
        assert "run: step 10, model default" in screen and "completion (the model has no chat" in screen
        assert all(len(line) <= 80 for line in screen.splitlines())
        term.send("c:", "Enter")
        screen = term.wait_for("model>")
        assert f"model> {want[0]}".rstrip() in screen
        term.send("K:\\", "Enter")  # continued on the next line
        term.wait_for("...>")
        term.send("x", "Enter")
        screen = term.wait_for("model>", after=1)
        assert f"model> {want[1]}".rstrip() in screen
        term.send("C-c")  # at the prompt: a hint, no exit
        term.wait_for("(/exit or Ctrl-D quits)")
        term.send("/exit", "Enter")
        assert "chat-ended-0" in term.wait_for("chat-ended-")
    finally:
        term.close()
