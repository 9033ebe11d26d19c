"""Argument models of the built-in components: backends, interfaces, datasets, workflows, engine settings."""
