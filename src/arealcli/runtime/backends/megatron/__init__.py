"""megatron-core backend: the ``megatron`` backend (``backend``) and its engine (``engine``, with the
pipeline schedule in ``schedule``), model building (``model``, ``sdpa_attention``), HF <-> Megatron
weights (``convert``), and the CPU-only workarounds (``cpu_compat``). Importing this package does not
import megatron or torch."""
