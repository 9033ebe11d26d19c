"""Where the guard of the vLLM and SGLang servers a run launches lives, and how those servers load it.

The guard itself (`areal_guard.py` in this folder) runs inside the server's own Python environment,
where this package need not be installed: a standalone module that imports nothing from `arealcli`. A
launched vLLM server finds it through PYTHONPATH (this folder, which holds nothing else that could shadow
a module of vLLM's) and loads it with `--middleware MIDDLEWARE`; the SGLang wrapper
(clients/launcher.SGLANG_WITH_KEY) puts this folder on sys.path and calls `areal_guard.guard_sglang`.
"""

from __future__ import annotations

from pathlib import Path

GUARD_DIR = Path(__file__).resolve().parent
MIDDLEWARE = "areal_guard.KeyGuard"  # vLLM's --middleware takes an import path of an ASGI class
