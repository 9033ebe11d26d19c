"""Evaluation of a model on held-out prompts: what `areal eval` runs, and held-out evaluation with
samples during training (`trainer.eval`).

    metrics   pass@k (unbiased), avg@k, maj@k, bootstrap intervals, from per-prompt results
    run       the evaluation loop over a target: greedy, then n samples per prompt, scored by a reward
              function; the target of a model of this process (the PPO actor's held-out evaluation)

Layer 4 of runtime/__init__.py's table: it imports only folders of lower layers. The interfaces above it
evaluate through it; `areal eval`'s orchestration and its other targets (a model folder, an
OpenAI-compatible server) are in runtime/evaluate.
"""
