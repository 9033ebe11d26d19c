"""Evaluation of a model on held-out prompts: what `areal eval` runs, and held-out evaluation with
samples during training (`trainer.eval`).

    metrics   pass@k (unbiased), avg@k, maj@k, bootstrap intervals, from per-prompt results
    run       targets (a model of this process, a model folder, an OpenAI-compatible server) and the
              evaluation loop: greedy, then n samples per prompt, scored by a reward function

Layer 5 (beside run and serve): it may use the engines, backends and interfaces below it.
"""
