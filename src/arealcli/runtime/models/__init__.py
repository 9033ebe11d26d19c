"""Models of a run: `Model` and how modules are built from a recipe (`model`), LoRA adapters (`lora`), value
heads (`value_head`), HF weights on disk (`weights`).

Layer 0: imports nothing of `runtime`.
"""
