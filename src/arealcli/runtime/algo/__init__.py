"""The RL math as plain functions over tensors (`functional`): rewards, KL, GAE, normalization, losses.

Layer 0: imports nothing of `runtime`.
"""
