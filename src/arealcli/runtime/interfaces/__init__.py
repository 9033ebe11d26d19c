"""Model interfaces: the algorithms (sft, ppo_actor, ppo_critic, reward, returns) over engines;
next-token log-probs and entropy of packed sequences (token_logprobs).

Layer 4: imports `algo`, `data`, `models`, `distributed`, `registry`, `engines`.
"""
