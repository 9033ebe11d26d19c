"""Models of a run: `Model` and how modules are built from a recipe (`model`), LoRA adapters (`lora`), value
heads of critics and reward models, saved as HF sequence classifiers (`value_head`), HF weights on disk
(`weights`).

Layer 1 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
