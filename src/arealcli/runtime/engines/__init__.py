"""The engine contracts: `base.Engine` (state, weights, release), `train.TrainEngine` (one
forward/backward primitive and everything built on it) and `inference.InferenceEngine` (prompt groups
on a generator, asynchronous, following another model's weights); `lm_output.LMOutput`, what a
training engine hands a loss (hidden states and LM head: log-probs and entropy chunk by chunk).

Layer 3 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
