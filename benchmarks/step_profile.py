"""`python benchmarks/step_profile.py steps.txt`: py-spy raw (collapsed) stacks of a whole job -> where each worker's training thread spent its
samples, by what the loop was doing, and the other threads' busy samples."""
import re, sys
from collections import Counter, defaultdict

# (category, regex on the frame string), first match from the innermost frame outward wins
INNER = [
    ("stop check (all-reduce MAX)", r"(_stop_agreed|stop_agreed|max_over_ranks)"),
    ("host group (padded units)", r"host_group.py.*\bsum\b"),
    ("log line (_log: reductions, metrics.jsonl)", r"\b_log \("),
    ("progress bar (tqdm)", r"(tqdm|console.py)"),
    ("step clock", r"\btick \("),
    ("clip_grad_norm_", r"clip_grad_norm_"),
    ("optimizer.step", r"(adamw.py|optimizer.py.*wrapper|_multi_tensor_adamw|\bstep \(torch/optim)"),
    ("zero_grad", r"zero_grad"),
    ("scheduler", r"lr_scheduler"),
    ("backward", r"(backward \(|_engine_run_backward|run_backward)"),
    ("forward+loss", r"(_loss \(|token_loss|cross_entropy|forward \()"),
    ("data (next batch)", r"(_micro_batches|dataloader.py|__next__|collate|sampler.py)"),
    ("snapshot", r"snapshot"),
]

PLAIN_LINES = {}

def category(frames):
    for f in reversed(frames):
        m = re.match(r"main \(paratrain/tools/plain_ddp.py:(\d+)\)", f)
        if m and f is frames[-1] or (m and not any(re.search(rx, g) for g in frames[frames.index(f)+1:] for _, rx in INNER)):
            return "plain_ddp.py:" + m.group(1)
        for name, rx in INNER:
            if re.search(rx, f):
                return name
    return None

def main(path):
    per = defaultdict(Counter)  # (process, thread kind) -> category -> samples
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n)
        frames = stack.split(";")
        i = max(j for j, f in enumerate(frames) if f.startswith("process "))
        pid = frames[i].split(":")[0]
        proc = pid + (" worker" if i >= 2 else " launcher" if i == 0 else " forkserver")
        thread = frames[i + 1] if len(frames) > i + 1 else ""
        rest = frames[i + 2:]
        text = ";".join(rest)
        if "paratrain train" in proc or "plain_ddp" in proc:
            pass
        if "_run (paratrain/launch/watchdog.py" in text:
            kind = "watchdog thread"
        elif re.search(r"(\brun \(paratrain/runtime/loop.py|\bmain \(paratrain/tools/plain_ddp.py)", text):
            kind = "training thread"
        else:
            kind = "other"
        idle = False
        if kind == "watchdog thread":
            cat = "idle (waiting for the next beat)" if rest and re.search(
                r"(wait \(threading.py|Event.wait)", rest[-1]) else "busy: " + rest[-1][:70]
        else:
            cat = category(rest) if kind == "training thread" else (rest[-1][:80] if rest else "?")
        per[(proc, kind)][cat or "loop/other: " + (rest[-1][:70] if rest else "?")] += n
    for (proc, kind), c in sorted(per.items()):
        tot = sum(c.values())
        if kind == "other" and tot < 20:
            continue
        print(f"\n== {proc} | {kind}: {tot} samples")
        for cat, k in c.most_common(14 if kind != "other" else 5):
            print(f"  {100 * k / tot:6.2f}%  {k:6d}  {cat}")

if __name__ == "__main__":
    main(sys.argv[1])
