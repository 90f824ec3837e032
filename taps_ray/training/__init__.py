"""Draft-head training: target features (features.py), EAGLE/HASS losses (losses.py), the trainer, agreement."""

import os

# Sleep, don't spin, in OpenMP barriers. On the 2-core CPU shared with other processes, a 2-thread torch run with
# spinning barriers was measured 2.5-3x slower than one thread; with passive waiting two threads are at least as
# fast as one. Takes effect only when torch (libgomp) is first loaded after this line; a value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
