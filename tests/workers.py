"""Multi-process checks: start ``world`` copies of a worker script joined by a free local port."""

import json
import subprocess
import sys

from genome_lm.engine.parallel import free_port


def run_workers(script, world: int, spec: dict, timeout: int = 600) -> None:
    """``python SCRIPT RANK WORLD PORT JSON`` for every rank; each must exit 0 (else its stderr's
    end is the assertion's message)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
