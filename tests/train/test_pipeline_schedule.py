"""genome-lm's 1F1B schedule on one stage, with a stand-in communicator: the order of forward,
backward and messages is megatron-core's, sent outputs are freed, and the gradients are those
of the whole loss (each micro-batch's arriving gradient plus the stage's own loss term)."""

from types import SimpleNamespace

import pytest
import torch

from genome_lm.train.pipeline import run_1f1b


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _Comm:
    """Records the schedule's messages; the gradient arriving for micro-batch i is ``grads[i]``,
    an input arriving from the stage before is a fresh leaf."""

    def __init__(self, grads, log):
        self.grads, self.log, self.sent = grads, log, []
        self.backward_count = 0

    def _next_grad(self):
        grad = self.grads[self.backward_count]
        self.backward_count += 1
        return grad

    def recv_forward(self, shape, first):
        self.log.append("recv_forward")
        return None if first else torch.ones(shape, requires_grad=True)

    def send_forward(self, out, last):
        self.log.append("send_forward")
        self.sent.append(out)

    def send_forward_recv_backward(self, out, shape, last):
        self.log.append("send_forward_recv_backward")
        self.sent.append(out)
        return None if last else self._next_grad()

    def recv_backward(self, shape, last):
        self.log.append("recv_backward")
        return None if last else self._next_grad()

    def send_backward(self, grad, first):
        self.log.append("send_backward")

    def send_backward_recv_forward(self, grad, shape, first):
        self.log.append("send_backward_recv_forward")
        return None if first else torch.ones(shape, requires_grad=True)


@pytest.mark.parametrize("n_micro", [4, 1])
def test_first_of_two_stages(n_micro):
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    grads = [torch.randn(3) for _ in range(n_micro)]
    log = []
    comm = _Comm(grads, log)
    model = SimpleNamespace(pg=SimpleNamespace(pp=_Group(0, 2)))

    def forward(i, received):
        assert received is None  # the first stage reads its own tokens
        log.append(f"F{i}")
        out = w * (i + 1)  # the streams sent on
        out.register_hook(lambda g, i=i: log.append(f"B{i}"))
        return out, 0.5 * (w ** 2).sum() * (i + 1)  # the stage's own loss term (an indexer loss)

    run_1f1b(model, n_micro, (3,), forward, comm)
    if n_micro == 4:  # warm-up 1, steady 3, cool-down 1: megatron-core's order
        assert log == ["recv_forward", "F0", "send_forward", "recv_forward",
                       "F1", "send_forward_recv_backward", "B0", "send_backward_recv_forward",
                       "F2", "send_forward_recv_backward", "B1", "send_backward_recv_forward",
                       "F3", "send_forward_recv_backward", "B2", "send_backward",
                       "recv_backward", "B3", "send_backward"]
    else:  # fewer micro-batches than stages: all warm-up
        assert log == ["recv_forward", "F0", "send_forward", "recv_backward", "B0", "send_backward"]
    assert len(comm.sent) == n_micro and all(out.numel() == 1 for out in comm.sent)  # data freed once sent
    expected = sum(g * (i + 1) + w.detach() * (i + 1) for i, g in enumerate(grads))
    torch.testing.assert_close(w.grad, expected)


def test_last_of_two_stages_sends_back_the_input_gradients():
    torch.manual_seed(1)
    w = torch.randn(3, requires_grad=True)
    log = []
    received = []

    class Comm(_Comm):
        def send_backward(self, grad, first):
            received.append(grad.clone())
            super().send_backward(grad, first)

        def send_backward_recv_forward(self, grad, shape, first):
            received.append(grad.clone())
            return super().send_backward_recv_forward(grad, shape, first)

    comm = Comm([], log)
    model = SimpleNamespace(pg=SimpleNamespace(pp=_Group(1, 2)))

    def forward(i, x):
        log.append(f"F{i}")
        return None, (x * w * (i + 1)).sum()  # the loss, on the last stage

    run_1f1b(model, 3, (3,), forward, comm)
    assert log == ["recv_forward", "F0", "send_forward_recv_backward", "send_backward_recv_forward",
                   "F1", "send_forward_recv_backward", "send_backward_recv_forward",
                   "F2", "send_forward_recv_backward", "send_backward"]
    for i, grad in enumerate(received):  # d loss_i / d input = w * (i + 1)
        torch.testing.assert_close(grad, w.detach() * (i + 1))
    torch.testing.assert_close(w.grad, torch.full((3,), 6.0))  # inputs of ones: 1 + 2 + 3
