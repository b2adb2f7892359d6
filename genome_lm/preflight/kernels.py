"""Preflight sections ``parity`` (each kernel against its reference) and ``speed``.

Bounds (relative Frobenius error against an fp32/fp64 reference on the same input values):
tensor-core paths ("triton", "fla": bf16 operands, fp32 accumulation) 2e-2; the fp32 paths 2e-5;
the indexer's pool scores 1e-4 (fp32 sums of the same bf16 products, in another order).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from genome_lm_kernels import resolve_backend

from .model import precision

BOUND = {"triton": 2e-2, "fla": 2e-2, "triton-fp32": 2e-5}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _available(backend: str) -> str | None:
    """None when the backend can run here, else why not."""
    if backend == "fla":

        try:
            with warnings.catch_warnings():  # fla warns at import on a machine without a GPU
                warnings.simplefilter("ignore")
                import fla.ops.kda  # noqa: F401
        except Exception as err:  # noqa: BLE001 - ImportError, or its CUDA-less import failing
            return f"fla-core not importable ({type(err).__name__})"
        if not torch.cuda.is_available():
            return "fla-core's kernels need a GPU"
    return None


# --- KDA ------------------------------------------------------------------------------------

def kda_shape(ctx) -> dict:
    return dict(B=1, T=4096, H=64, K=128, V=128) if ctx.gpu else dict(B=1, T=130, H=2, K=16, V=16)


def kda_inputs(B, T, H, K, V, device, seed=0) -> dict:
    """glm5_next-like inputs: unnormalised q, k (the op normalises), the safe gate (bound -5)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g).to(device)

    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=-5 * torch.sigmoid(r(B, T, H, K)),
                beta=torch.sigmoid(r(B, T, H)), initial_state=0.1 * r(B, H, K, V))


def _kda_grads(x: dict, backend: str, w_o, w_S):
    from genome_lm_kernels.kda import kda

    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    o, S = kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
               initial_state=leaves["initial_state"],
               output_final_state=True, use_qk_l2norm=True,
               backend=resolve_backend(backend, x["q"].device))
    grads = torch.autograd.grad((o.float() * w_o).sum() + (S * w_S).sum(), list(leaves.values()))
    return {"o": o.detach(), "final state": S.detach(), **{f"d{n}": gr for n, gr in zip(leaves, grads)}}


