"""Reward functions: the built-ins (`builtin`) and the math answer checker (`math_verifier`).

Layer 1 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
