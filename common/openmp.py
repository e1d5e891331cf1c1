"""How long OpenMP's idle threads spin before they sleep: set before torch loads its OpenMP runtime.

After each parallel region torch's intra-op threads spin, waiting for the next one — GNU OpenMP
(libgomp, Linux wheels) by default for 300,000 spins, LLVM's (libomp) for 200 ms.  At a layer's hook
the forward pauses and the accumulation's crew takes every core (extract/accumulate/crew.py):
spinning threads would keep a core each from it, while a short spin costs the forward itself
nothing measurable (docs/cost-model.md, "The CPU's thread budget", has the numbers; libomp's
setting is not measured).  Only defaults: a value the user set stays, and a process that loaded
torch before this runs has its own.
"""

from __future__ import annotations

import os

SPIN = {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "1"}  # libgomp: spins; libomp: milliseconds


def short_spin(env=None) -> None:
    """Set the short spin as a default of `env` (the process's environment)."""
    env = os.environ if env is None else env
    for name, value in SPIN.items():
        env.setdefault(name, value)
