"""Pipeline parallel: the one-forward-one-backward (1F1B) schedule over a model split into stages.

Each pipeline rank holds a contiguous run of layers (``GLM5Model.global_layers``); the first
also holds the embedding, the last the final norm, the output layer and the loss. Between
stages travel the mHC residual streams ``[S, B, N, D]`` forward and their gradients backward,
through megatron-core's ``P2PCommunicator``.

The schedule is megatron-core's non-interleaved one: stage ``s`` of ``p`` first runs
``p - s - 1`` forward passes (warm-up), then alternates one forward and one backward, then
runs the remaining backward passes, so at most ``p - s`` micro-batches' activations are alive
on a stage. megatron-core's own ``forward_backward_pipelining_without_interleaving`` allocates
its token counter on ``"cuda"`` and cannot run on a CPU, which is why the loop is written here
over megatron-core's communicator.

A stage's own loss terms (the indexer losses of its DSA layers; on the last stage also the
LM loss) join backward together with the gradient that arrives for its output, so every stage
ends with exactly the gradients of the whole model's loss.

Once a micro-batch's output streams have been sent, only their autograd history is needed: their
data is freed (megatron-core's ``deallocate_output_tensor``): a stage keeps no copy of the
streams of its in-flight micro-batches (the next stage holds them). Backward then calls the
autograd engine directly, as megatron-core's ``custom_backward`` does, since the freed tensor no
longer has the gradient's shape.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

# forward(micro-batch index, input streams or None on the first stage)
#   -> (streams to send, or None on the last stage; this stage's loss term, or None)
StageForward = Callable[[int, torch.Tensor | None], tuple[torch.Tensor | None, torch.Tensor | None]]


def communicator(model: GLM5Model):
    """megatron-core's point-to-point communicator over the model's pipeline group."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return P2PCommunicator(pp_group=model.pg.pp, config=model.tf_config)


def _backward(tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward`` without its shape check (a sent output's data is freed)."""
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(tensors=tuple(tensors), grad_tensors=tuple(grads), keep_graph=False,
                                            create_graph=False, inputs=(), allow_unreachable=True,
                                            accumulate_grad=True)


def run_1f1b(model: GLM5Model, n_micro: int, shape: tuple[int, ...], forward: StageForward, comm=None,
             sync: Callable[[int], ContextManager] | None = None) -> None:
    """Forward and backward of ``n_micro`` micro-batches through this rank's stage.

    ``shape``: the streams' shape for every micro-batch (``GLM5Model.stream_shape``). Gradients
    accumulate in the parameters (or megatron-core DDP's buffers) as in a plain loop. ``sync(i)``:
    a context entered around micro-batch ``i``'s backward (the trainer's deferred gradient
    reduction: ``step.StepSpec.no_sync``); backward runs in micro-batch order on every stage."""
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    comm = comm or communicator(model)
    stage, stages = model.pg.pp.rank(), model.pg.pp.size()
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, n_micro)
    steady = n_micro - warmup
    pending: deque = deque()  # (input, output, loss) of micro-batches whose backward is still to run
    done = [0]  # backward passes run

    def run_forward(i: int, received):
        if received is not None:
            received.requires_grad_()
        out, loss = forward(i, received)
        out = None if out is None else out.contiguous()  # what gloo and NCCL send
        pending.append((received, out, loss))
        return out

    def run_backward(grad):
        received, out, loss = pending.popleft()
        tensors, grads = [], []
        # a stage whose tensors are all frozen (LoRA adapters on other stages only) has nothing to
        # differentiate: its outputs and losses hold no graph
        if out is not None and out.requires_grad:
            tensors.append(out)
            grads.append(grad)
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grads.append(torch.ones_like(loss))
        if tensors:
            with sync(done[0]) if sync is not None else nullcontext():
                _backward(tensors, grads)
        done[0] += 1
        return None if received is None else received.grad

    for i in range(warmup):
        out = run_forward(i, comm.recv_forward(shape, first))
        comm.send_forward(out, last)
        deallocate_output_tensor(out, True)
    received = comm.recv_forward(shape, first) if steady else None
    for j in range(steady):
        out = run_forward(warmup + j, received)
        grad = comm.send_forward_recv_backward(out, shape, last)
        deallocate_output_tensor(out, True)
        grad_in = run_backward(grad)
        if j == steady - 1:
            comm.send_backward(grad_in, first)
        else:
            received = comm.send_backward_recv_forward(grad_in, shape, first)
    for _ in range(warmup):
        comm.send_backward(run_backward(comm.recv_backward(shape, last)), first)
