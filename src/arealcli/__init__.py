"""arealcli: declarative RL and SFT training for language models."""

import os as _os

__version__ = "0.1.0"

# OpenMP threads wait passively (sleep at a barrier instead of spinning), unless the user chose a
# policy. torch's CPU builds run their own parallel regions, MKL and oneDNN on one OpenMP runtime
# (libgomp), which reads this variable once, when torch is first imported: so it is set here, before
# any of our modules imports torch, and every process we start (workers, servers) inherits it.
# Spinning threads burn the time slices a neighbour needs: beside one busy process a quickstart's RL
# steps took 2.5x as long with spinning threads and 1.5x with passive ones. Alone it costs nothing
# measurable, and it changes no number (the thread count and the kernels stay the same).
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
_os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")
