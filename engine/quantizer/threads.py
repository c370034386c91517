"""CPU threads for a conversion: the idle cores, for the conversion's duration only.

    with cpu_threads(options.threads or idle_cpu_threads()):  # engine/cpu_threads.py
        ...

Why not torch's default (one per core): the converter is a long run of medium-sized ops,
and on a machine whose cores another job holds, every parallel op waits for the core that
job has. Measured on a 2-core machine under a load of about 3 (SmolLM2-135M, two layers of
the measurement): torch's 2 threads took 20-25 s a layer, 1 thread 8-10 s. On idle cores
the threads pay off again, so the count follows the load when the conversion starts.
"""

from __future__ import annotations

import os

import torch


def idle_cpu_threads() -> int:
    """Cores not busy by the 1-minute load average, at least 1, at most torch's count."""
    try:
        busy = os.getloadavg()[0]
    except OSError:  # not available on this platform: trust torch's default
        return torch.get_num_threads()
    idle = (os.cpu_count() or 1) - round(busy)
    return max(1, min(torch.get_num_threads(), idle))
