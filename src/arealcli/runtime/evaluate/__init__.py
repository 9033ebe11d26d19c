"""`areal eval`'s orchestration: held-out evaluation of checkpoints, run directories and served models.

    session    the targets (run directory, checkpoint, model folder, URL) and the recipe that goes with
               each; the dataset, reward and generation settings (flags, else the recipe's); one run of
               the evaluation loop (runtime/eval) per target; results.json and the samples beside it

Layer 7 (beside launchers): it finds checkpoints through `run` and evaluates through `serve`'s targets.
"""
