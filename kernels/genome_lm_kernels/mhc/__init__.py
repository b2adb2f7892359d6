"""mHC (manifold-constrained hyper-connections): the Sinkhorn normalisation of the residual
streams' mixing matrix and the two per-token products around each block.

    sinkhorn(z [.., N, N], iters, eps, *, backend, compiled=False) -> [.., N, N] (about doubly stochastic)
    collapse(pre [.., N], streams [.., N, D], *, backend) -> the block's input [.., D]
    merge(post [.., N], comb [.., N, N], block_out [.., D], streams [.., N, D], *, backend) -> new streams

What runs is the backend's: "reference" autograd through the plain loop and formulas
(``reference.py``); "torch" the Sinkhorn with a recomputing backward (``recompute.py``, through
``torch.compile`` when ``compiled``) and the formulas as torch ops, or, where the backend's
``native`` is on and the inputs are fp32 CPU tensors, the C kernels (``native.py``,
``cpu/mhc.c``). The GPU backends run the torch path (there are no Triton kernels for mHC: its
work is a few elementwise passes over the streams).
"""

from __future__ import annotations

import torch

from .. import KernelBackend, resolved
from . import reference


def sinkhorn(z: torch.Tensor, iters: int, eps: float, *, backend: KernelBackend, compiled: bool = False
             ) -> torch.Tensor:
    backend = resolved(backend, "sinkhorn")
    if backend.name == "reference":
        return reference.sinkhorn(z, iters, eps)
    from .native import takes
    from .recompute import Sinkhorn

    return Sinkhorn.apply(z, iters, eps, compiled, backend.native and takes(z))


def collapse(pre: torch.Tensor, streams: torch.Tensor, *, backend: KernelBackend) -> torch.Tensor:
    if resolved(backend, "collapse").native:
        from .native import Collapse, takes

        if takes(pre, streams):
            return Collapse.apply(pre, streams)
    return reference.collapse(pre, streams)


def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor, *,
          backend: KernelBackend) -> torch.Tensor:
    if resolved(backend, "merge").native:
        from .native import Merge, takes

        if takes(post, comb, block_out, streams):
            return Merge.apply(post, comb, block_out, streams)
    return reference.merge(post, comb, block_out, streams)
