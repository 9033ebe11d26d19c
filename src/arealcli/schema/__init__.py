"""The recipe schema, importable without torch: its models, the registries, presets and validation.

The built-in components' table (`builtins`) is loaded with the package, so every registry is filled
before any name is looked up (the registry itself imports nothing of ours: no import circle)."""

from arealcli.schema import builtins as _builtins  # noqa: F401  (fills the registries)
