"""megatron-core backend: model building (``model``), HF <-> Megatron weights (``convert``), and the
CPU-only workarounds (``cpu_compat``). Importing this package does not import megatron or torch."""
