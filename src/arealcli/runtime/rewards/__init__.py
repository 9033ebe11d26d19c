"""Reward functions: the built-ins (`builtin`) and the math answer checker (`math_verifier`).

Layer 0: imports nothing of `runtime`.
"""