def kda_parity(ctx) -> list[dict]:
    s = kda_shape(ctx)
    x32 = kda_inputs(**s, device=ctx.device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    w_o = torch.randn(s["B"], s["T"], s["H"], s["V"], generator=gen).to(ctx.device)
    w_S = torch.randn(s["B"], s["H"], s["K"], s["V"], generator=gen).to(ctx.device)
    rows = []
    for backend in ("triton", "triton-fp32", "fla"):
        row = {"op": "kda", "backend": backend, "shape": "B{B} T{T} H{H} K{K} V{V}".format(**s)}
        why = _available(backend)
        if why:
            rows.append({**row, "note": f"skipped: {why}"})
            continue
        # the fast paths get the model's bf16 q, k, v (g, beta stay fp32, as the layer passes them)
        x = x32 if backend == "triton-fp32" else {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n,
                                                  t in x32.items()}
        got = _kda_grads(x, backend, w_o, w_S)
        want = _kda_grads({n: t.float() for n, t in x.items()}, "torch", w_o, w_S)
        errors = {name: _rel(got[name], want[name]) for name in want}
        worst = max(errors, key=errors.get)
        rows.append({**row, "reference": "torch chunked path, fp32", "worst": worst, "rel_err": errors[worst],
                     "bound": BOUND[backend], "ok": errors[worst] <= BOUND[backend], "errors": errors})
    return rows


# --- DSA ------------------------------------------------------------------------------------

def _selection(B, T, kpool, topk, device, seed=0):
    from genome_lm_kernels import dsa

    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, w = (torch.randn(*s, generator=g).to(device) for s in ((B, T, 4, 32), (B, T, 32), (B, T, 4)))
    return dsa.select_tokens(q, k, w, kpool=kpool, topk=topk, backend=resolve_backend("torch", device), chunk=1024)[0]


def mla_parity(ctx) -> list[dict]:
    from genome_lm_kernels import dsa

    B, T, H, D, dv, kpool, topk = (1, 4096, 32, 512, 512, 4, 2048) if ctx.gpu else (1, 70, 3, 32, 16, 4, 16)
    idx = _selection(B, T, kpool, topk, ctx.device)
    g = torch.Generator(device="cpu").manual_seed(2)
    q32, kv32, do = (torch.randn(*s, generator=g).to(ctx.device) for s in ((B, T, H, D), (B, T, D), (B, T, H, dv)))

    def run(q, kv, backend):
        q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
        o, lse = dsa.sparse_mla(q, kv, idx, scale=D**-0.5, dv=dv, backend=resolve_backend(backend, ctx.device))
        dq, dkv = torch.autograd.grad((o.to(do.dtype) * do.to(o.dtype)).sum(), (q, kv))
        return {"o": o.detach(), "lse": lse.detach(), "dq": dq, "dkv": dkv}

    rows = []
    for backend in ("triton", "triton-fp32"):
        q, kv = (q32, kv32) if backend == "triton-fp32" else (q32.bfloat16(), kv32.bfloat16())
        got = run(q, kv, backend)
        want = run(q.double(), kv.double(), "reference")
        errors = {n: _rel(got[n][torch.isfinite(want[n])] if n == "lse" else got[n],
                          want[n][torch.isfinite(want[n])] if n == "lse" else want[n]) for n in want}
        worst = max(errors, key=errors.get)
        rows.append({"op": "sparse mla", "backend": backend, "shape": f"T{T} H{H} D{D} dv{dv} top{topk} kpool{kpool}",
                     "reference": "dense masked attention, fp64", "worst": worst, "rel_err": errors[worst],
                     "bound": BOUND[backend], "ok": errors[worst] <= BOUND[backend], "errors": errors})
    return rows


def indexer_parity(ctx) -> list[dict]:
    from genome_lm_kernels import dsa
    from genome_lm_kernels.dsa import indexer
    from genome_lm_kernels.dsa import triton as dsa_triton

    B, T, Hi, Di, kpool, topk, chunk = (1, 8192, 32, 128, 4, 2048, 1024) if ctx.gpu else (1, 256, 2, 16, 4, 16, 64)
    g = torch.Generator(device="cpu").manual_seed(3)
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    q = torch.randn(B, T, Hi, Di, generator=g).to(ctx.device, dtype)
    k = torch.randn(B, T, Di, generator=g).to(ctx.device, dtype)
    w = torch.randn(B, T, Hi, generator=g).to(ctx.device) * Hi**-0.5
    kp = indexer.pool_keys(k, kpool=kpool)
    t0 = T - chunk
    got = dsa_triton.pool_scores_chunk(q[:, t0:], kp, w[:, t0:], t0, Di**-0.5, kpool)
    want = indexer.pool_scores_chunk(q[:, t0:], kp, w[:, t0:], t0, Di**-0.5, kpool)
    finite = torch.isfinite(want)
    same_mask = bool(torch.equal(finite, torch.isfinite(got)))
    err = _rel(got[finite], want[finite])
    triton, torch_path = resolve_backend("triton", ctx.device), resolve_backend("torch", ctx.device)
    idx_t = dsa.select_tokens(q, k, w, kpool=kpool, topk=topk, backend=triton, chunk=chunk)[0]
    idx_r = dsa.select_tokens(q, k, w, kpool=kpool, topk=topk, backend=torch_path, chunk=chunk)[0]
    agree = (idx_t == idx_r).all(-1).float().mean().item()
    return [{"op": "indexer scores", "backend": "triton", "shape": f"T{T} Hi{Hi} Di{Di} kpool{kpool}",
             "reference": "torch path, fp32", "worst": "scores", "rel_err": err, "bound": 1e-4,
             "ok": err <= 1e-4 and same_mask},
            {"op": "indexer selection", "backend": "triton", "shape": f"T{T} top{topk}",
             "reference": "torch path", "worst": "queries with the same selection", "rel_err": 1 - agree,
             "bound": 1e-3, "ok": 1 - agree <= 1e-3}]


def parity(ctx) -> tuple[list[dict], str]:

    rows = kda_parity(ctx) + mla_parity(ctx) + indexer_parity(ctx) + precision(ctx)
    return rows, ("relative error of the worst output or gradient against the reference on the same values; "
                  "the model row: bf16 logits against fp32 with routing and selection replayed, flips counted")


# --- speed ----------------------------------------------------------------------------------

def _timed(fn, ctx, repeats: int) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if ctx.gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if ctx.gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measure(ctx, rows, base, modes, repeats):
    """Time each (mode, fn) of ``modes``; an out-of-memory is a row with its note, not a failure."""
    for mode, fn in modes:
        row = {**base, "mode": mode}
        try:
            ms = _timed(fn, ctx, repeats)
            rows.append({**row, "ms": ms, "tokens_per_s": base["T"] / ms * 1e3})
        except torch.OutOfMemoryError:
            rows.append({**row, "note": "out of memory"})
        if ctx.gpu:
            torch.cuda.empty_cache()


def _kda_speed(ctx, T, repeats, rows):
    from genome_lm_kernels.kda import kda

    H, K = (64, 128) if ctx.gpu else (2, 16)
    x = kda_inputs(1, T, H, K, K, ctx.device)
    x = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in x.items()}
    x["initial_state"] = None
    for backend in ("triton", "fla"):
        base = {"op": f"kda H{H} x {K}", "impl": backend, "T": T}
        why = _available(backend)
        if why:
            rows.append({**base, "note": f"skipped: {why}"})
            continue
        leaves = {n: t.requires_grad_() for n, t in x.items() if t is not None}
        resolved = resolve_backend(backend, ctx.device)

        def forward():
            with torch.no_grad():
                return kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], use_qk_l2norm=True,
                           backend=resolved)

        def forward_backward():
            o, _ = kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], use_qk_l2norm=True,
                       backend=resolved)
            torch.autograd.grad(o.float().sum(), list(leaves.values()))

        _measure(ctx, rows, base, [("forward", forward), ("forward+backward", forward_backward)], repeats)


