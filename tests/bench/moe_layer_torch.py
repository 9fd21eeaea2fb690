#!/usr/bin/python3
"""The MoE layer of tests/bench/moe_layer_bench.cc written naively in PyTorch, timed on
this machine, and compared with Pith's CPU backend measured in the same run.

    /usr/bin/python3 tests/bench/moe_layer_torch.py build/tests/bench/moe_layer_bench

Same shapes, fwd + bwd, dropless top-2 with renormalized gates and the aux/z losses.
Threads: torch's own pool at 1 (its default here) while its OpenBLAS uses the machine's
cores; forcing torch to 2 threads oversubscribes and is slower.
Prints ms/iter for both and the speed-up of Pith over PyTorch.
"""
import json
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

SHAPES = [(4096, 256, 1024, 16, 2), (4096, 256, 512, 64, 2)]


def torch_layer_ms(tokens, d, f, experts, k, iters=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=g, requires_grad=True)
    wr = (torch.randn(d, experts, generator=g) * 0.05).requires_grad_()
    w1 = (torch.randn(experts, d, f, generator=g) * 0.05).requires_grad_()
    b1 = torch.zeros(experts, f, requires_grad=True)
    w2 = (torch.randn(experts, f, d, generator=g) * 0.05).requires_grad_()
    b2 = torch.zeros(experts, d, requires_grad=True)
    dout = torch.randn(tokens, d, generator=g) * 1e-3

    def step():
        logits = x @ wr
        prob = logits.softmax(-1)
        gates, top = prob.topk(k, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(experts):
            tok, slot = torch.nonzero(top == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = F.gelu(x[tok] @ w1[e] + b1[e], approximate="tanh")
            out = out.index_add(0, tok, gates[tok, slot].unsqueeze(1) * (h @ w2[e] + b2[e]))
        frac = torch.bincount(top.flatten(), minlength=experts).float() / (tokens * k)
        aux = experts * (frac * prob.mean(0)).sum()
        z = (torch.logsumexp(logits, -1) ** 2).mean()
        loss = (out * dout).sum() + 0.01 * aux + 0.001 * z
        loss.backward()
        for t in (x, wr, w1, b1, w2, b2):
            t.grad = None

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters * 1000


def pith_layer_ms(bench):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([bench, "--benchmark_filter=BM_MoeLayer", f"--benchmark_out={out.name}",
                        "--benchmark_out_format=json"], check=True, capture_output=True)
        runs = json.load(open(out.name))["benchmarks"]
    return [r["real_time"] for r in runs if r["run_type"] == "iteration"]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    pith = pith_layer_ms(sys.argv[1])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s)")
    for shape, pith_ms in zip(SHAPES, pith):
        torch_ms = torch_layer_ms(*shape)
        print(f"tokens {shape[0]} d {shape[1]} f {shape[2]} E {shape[3]} k {shape[4]}: "
              f"PyTorch {torch_ms:7.1f} ms/iter  Pith {pith_ms:7.1f} ms/iter  "
              f"Pith is {torch_ms / pith_ms:.2f}x faster")


if __name__ == "__main__":
    main()
