"""Model interfaces: the algorithms (sft, ppo_actor, ppo_critic, reward, returns) over engines;
next-token log-probs and entropy of packed sequences (token_logprobs).

Layer 5 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
