"""Model interfaces: the algorithms (sft, ppo_actor, ppo_critic, reward, returns) over engines.

Layer 4: imports `algo`, `data`, `models`, `distributed`, `registry`.
"""
