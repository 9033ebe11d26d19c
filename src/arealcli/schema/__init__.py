"""The recipe schema, importable without torch: its models, the registries, presets and validation."""
