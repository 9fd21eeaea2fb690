#!/usr/bin/python3
"""An independent PyTorch implementation of Pith's moe-gpt (docs/DESIGN.md §3).

It writes the golden files Pith's C++ tests compare against at run time (they never need
PyTorch). Run with Debian's python3-torch:

    /usr/bin/python3 tests/golden/moe_gpt_reference.py tests/golden

It is also a tool: `--spec S --init W --tokens D --steps N --loss_log F` trains like
`pith-worker --standalone` and writes the same `<step> <loss> <ce>` lines.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"F32": (torch.float32, 4), "I32": (torch.int32, 4), "I64": (torch.int64, 8)}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, size = DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[base + b:base + e]), dtype=dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def write_safetensors(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        t = t.detach().contiguous()
        raw = t.numpy().tobytes()
        dtype = {torch.float32: "F32", torch.int32: "I32", torch.int64: "I64"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def tensor_names(m):
    names = ["wte", "wpe", "ln_f.w", "ln_f.b"]
    for l in range(m["n_layer"]):
        p = f"h.{l}."
        names += [p + s for s in ("ln1.w", "ln1.b", "attn.qkv.w", "attn.qkv.b", "attn.o.w",
                                   "attn.o.b", "ln2.w", "ln2.b", "moe.router.w")]
        for e in range(m["n_expert"]):
            names += [f"{p}moe.e{e}.{s}" for s in ("w1", "b1", "w2", "b2")]
    return names


def init_weights(m, seed):
    """Seeded init of DESIGN §3 (torch's RNG; Pith's differs, so golden runs share a file)."""
    g = torch.Generator().manual_seed(seed)
    C, L, E, f = m["d_model"], m["n_layer"], m["n_expert"], m["d_ff"]
    shapes = {"wte": [m["vocab_size"], C], "wpe": [m["seq_len"], C], "ln_f.w": [C], "ln_f.b": [C]}
    for l in range(L):
        p = f"h.{l}."
        shapes.update({p + "ln1.w": [C], p + "ln1.b": [C], p + "attn.qkv.w": [C, 3 * C],
                       p + "attn.qkv.b": [3 * C], p + "attn.o.w": [C, C], p + "attn.o.b": [C],
                       p + "ln2.w": [C], p + "ln2.b": [C], p + "moe.router.w": [C, E]})
        for e in range(E):
            q = f"{p}moe.e{e}."
            shapes.update({q + "w1": [C, f], q + "b1": [f], q + "w2": [f, C], q + "b2": [C]})
    out = {}
    for name in tensor_names(m):
        shape = shapes[name]
        if name.endswith(("ln1.w", "ln2.w")) or name == "ln_f.w":
            out[name] = torch.ones(shape)
        elif len(shape) == 2:
            std = 0.02 / math.sqrt(2 * L) if name.endswith(("attn.o.w", ".w2")) else 0.02
            out[name] = torch.randn(shape, generator=g) * std
        else:
            out[name] = torch.zeros(shape)
    return out


def forward(p, m, idx, tgt, trace=None):
    """Returns (loss, ce, aux, z, used experts). idx, tgt: [B, T] int64."""
    B, T = idx.shape
    C, H, E, k = m["d_model"], m["n_head"], m["n_expert"], m["top_k"]
    N, hs = B * T, C // H
    x = p["wte"][idx] + p["wpe"][:T]
    aux_sum = torch.zeros(())
    z_sum = torch.zeros(())
    used = set()
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(m["n_layer"]):
        q_ = f"h.{l}."
        h = F.layer_norm(x, (C,), p[q_ + "ln1.w"], p[q_ + "ln1.b"], eps=1e-5)
        qkv = h @ p[q_ + "attn.qkv.w"] + p[q_ + "attn.qkv.b"]
        q, kk, v = qkv.split(C, dim=-1)
        q = q.view(B, T, H, hs).transpose(1, 2)
        kk = kk.view(B, T, H, hs).transpose(1, 2)
        v = v.view(B, T, H, hs).transpose(1, 2)
        att = (q @ kk.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[q_ + "attn.o.w"] + p[q_ + "attn.o.b"]

        h = F.layer_norm(x, (C,), p[q_ + "ln2.w"], p[q_ + "ln2.b"], eps=1e-5).reshape(N, C)
        r = h @ p[q_ + "moe.router.w"]
        prob = r.softmax(dim=-1)
        # Top-k by probability; the stable sort puts the lower id first on ties.
        order = torch.sort(prob.detach(), dim=-1, descending=True, stable=True).indices
        top = order[:, :k]
        gates = prob.gather(1, top)
        if m.get("renormalize_topk", False):
            gates = gates / gates.sum(dim=-1, keepdim=True)
        c = m.get("capacity_factor", 0.0)
        cap = math.ceil(c * k * N / E) if c > 0 else N * k
        keep = torch.zeros(N, k, dtype=torch.bool)
        count = [0] * E
        for s in range(k):  # slot-major priority
            for t in range(N):
                e = int(top[t, s])
                if count[e] < cap:
                    keep[t, s] = True
                    count[e] += 1
        out = torch.zeros(N, C)
        for e in range(E):
            tok, slot = torch.nonzero((top == e) & keep, as_tuple=True)
            if tok.numel() == 0:
                continue
            used.add((l, e))
            w = f"{q_}moe.e{e}."
            xe = h[tok]
            ye = F.gelu(xe @ p[w + "w1"] + p[w + "b1"], approximate="tanh") @ p[w + "w2"] + p[w + "b2"]
            out = out.index_add(0, tok, gates[tok, slot].unsqueeze(1) * ye)
        if trace is not None:
            trace[f"h.{l}.router_probs"] = prob.detach().clone()
        x = x + out.view(B, T, C)
        frac = torch.bincount(top.flatten(), minlength=E).float() / (N * k)
        aux_sum = aux_sum + E * (frac * prob.mean(dim=0)).sum()
        z_sum = z_sum + (torch.logsumexp(r, dim=-1) ** 2).mean()
    x = F.layer_norm(x, (C,), p["ln_f.w"], p["ln_f.b"], eps=1e-5)
    logits = x @ p["wte"].t()
    if trace is not None:
        trace["logits"] = logits.detach().reshape(N, -1).clone()
    ce = F.cross_entropy(logits.reshape(N, -1), tgt.reshape(N))
    loss = ce + m.get("aux_loss_coef", 0.0) * aux_sum + m.get("z_loss_coef", 0.0) * z_sum
    return loss, ce, aux_sum, z_sum, used


def lr_at(t, tr):
    lr, warmup, steps = tr["lr"], tr.get("warmup", 0), tr["steps"]
    if t < warmup:
        return lr * (t + 1) / warmup
    q = (t - warmup) / max(1, steps - warmup)
    lr_min = tr.get("min_lr_ratio", 0.1) * lr
    return lr_min + (lr - lr_min) * (1 + math.cos(math.pi * q)) / 2


def load_tokens(path, vocab):
    with open(path, "rb") as f:
        raw = f.read()
    if vocab == 256:
        return torch.tensor(list(raw), dtype=torch.int64)
    return torch.tensor(struct.unpack(f"<{len(raw) // 2}H", raw), dtype=torch.int64)


def batch_at(tokens, s, B, T):
    n = tokens.numel()
    rows = []
    for i in range(B):
        start = ((s * B + i) * T) % n
        rows.append(torch.stack([tokens[(start + j) % n] for j in range(T + 1)]))
    rows = torch.stack(rows)
    return rows[:, :T], rows[:, 1:]


def train(spec, weights, tokens, steps, on_step):
    m, tr = spec["model"], spec["train"]
    names = tensor_names(m)
    params = {n: weights[n].clone().requires_grad_(True) for n in names}
    decay = [params[n] for n in names if params[n].dim() == 2]
    no_decay = [params[n] for n in names if params[n].dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tr.get("weight_decay", 0.0)},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tr["lr"], betas=(tr.get("beta1", 0.9), tr.get("beta2", 0.95)),
                            eps=tr.get("eps", 1e-8))
    B, T = tr["batch"], m["seq_len"]
    for s in range(steps):
        idx, tgt = batch_at(tokens, s, B, T)
        opt.zero_grad(set_to_none=True)
        loss, ce, aux, z, used = forward(params, m, idx, tgt)
        loss.backward()
        with_grad = [t for t in params.values() if t.grad is not None]
        if tr.get("grad_clip", 0.0) > 0:
            torch.nn.utils.clip_grad_norm_(with_grad, tr["grad_clip"])
        for group in opt.param_groups:
            group["lr"] = lr_at(s, tr)
        opt.step()
        on_step(s, loss.item(), ce.item(), aux.item(), z.item())
    return params


def make_golden(out_dir):
    """The tiny config, its init, data and the reference outputs the C++ tests read."""
    torch.manual_seed(0)
    spec = {
        "name": "golden",
        "model": {"vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4,
                  "n_expert": 4, "top_k": 2, "d_ff": 48, "capacity_factor": 1.25,
                  "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "renormalize_topk": True},
        "train": {"data_path": "golden_tokens.bin", "batch": 4, "steps": 10, "lr": 0.01,
                  "warmup": 3, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0,
                  "seed": 7},
    }
    text = (b"Pith trains mixture-of-experts models on fewer machines than they need: "
            b"stateless workers fetch the experts they compute from expert stores, and a "
            b"coordinator places and replicates the hot ones. ") * 3
    with open(os.path.join(out_dir, "golden_tokens.bin"), "wb") as f:
        f.write(text)
    with open(os.path.join(out_dir, "golden_spec.json"), "w") as f:
        json.dump(spec, f, indent=2)
        f.write("\n")
    m = spec["model"]
    weights = init_weights(m, 7)
    write_safetensors(os.path.join(out_dir, "golden_init.safetensors"), weights)
    tokens = load_tokens(os.path.join(out_dir, "golden_tokens.bin"), 256)

    # Step 0: activations and gradients.
    params = {n: weights[n].clone().requires_grad_(True) for n in tensor_names(m)}
    idx, tgt = batch_at(tokens, 0, spec["train"]["batch"], m["seq_len"])
    trace = {}
    loss, ce, aux, z, used = forward(params, m, idx, tgt, trace)
    loss.backward()
    grads = {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in params.items()}
    trace["losses"] = torch.tensor([loss.item(), ce.item(), aux.item(), z.item()])
    write_safetensors(os.path.join(out_dir, "golden_step0_activations.safetensors"), trace)
    write_safetensors(os.path.join(out_dir, "golden_step0_grads.safetensors"), grads,
                      {"unused_experts": ",".join(f"{l}.{e}" for l in range(m["n_layer"])
                                                  for e in range(m["n_expert"])
                                                  if (l, e) not in used)})

    # Ten training steps.
    lines = []
    final = train(spec, weights, tokens, spec["train"]["steps"],
                  lambda s, lo, c, a, zz: lines.append(f"{s + 1} {lo:.9g} {c:.9g}"))
    with open(os.path.join(out_dir, "golden_losses.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    write_safetensors(os.path.join(out_dir, "golden_final.safetensors"),
                      {n: t.detach() for n, t in final.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", help="write the golden files here")
    ap.add_argument("--spec")
    ap.add_argument("--init")
    ap.add_argument("--tokens")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--loss_log")
    ap.add_argument("--step_times", help="with --loss_log: write '<step> <seconds>' per step here")
    ap.add_argument("--eval", type=int, metavar="BATCHES",
                    help="with --spec/--init/--tokens: print the mean loss of the weights over "
                         "this many global batches instead of training")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.spec:
        with open(args.spec) as f:
            spec = json.load(f)
        steps = args.steps if args.steps is not None else spec["train"]["steps"]
        spec["train"]["steps"] = steps  # as pith-worker --steps: the schedule follows
        tokens = load_tokens(args.tokens or spec["train"]["data_path"], spec["model"]["vocab_size"])
        weights = read_safetensors(args.init)
        if args.eval:
            m, B, T = spec["model"], spec["train"]["batch"], spec["model"]["seq_len"]
            ce_sum = loss_sum = 0.0
            with torch.no_grad():
                for s in range(args.eval):
                    idx, tgt = batch_at(tokens, s, B, T)
                    loss, ce, _, _, _ = forward(weights, m, idx, tgt)
                    ce_sum += float(ce)
                    loss_sum += float(loss)
            print(f"eval rows={args.eval * B} tokens={args.eval * B * T} "
                  f"ce={ce_sum / args.eval:.9g} loss={loss_sum / args.eval:.9g}")
            return
        times = open(args.step_times, "w") if args.step_times else None
        last = [time.perf_counter()]

        def on_step(s, lo, c, a, zz):
            log.write(f"{s + 1} {lo:.9g} {c:.9g}\n")
            if times:
                now = time.perf_counter()
                times.write(f"{s + 1} {now - last[0]:.6f}\n")
                last[0] = now

        with open(args.loss_log, "w") as log:
            train(spec, weights, tokens, steps, on_step)
        if times:
            times.close()
        return
    if not args.out_dir:
        ap.error("give an output folder, or --spec/--init/--loss_log")
    make_golden(args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
