"""The RL math as plain functions over tensors (`functional`): rewards, KL, GAE, normalization, losses;
per-token log-probs and entropy from hidden states, chunk by chunk of tokens (`logprobs`); a reward
model's Bradley-Terry loss and scored token (`bradley_terry`).

Layer 1 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
