"""The documentation site: `mkdocs build --strict` passes (no broken link or anchor), the generated
references list every recipe key and every command option of the code, and the built site works in a
real browser (headless Chromium driven over the DevTools protocol): the home page and the recipe
reference render (screenshots kept in the test's folder), and the site's search finds a recipe key.

mkdocs (with Material) and Chromium are optional here and skip with the reason; under CI=true their
absence fails instead.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO

UNDER_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(ok: bool, reason: str) -> None:
    """Skip with the reason, or fail under CI, where every tool the docs need is installed."""
    if not ok:
        if UNDER_CI:
            pytest.fail(f"{reason} (CI installs it: pip install -e '.[docs]', apt-get install chromium)")
        pytest.skip(reason)


def hook():
    """The build hook that generates the references (docs/hooks/reference.py), as mkdocs loads it."""
    spec = importlib.util.spec_from_file_location("docs_reference_hook", REPO / "docs/hooks/reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schema_keys() -> set[str]:
    """Every key of a recipe's sections, walked from the recipe's JSON Schema (`areal schema`), not from
    the models `areal list` walks: maps are `NAME`, lists `N`, `{type_, args}` stops at `args`."""
    from arealcli.schema.json_schema import recipe_json_schema

    schema = recipe_json_schema()
    defs = schema["$defs"]

    def resolve(node: dict) -> list[dict]:
        if "$ref" in node:
            return resolve(defs[node["$ref"].rsplit("/", 1)[1]])
        for key in ("anyOf", "oneOf"):
            if key in node:
                return [x for sub in node[key] for x in resolve(sub)]
        return [node]

    keys: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for n in resolve(node):
            if n.get("type") == "array" and "items" in n:
                walk(n["items"], f"{prefix}N.")
            elif isinstance(n.get("additionalProperties"), dict):
                walk(n["additionalProperties"], f"{prefix}NAME.")
            for name, sub in n.get("properties", {}).items():
                keys.add(prefix + name)
                if name != "args":  # a component's args: its own model, listed under Components
                    walk(sub, f"{prefix}{name}.")

    top = resolve(schema)[0]
    for name, sub in top["properties"].items():
        keys.add(name)
        if name == "dataflow":  # either the written-out calls or a preset block
            walk(defs["DataflowSpec"], "dataflow.")
            walk(defs["PresetDataflow"], "dataflow.")
        else:
            walk(sub, f"{name}.")
    return keys


def test_recipe_reference_lists_every_key_of_the_schema():
    text = hook().recipe_reference_markdown()
    listed = hook().reference_keys(text)
    section_part = text.split("## Components", 1)[0]
    in_sections = hook().reference_keys(section_part)
    expected = schema_keys()
    missing = sorted(k for k in expected if k not in in_sections and not k.startswith("dataflow.calls.N."))
    assert not missing, f"keys of the schema missing from the recipe reference: {missing}"
    calls = {k for k in expected if k.startswith("dataflow.calls.N.")}
    assert calls <= in_sections, sorted(calls - in_sections)
    invented = sorted(k for k in in_sections if k not in expected)
    assert not invented, f"keys in the reference that the schema does not have: {invented}"
    # every registered component with every top-level argument of its args model
    from arealcli.commands.list_ import KINDS
    from arealcli.schema.registry import ALL

    for kind in KINDS:
        for entry in ALL[kind].entries():
            block = text.split(f"#### `{entry.name}` {{#{kind}-{entry.name}}}", 1)
            assert len(block) == 2, f"{kind} {entry.name} is not in the reference"
            own = hook().reference_keys(block[1].split("\n#### ", 1)[0].split("\n### ", 1)[0])
            args = set(entry.args_model.model_json_schema().get("properties", {}))
            assert args <= own, (kind, entry.name, sorted(args - own))
    assert "trainer.max_steps" in listed and "generation.temperature" in listed


def test_cli_reference_lists_every_command_and_option():
    import typer

    from arealcli.main import app

    text = hook().cli_reference_markdown()
    group = typer.main.get_command(app)
    sections = {part.split("`", 1)[0]: part for part in text.split("\n## `areal ")[1:]}
    for name, command in group.commands.items():
        assert name in sections, name
        own = sections[name]  # this command's section only: another command's option must not count
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("-"):
                    assert f"<code>{opt}" in own or f" {opt}" in own, (name, opt)


def build_site(dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(dest)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def have_mkdocs() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("mkdocs", "material"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    need(have_mkdocs(), "mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")
    dest = tmp_path_factory.mktemp("site")
    proc = build_site(dest)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dest


def test_site_builds_strict_with_the_generated_references(site):
    recipe = (site / "reference/recipe/index.html").read_text()
    assert "trainer.max_steps" in recipe and "generation.temperature" in recipe
    cli = (site / "reference/cli/index.html").read_text()
    assert "--nproc-per-node" in cli and "areal export" in cli
    assert (site / "img/quickstart-report.png").exists()
    assert (site / "search/search_index.json").exists()


# ----------------------------------------------------------------------------- in a browser


def chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)


class Serve:
    """The built site on a real HTTP server (the search worker does not load from file:// URLs)."""

    def __init__(self, root: Path):
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class Browser:
    """Headless Chromium over the DevTools protocol (aiohttp's websocket client): navigate, evaluate
    JavaScript, take screenshots."""

    def __init__(self, exe: str, profile: Path):
        self.proc = subprocess.Popen(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "--window-size=1280,900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # a pipe nobody drains would block a chatty browser
        )
        self.endpoint = self._endpoint(profile / "DevToolsActivePort")
        self.ids = 0

    def _endpoint(self, active_port: Path, timeout_s: float = 60.0) -> str:
        """127.0.0.1:PORT, from the file Chromium writes once its DevTools endpoint listens."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"chromium exited ({self.proc.returncode}) before DevTools opened")
            lines = active_port.read_text().split() if active_port.exists() else []
            if lines:
                return f"127.0.0.1:{lines[0]}"
            time.sleep(0.1)
        self.proc.kill()
        raise AssertionError(f"chromium's DevTools endpoint did not open within {timeout_s:g} s")

    async def session(self):
        import aiohttp

        self.http = aiohttp.ClientSession()
        async with self.http.get(f"http://{self.endpoint}/json") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await self.http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)

    async def call(self, method: str, **params):
        self.ids += 1
        await self.ws.send_json({"id": self.ids, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 60)
            if msg.get("id") == self.ids:
                assert "error" not in msg, msg
                return msg["result"]

    async def evaluate(self, js: str):
        result = await self.call("Runtime.evaluate", expression=js, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, js: str, timeout: float = 60.0):
        """Poll a JavaScript expression until it is truthy (the page loads and runs on its own clock)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            value = await self.evaluate(js)
            if value:
                return value
            await asyncio.sleep(0.25)
        raise AssertionError(f"timed out waiting for {js}")

    async def open(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    async def screenshot(self, path: Path) -> None:
        data = (await self.call("Page.captureScreenshot", format="png"))["data"]
        path.write_bytes(base64.b64decode(data))

    async def close(self) -> None:
        await self.ws.close()
        await self.http.close()
        self.proc.terminate()
        self.proc.wait(30)


@pytest.mark.slow
def test_site_in_a_browser_renders_and_search_finds_a_recipe_key(site, tmp_path):
    exe = chromium()
    need(exe is not None, "chromium is not installed (apt-get install chromium)")
    server = Serve(site)
    browser: Browser | None = None

    async def visit(browser: Browser) -> list[str]:
        await browser.session()
        try:
            return await pages(browser)
        finally:
            await browser.close()

    async def pages(browser: Browser) -> list[str]:
        await browser.open(server.url)
        assert "arealcli" in await browser.evaluate("document.title")
        await browser.wait_for("[...document.images].every(i => i.complete && i.naturalWidth > 0)")
        await browser.screenshot(tmp_path / "home.png")
        await browser.open(server.url + "reference/recipe/")
        text = await browser.evaluate("document.querySelector('article').innerText")
        assert "trainer.max_steps" in text and "dataflow.actor" in text
        await browser.screenshot(tmp_path / "recipe-reference.png")
        # Material's search runs in a web worker; ?q= opens it with the query typed in
        await browser.open(server.url + "?q=max_steps")
        found = await browser.wait_for(
            "[...document.querySelectorAll('.md-search-result__item')].map(e => e.innerText)"
        )
        await browser.screenshot(tmp_path / "search.png")
        return found

    try:
        browser = Browser(exe, tmp_path / "profile")
        found = asyncio.run(visit(browser))
    finally:
        if browser is not None and browser.proc.poll() is None:
            browser.proc.kill()
        server.close()
    assert any("max_steps" in f for f in found), found
    assert any("Recipe reference" in f for f in found), found
    for name in ("home.png", "recipe-reference.png", "search.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name
    print(f"screenshots: {tmp_path}")
