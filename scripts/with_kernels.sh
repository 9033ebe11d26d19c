#!/usr/bin/env bash
# Run a command with torch's CPU kernels limited to one instruction set, as on a CPU that has no more:
#   scripts/with_kernels.sh avx2 python -m pytest -q      # an AVX2 machine (no AVX-512)
#   scripts/with_kernels.sh default python -m pytest -q   # no AVX at all
# torch picks kernels by CPU at three levels: its own vectorized ops (ATEN_CPU_CAPABILITY), MKL's matrix
# products (MKL_ENABLE_INSTRUCTIONS) and oneDNN's (ONEDNN_MAX_CPU_ISA); all three are set.
set -euo pipefail
case "${1:-}" in
  avx512) export ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE ;;
  avx2) export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  default) export ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 ;;
  *) echo "usage: $0 avx512|avx2|default COMMAND [ARGS...]" >&2; exit 2 ;;
esac
shift
exec "$@"