def _dsa_speed(ctx, T, repeats, rows):
    from genome_lm_kernels import dsa

    H, D, dv, Hi, Di, kpool, topk, chunk = ((64, 512, 512, 32, 128, 4, 2048, 1024) if ctx.gpu
                                            else (2, 32, 32, 2, 16, 4, 16, 64))
    g = torch.Generator(device="cpu").manual_seed(4)
    bf16 = torch.bfloat16 if ctx.gpu else torch.float32

    def r(*s, dtype=bf16):
        return torch.randn(*s, generator=g).to(ctx.device, dtype)

    qi, ki, wi = r(1, T, Hi, Di), r(1, T, Di), r(1, T, Hi, dtype=torch.float32)
    q, kv = r(1, T, H, D).requires_grad_(), r(1, T, D).requires_grad_()
    backend = resolve_backend("triton", ctx.device)

    def select():
        with torch.no_grad():
            return dsa.select_tokens(qi, ki, wi, kpool=kpool, topk=topk, backend=backend, chunk=chunk)[0]

    idx = select()

    def forward():
        with torch.no_grad():
            dsa.sparse_mla(q, kv, select(), scale=D**-0.5, dv=dv, backend=backend)

    def forward_backward():
        o, _ = dsa.sparse_mla(q, kv, select(), scale=D**-0.5, dv=dv, backend=backend)
        torch.autograd.grad(o.float().sum(), (q, kv))

    _measure(ctx, rows, {"op": f"dsa indexer {Hi}x{Di} + sparse mla H{H} D{D}", "impl": "genome-lm triton", "T": T},
             [("indexer only", select), ("forward", forward), ("forward+backward", forward_backward)], repeats)
    del idx
    # dense causal attention over per-head q, k (qk 256) and v (256), through torch SDPA
    Hd, dqk = (64, 256) if ctx.gpu else (2, 32)
    qd, kd, vd = (r(1, Hd, T, dqk).requires_grad_() for _ in range(3))

    def dense(backward: bool):
        def call():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backends = [SDPBackend.FLASH_ATTENTION] if ctx.gpu else [SDPBackend.MATH]
            with sdpa_kernel(backends), torch.set_grad_enabled(backward):
                o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                if backward:
                    torch.autograd.grad(o.float().sum(), (qd, kd, vd))
        return call

    _measure(ctx, rows, {"op": f"dense causal attention H{Hd} qk/v {dqk}",
                         "impl": "torch SDPA " + ("flash" if ctx.gpu else "math"), "T": T},
             [("forward", dense(False)), ("forward+backward", dense(True))], repeats)


def speed(ctx) -> tuple[list[dict], str]:
    lengths = ((32768,) if ctx.quick else (32768, 131072)) if ctx.gpu else (256,)
    repeats = 3 if ctx.gpu else 1
    rows: list[dict] = []
    for T in lengths:
        _kda_speed(ctx, T, repeats, rows)
        _dsa_speed(ctx, T, repeats, rows)
    _ratios(rows)
    note = recommendation(rows)
    if not ctx.gpu:
        note = "CPU under Triton's interpreter: the times check that every path runs, they are not GPU figures. " + note
    return rows, note


def _ratios(rows: list[dict]) -> None:
    """Each row's time over its baseline's (KDA: fla's chunk_kda; DSA: dense SDPA), same T and mode."""
    def key(r):
        return r["T"], r.get("mode"), "kda" if r["op"].startswith("kda") else "attention"

    base = {key(r): r["ms"] for r in rows if "ms" in r and (r["impl"] == "fla" or r["impl"].startswith("torch SDPA"))}
    for r in rows:
        b = base.get(key(r))
        if "ms" in r and b and r["impl"] != "fla" and not r["impl"].startswith("torch SDPA"):
            r["x_baseline_time"] = r["ms"] / b


def recommended_backend(rows: list[dict]) -> tuple[str | None, dict]:
    """The KDA backend that was faster forward+backward at the longest measured length, and the
    times it was chosen from (None when fewer than two backends ran)."""
    timed = [r for r in rows if r["op"].startswith("kda") and r.get("mode") == "forward+backward" and "ms" in r]
    if not timed:
        return None, {}
    T = max(r["T"] for r in timed)
    at = {r["impl"]: r["ms"] for r in timed if r["T"] == T}
    return (min(at, key=at.get) if len(at) > 1 else None), {"T": T, "ms": at}


def recommendation(rows: list[dict]) -> str:
    best, basis = recommended_backend(rows)
    if not basis:
        return ""
    if best is None:
        return f"KDA: only {', '.join(basis['ms'])} measured (model.kernel_backend=triton)"
    other = max(basis["ms"], key=basis["ms"].get)
    return (f"KDA forward+backward at {basis['T']:,}: {best} {basis['ms'][best]:.1f} ms vs {other} "
            f"{basis['ms'][other]:.1f} ms -> set model.kernel_backend={best} in the run's config")
