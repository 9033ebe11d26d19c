"""Model interfaces: the algorithms (sft, ppo_actor, ppo_critic, reward, returns, dpo, reward_model
and rm_reward) over engines; next-token log-probs and entropy of packed sequences (token_logprobs); the
algorithm variants picked by name (variants, preference_losses).

Layer 5 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
