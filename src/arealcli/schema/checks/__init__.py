"""Checks of a recipe: one small function per rule, each returning the Problems it finds (see validate)."""
