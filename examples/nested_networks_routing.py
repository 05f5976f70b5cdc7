"""Gradient routing in plain PyTorch: ``y = B(A(x))``, ``loss1`` trains A and B, ``loss2`` A only.

One forward pass, then ``routing.backward`` with ``loss2`` blocked from ``B``. The script
checks the gradients against the naive two-pass computation (two forwards; the second
differentiated w.r.t. ``A`` only), shows that the common ``y.detach()`` answer leaves
``A`` without ``loss2``'s gradient, and times the three ways.

Run: ``python examples/nested_networks_routing.py`` (``--smoke`` for a seconds-long check).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from pyro_gradroute import routing


def mlp(n: int, w: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(w, w), nn.Tanh())])


def grads_of(params) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    return out


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.layers, args.batch = 16, 2, 8
    torch.set_num_threads(1)
    torch.manual_seed(0)
    A, B = mlp(args.layers, args.width), mlp(args.layers, args.width)
    x = torch.randn(args.batch, args.width)
    params = [*A.parameters(), *B.parameters()]

    def losses(y):
        return y.pow(2).mean(), y.sin().mean()

    def routed():
        loss1, loss2 = losses(B(A(x)))
        routing.backward({"loss1": loss1, "loss2": loss2}, block={"loss2": [B]})

    def two_pass():
        loss1, _ = losses(B(A(x)))
        loss1.backward()
        _, loss2 = losses(B(A(x)))
        grads = torch.autograd.grad(loss2, list(A.parameters()))
        for p, g in zip(A.parameters(), grads):
            p.grad += g

    def detach_trick():  # the common, wrong answer: no gradient of loss2 reaches A
        h = A(x)
        y = B(h)
        y_cut = y.detach().requires_grad_(True)
        loss1, _ = losses(y)
        _, loss2 = losses(y_cut)
        (loss1 + loss2).backward()

    results = {}
    for name, fn in (("routed", routed), ("two-pass", two_pass), ("y.detach()", detach_trick)):
        fn()
        results[name] = grads_of(params)
    rel = max(
        ((a - b).norm() / b.norm()).item() for a, b in zip(results["routed"], results["two-pass"])
    )
    wrong = max(
        ((a - b).norm() / b.norm()).item()
        for a, b in zip(results["y.detach()"][: len(list(A.parameters()))], results["two-pass"])
    )
    print(f"routed vs two-pass: max relative difference {rel:.1e} (exact up to float rounding)")
    print(f"y.detach() trick vs two-pass on A's gradients: relative difference {wrong:.2f} (wrong)")

    def unrouted():
        loss1, loss2 = losses(B(A(x)))
        (loss1 + loss2).backward()

    if rel > 1e-5:
        raise SystemExit(f"routed gradients differ from the two-pass reference: {rel:.1e}")
    if args.smoke:  # tiny graphs: timings would measure Python overhead only
        return rel
    times = {}
    for name, fn in (("unrouted", unrouted), ("routed", routed), ("two-pass", two_pass)):
        fn()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        times[name] = time.perf_counter() - t0
        grads_of(params)
    print(
        "time per step relative to an unrouted (loss1 + loss2).backward(): "
        + ", ".join(f"{k} {v / times['unrouted']:.2f}x" for k, v in times.items())
        + " (one run; see benchmarks/bench_route.py for interleaved measurements)"
    )
    return rel


if __name__ == "__main__":
    main()
