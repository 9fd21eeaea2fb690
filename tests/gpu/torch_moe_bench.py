#!/usr/bin/env python3
"""PyTorch's MoE layer, forward and backward, timed on the device gpu_bench runs on.

The anchor that tests/gpu/run.sh sets Pith's `moe_layer` line against: the same shapes
(Qwen3-30B-A3B, DeepSeek-V2-Lite; 16k tokens), the same layer (router GEMM, softmax,
top-k with renormalized gates, dropless, expert FFN w1 -> bias -> gelu(tanh) -> w2 -> bias,
gate-weighted combine), the backward through autograd of sum(out * dout). Variants:

  loop_fp32      the usual eager implementation: tokens sorted by expert, one FFN per
                 expert in a Python loop (fp32, TF32 off: the precision Pith's fp32 uses)
  loop_bf16      the same loop in bf16
  grouped_bf16   torch._grouped_mm over the sorted tokens (bf16), where it exists

Prints one line per shape and variant: `torch_moe <shape> <variant> <ms>` (or the reason
it could not run). Exit status 0 when at least the fp32 loop ran.
"""
import sys
import time

import torch
import torch.nn.functional as fn

SHAPES = [("qwen3-30b-a3b", 2048, 768, 128, 8), ("deepseek-v2-lite", 2048, 1408, 64, 6)]


def make(c, f, e, dtype, gen):
    def p(*shape, scale):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype).requires_grad_()
    return dict(wr=p(c, e, scale=0.02), w1=p(e, c, f, scale=0.02), b1=p(e, f, scale=0.02),
                w2=p(e, f, c, scale=0.02), b2=p(e, c, scale=0.02))


def route(x, wr, k):
    probs = (x @ wr).float().softmax(-1)
    gate, idx = probs.topk(k, dim=-1)
    gate = gate / gate.sum(-1, keepdim=True)
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    return gate.flatten()[order], flat[order], order // k


def layer_loop(x, w, k):
    gate, expert, token = route(x, w["wr"], k)
    counts = torch.bincount(expert, minlength=w["w1"].shape[0]).tolist()  # a host sync
    xs = x[token]
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = fn.gelu(xs[start:start + n] @ w["w1"][e] + w["b1"][e], approximate="tanh")
        ys.append(h @ w["w2"][e] + w["b2"][e])
        start += n
    y = torch.cat(ys) * gate.unsqueeze(1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def layer_grouped(x, w, k):
    gate, expert, token = route(x, w["wr"], k)
    offs = torch.cumsum(torch.bincount(expert, minlength=w["w1"].shape[0]), 0).to(torch.int32)
    xs = x[token]
    h = fn.gelu(torch._grouped_mm(xs, w["w1"], offs=offs) + w["b1"][expert], approximate="tanh")
    y = (torch._grouped_mm(h, w["w2"], offs=offs) + w["b2"][expert]) * gate.unsqueeze(1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def time_layer(layer, shape, dtype, tokens, iters):
    _, c, f, e, k = shape
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = make(c, f, e, dtype, gen)
    x = torch.randn(tokens, c, generator=gen, device="cuda").to(dtype).requires_grad_()
    dout = (torch.randn(tokens, c, generator=gen, device="cuda") * 1e-3).to(dtype)

    def step():
        out = layer(x, w, k)
        out.backward(dout)

    step()  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    if not torch.cuda.is_available():
        print("torch_moe: no CUDA device visible to torch")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"torch_moe on {torch.cuda.get_device_name()} torch {torch.__version__} tokens={tokens}")
    ok = True
    variants = [("loop_fp32", layer_loop, torch.float32), ("loop_bf16", layer_loop, torch.bfloat16),
                ("grouped_bf16", layer_grouped, torch.bfloat16)]
    for shape in SHAPES:
        for name, layer, dtype in variants:
            if name.startswith("grouped") and not hasattr(torch, "_grouped_mm"):
                print(f"torch_moe {shape[0]} {name} unavailable: no torch._grouped_mm")
                continue
            try:
                ms = time_layer(layer, shape, dtype, tokens, iters)
                print(f"torch_moe {shape[0]} {name} {ms:.2f} ms", flush=True)
            except Exception as e:  # one variant's failure is a reported line, not a crash
                print(f"torch_moe {shape[0]} {name} failed: {type(e).__name__}: {e}"[:300])
                ok = ok and name != "loop_fp32"
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
