"""`areal eval`'s orchestration: held-out evaluation of checkpoints, run directories and served models.

    session    the targets (run directory, checkpoint, model folder, URL) and the recipe that goes with
               each; the dataset, reward and generation settings (flags, else the recipe's); one run of
               the evaluation loop (runtime/eval) per target; results.json and the samples beside it
    targets    what is evaluated besides a model of the training process: a model folder generating
               in this process, an OpenAI-compatible server
    pairs      a reward model's folder: pairwise accuracy on preference pairs

Layer 7 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
