"""The analysis process's memory pages: numpy's transparent huge pages off by default (why below).
`trainvitals analyse` (serve's child) applies it at start; benchmarks/analysis_16k.py, which
measures that process's cycles, does the same."""

from __future__ import annotations

import os

import numpy as np


def small_pages_for_numpy() -> str:
    """Have numpy leave new arrays on ordinary 4 KiB pages unless the operator set
    NUMPY_MADVISE_HUGEPAGE (numpy reads it at import); returns 'on', 'off' or 'unknown' for the log.

    numpy advises transparent huge pages for large arrays; on a virtual machine a new process's
    first touch of them can stall: writing 2 GB of fresh arrays took 1.8-6.3 s with them and
    1.1-1.2 s without, three processes each, and a 16,384-rank restart's first analysis cycle
    allocates ~2 GB (docs/performance.md). The switch is numpy's private one (numpy >= 1.20;
    `trainvitals`'s parser imports numpy before a command runs, too late for the variable), so
    it is looked up, not assumed."""
    multiarray = getattr(getattr(np, "_core", None), "multiarray", None)
    get, set_ = (getattr(multiarray, f"_{verb}_madvise_hugepage", None) for verb in ("get", "set"))
    if set_ is not None and "NUMPY_MADVISE_HUGEPAGE" not in os.environ:
        set_(False)
    return "unknown" if get is None else "on" if get() else "off"
