"""Before/after timings of the fast paths paratrain takes, one at a time, on the bench model.

    python benchmarks/fast_paths.py                       # medium Llama, vocab 4096, seq 256
    python benchmarks/fast_paths.py --preset tiny --rounds 3   # a quick look

Each comparison alternates its variants round by round (A B A B ...) and reports the median
time per step of each, so that a shared machine's drift hits every variant alike:
- adamw: optimizer.step() with a per-tensor for-loop, foreach (multi-tensor) and fused kernels;
- sdpa: forward + backward with `is_causal=True` (packed data: no mask tensor) and with the
  explicit (B, 1, T, T) boolean mask a padded batch needs;
- ddp: a whole DDP step on 2 gloo ranks with the defaults, with gradient_as_bucket_view, and
  with gradient_as_bucket_view + static_graph;
- h2d: host-to-device copy of a batch, pageable vs pinned + non_blocking (GPU only).
The end-to-end ones (data wait, torch.compile, DDP vs the plain loop) come from `paratrain
bench` and `paratrain train`; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from paratrain.config import ModelConfig
from paratrain.models import build_model, resolve_model_config


def make_model(preset: str, seq: int):
    args = resolve_model_config(ModelConfig(preset=preset), vocab_size=4096, seq_length=seq)
    torch.manual_seed(0)
    return build_model(args), args


def batch(args, b: int, seq: int):
    x = torch.randint(0, args.vocab_size, (b, seq + 1))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def fwd_bwd(model, x, y, mask=None):
    logits = model(x, attention_mask=mask)  # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()


def interleave(variants: dict, rounds: int, reps: int = 1) -> dict:
    """{name: fn} -> {name: median seconds per call}; one warm-up call each, then rounds of
    A B C ..., `reps` calls per turn."""
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times[k].append((time.perf_counter() - t) / reps)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_adamw(ns) -> dict:
    model, args = make_model(ns.preset, ns.seq)
    x, y = batch(args, ns.batch, ns.seq)
    fwd_bwd(model, x, y)  # real gradients
    out = {}

    def opt(**kw):
        m = copy.deepcopy(model)  # deepcopy leaves .grad behind: give each copy the gradients
        for p, q in zip(m.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        decay = [p for p in m.parameters() if p.dim() >= 2]
        rest = [p for p in m.parameters() if p.dim() < 2]
        o = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": rest, "weight_decay": 0.0}], lr=1e-4, **kw)
        return o.step
    out = interleave({"for-loop": opt(foreach=False), "foreach": opt(foreach=True),
                      "fused": opt(fused=True)}, ns.rounds, reps=3)
    out["fwd+bwd (for scale)"] = interleave({"x": lambda: fwd_bwd(model, x, y)}, 1)["x"]
    return out


def bench_sdpa(ns) -> dict:
    model, args = make_model(ns.preset, ns.seq)
    x, y = batch(args, ns.batch, ns.seq)
    ones = torch.ones_like(x)  # a padded batch without padding: same maths, explicit mask
    return interleave({"is_causal (no mask)": lambda: fwd_bwd(model, x, y),
                       "explicit bool mask": lambda: fwd_bwd(model, x, y, ones)}, ns.rounds)


def _ddp_worker(rank: int, ns, port: int, q) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, args = make_model(ns.preset, ns.seq)
    torch.manual_seed(rank)
    x, y = batch(args, ns.batch, ns.seq)

    def step_fn(**kw):
        with warnings.catch_warnings():  # broadcast_buffers: deprecated name, same meaning
            warnings.simplefilter("ignore", FutureWarning)
            m = DDP(copy.deepcopy(model), broadcast_buffers=False, **kw)
        o = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step():
            fwd_bwd(m, x, y)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad(set_to_none=True)
        return step
    variants = {"default": step_fn(),
                "gradient_as_bucket_view": step_fn(gradient_as_bucket_view=True),
                "bucket_view + static_graph": step_fn(gradient_as_bucket_view=True,
                                                      static_graph=True)}
    res = interleave(variants, ns.rounds)
    if rank == 0:
        q.put(res)
    del variants
    dist.barrier()
    dist.destroy_process_group()


def bench_ddp(ns) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_ddp_worker, args=(ns, port, q), nprocs=2, start_method="spawn")
    return q.get()


def bench_h2d(ns) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU here: pinned memory and non_blocking copies only "
                           "matter for host-to-GPU transfers"}
    x = torch.randint(0, 4096, (ns.batch, ns.seq + 1))
    px = x.pin_memory()

    def copy_(src, nb):
        def f():
            src.to("cuda", non_blocking=nb)
            torch.cuda.synchronize()
        return f
    return interleave({"pageable": copy_(x, False), "pinned + non_blocking": copy_(px, True)},
                      ns.rounds, reps=20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="per device (paratrain's default)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", default="adamw,sdpa,ddp,h2d")
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    ns = ap.parse_args()
    # one worker's share of the cores, as each of paratrain's 2 CPU workers gets
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    results = {"preset": ns.preset, "seq": ns.seq, "batch": ns.batch, "rounds": ns.rounds,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "load_avg_start": list(os.getloadavg())}
    for name in ns.only.split(","):
        r = globals()[f"bench_{name}"](ns)
        results[name] = r
        print(f"{name}:")
        for k, v in r.items():
            print(f"  {k:<28} {v * 1e3:10.2f} ms" if isinstance(v, float) else f"  {k}: {v}")
    results["load_avg_end"] = list(os.getloadavg())
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
