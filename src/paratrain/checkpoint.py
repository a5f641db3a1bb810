"""What a run keeps on disk: the trained model, and the snapshots that let it continue.

The model: `model/` = model.safetensors + config.json + tokenizer.json. Whatever the strategy,
the weights are gathered into one full state dict (the torch.distributed `get_model_state_dict`
API knows DDP and FSDP alike), written by global rank 0 into a temporary folder and renamed into
place, so a crash never leaves half a model. Loading uses safetensors, which holds tensors only:
nothing is unpickled from the run dir.

Snapshots (`Snapshotter`, below): every rank writes its shard of model + optimizer with
torch.distributed.checkpoint, in the background by default; the layout and the commit rule live
in snapshot.py. Restoring one gives back everything the next step depends on, so an interrupted
run that resumes is bit-identical to one that never stopped.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import json
import shutil
import tempfile
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Tuple

import torch
from torch import nn

from . import snapshot
from .config import TrainConfig
from .dist import DistEnv
from .errors import CheckpointError, ConfigError, ParatrainError
from .metrics import _umask, log
from .snapshot import Store, shown
from .strategies import unwrap

MODEL_DIR = "model"
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "config.json"
TOKENIZER = "tokenizer.json"


def full_state_dict(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Full, unsharded CPU tensors on global rank 0 (an empty dict on the other ranks).
    Collective: every rank must call it."""
    if not env.distributed:
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    return sd if env.is_master else {}


@contextlib.contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Fill a temporary folder next to `out_dir`; on success it replaces `out_dir` by renames,
    on failure it vanishes. A reader sees the old folder or the new one, never half of one."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; a model is for sharing
        yield tmp
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_model(out_dir: Path, state_dict: dict[str, torch.Tensor], model_args: dict,
               tokenizer_path: Optional[Path]) -> Path:
    """Write `out_dir` atomically. Tied weights are stored once."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if model_args.get("tie_embeddings"):
        tensors = _drop_tied(tensors)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "paratrain"})
        (tmp / MODEL_CONFIG).write_text(json.dumps(model_args, indent=2) + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
    return out_dir


def _drop_tied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses two names for one storage: keep the first name of each storage."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.numel() > 0:
            continue
        seen[ptr] = k
        out[k] = v
    return out


def model_dir_of(path: str | Path) -> Path:
    """A run dir or its model/ folder -> the model/ folder."""
    p = Path(path)
    if (p / WEIGHTS).is_file():
        return p
    if (p / MODEL_DIR / WEIGHTS).is_file():
        return p / MODEL_DIR
    raise ParatrainError(f"{str(path)!r} holds no trained model ({MODEL_DIR}/{WEIGHTS}); pass a "
                         "run dir of a finished `paratrain train`")


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Tuple[nn.Module, object]:
    """(model, tokenizer) from a run dir or its model/ folder, ready for generation or for
    further training."""
    from safetensors.torch import load_file

    from .data import Tokenizer
    from .models import ModelArgs, build_model
    mdir = model_dir_of(path)
    args = ModelArgs.from_dict(json.loads((mdir / MODEL_CONFIG).read_text()))
    model = build_model(args)
    state = load_file(str(mdir / WEIGHTS), device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_ok = args.tie_embeddings and all("head" in k for k in missing)
    if unexpected or (missing and not tied_ok):
        raise ParatrainError(f"{mdir / WEIGHTS} does not match {mdir / MODEL_CONFIG}: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.to(device).eval()
    tok_path = mdir / TOKENIZER
    tokenizer = Tokenizer.load(tok_path) if tok_path.is_file() else None
    return model, tokenizer


# ---- training snapshots ------------------------------------------------------------------------
def continues(cfg: TrainConfig, held: list[str]) -> bool:
    """Whether a run dir that holds `held` (run files) is a run this config continues: it is
    unfinished (no summary.json) and checkpoint.resume names a snapshot, or is `auto` and a
    committed one exists."""
    if "summary.json" in held or cfg.checkpoint.resume == "never":
        return False
    if cfg.checkpoint.resume != "auto":
        return True
    return any(s.committed for s in Store(snapshot.root_of(cfg)).snapshots())


@dataclass(frozen=True)
class Resumed:
    """Where a run continues from. `rank` is this rank's own state (loss sums since the last log
    line); None when the snapshot was written by another world size."""
    url: str
    step: int
    loop: dict
    rank: Optional[dict]
    world_size: int


class Snapshotter:
    """Saves and restores one run's training state: model and optimizer (sharded, DCP), LR
    scheduler, gradient scaler, the loop's position, every rank's RNG state, the config.

    Collective: every rank constructs it and calls resume(), save() and close() at the same
    points. Only global rank 0 commits, prunes and deletes.
    """

    def __init__(self, cfg: TrainConfig, env: DistEnv, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, *,
                 info: dict, tokenizer_path: Optional[Path] = None):
        ck = cfg.checkpoint
        self.cfg, self.env = cfg, env
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.info = info  # strategy, precision, model args, global_batch, steps_per_epoch, ...
        self.tokenizer_path = tokenizer_path
        self.store = Store(snapshot.root_of(cfg))
        self.every, self.keep_last, self.async_save = ck.every_steps, ck.keep_last, ck.async_save
        self.stalls: list[float] = []  # seconds the loop waited, per snapshot
        self._pending: Optional[Future] = None
        self._pg = None
        if env.distributed and self.every and self.async_save:
            import torch.distributed as dist
            # A background save runs DCP's collectives while the loop runs its own; on a group of
            # their own the two never interleave on one communicator.
            self._pg = dist.new_group(backend="gloo")

    def due(self, step: int, steps_per_epoch: int, total_steps: int) -> bool:
        """Every `checkpoint.every_steps` steps and at each epoch end; never after the last step
        (the run then writes model/)."""
        return self.every > 0 and step < total_steps and \
            (step % self.every == 0 or step % steps_per_epoch == 0)

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int, loop: dict, rank: dict) -> None:
        """Snapshot after optimizer step `step`. `loop` is the same on every rank; `rank` is
        this rank's own (small, JSON) state. Returns once the state is staged (async) or
        written (sync); the time it took is the loop's stall."""
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        self.wait()  # one save at a time: the previous one is committed before the next starts
        ranks = self.env.gather_objects({**rank, **_rng_state(self.env.device)})
        url = self.store.url(step)
        marker = None
        if self.env.is_master:
            marker = {"step": step, **loop, **self.info, "world_size": self.env.world_size,
                      "nnodes": self.env.nnodes,
                      "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                      "scheduler": self.scheduler.state_dict(),
                      "scaler": self.scaler.state_dict() if self.scaler else None,
                      "ranks": ranks, "config": _redacted_config(self.cfg)}
        state = self._state_dicts()
        kw = dict(checkpoint_id=url, process_group=self._pg, no_dist=not self.env.distributed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming a single process"
            if self.async_save:
                self._pending = self._then_commit(dcp.async_save(state, **kw), url, marker)
            else:
                dcp.save(state, **kw)
                if marker is not None:
                    self._commit(url, marker)
        self.stalls.append(time.perf_counter() - t0)

    def _then_commit(self, saved: Future, url: str, marker: Optional[dict]) -> Future:
        """A future that completes once the snapshot is committed, not just written: waiting on
        DCP's own future could return before its callbacks (our commit) have run."""
        done: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()
                if marker is not None:
                    self._commit(url, marker)
                done.set_result(url)
            except BaseException as e:  # surfaces in wait(), in the training thread
                done.set_exception(e)
        saved.add_done_callback(finish)
        return done

    def _commit(self, url: str, marker: dict) -> None:
        """Rank 0, after DCP finished on every rank: marker last, then (and only then) prune."""
        self.store.commit(url, marker, self.tokenizer_path)
        gone = self.store.prune(self.keep_last)
        log(self.env, f"snapshot {shown(url)} committed"
                      + (f"; removed {len(gone)} older" if gone else ""))

    def wait(self) -> None:
        """Block until the snapshot in flight (if any) is committed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
        try:
            pending.result()
        except (Exception, CheckpointException) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"writing a snapshot under {shown(self.store.root)!r} failed: "
                                  f"{first}") from e

    def close(self) -> None:
        self.wait()

    def report(self) -> dict:
        n = len(self.stalls)
        return {"count": n, "async": self.async_save, "stall_s": sum(self.stalls),
                "mean_stall_s": sum(self.stalls) / n if n else None}

    def _state_dicts(self) -> dict:
        """Model and optimizer as DCP sees them: FQNs without wrapper prefixes, shards as
        DTensors under FSDP, so any strategy and world size can load them."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    # ---- resume --------------------------------------------------------------------------
    def resume(self) -> Optional[Resumed]:
        """Per `checkpoint.resume`: load the newest usable snapshot (auto), a named one (PATH),
        or none (never). A restarted worker group (env.attempt > 0) always continues from this
        run's newest snapshot. Snapshot folders beyond the resume point belong to the future
        that was lost: rank 0 deletes them, so the steps they named can be saved again."""
        env = self.env
        plan: dict = {}
        if env.is_master:
            try:
                plan = {"candidates": self._candidates()}
            except Exception as e:  # told to every rank, or they would wait for rank 0 in vain
                kind = type(e).__name__ if isinstance(e, ParatrainError) else "CheckpointError"
                plan = {"error": (kind, str(e) if isinstance(e, ParatrainError) else
                                  f"cannot read snapshots under {shown(self.store.root)!r}: "
                                  f"{type(e).__name__}: {e}")}
        plan = env.broadcast_object(plan)
        if "error" in plan:
            kind, msg = plan["error"]
            raise {"ConfigError": ConfigError}.get(kind, CheckpointError)(msg)
        from torch.distributed.checkpoint.api import CheckpointException
        resumed = None
        failures = []
        for url, marker in plan["candidates"]:
            if marker.get("global_batch") != self.info["global_batch"]:
                raise ConfigError(
                    f"snapshot {shown(url)} was trained with a global batch of "
                    f"{marker.get('global_batch')} sequences, this run has "
                    f"{self.info['global_batch']}; set trainer.global_batch_size="
                    f"{marker.get('global_batch')} to continue it exactly")
            try:
                self._load(url, marker)
            except (Exception, CheckpointException) as e:  # raised on every rank alike: DCP
                # gathers the errors of all ranks (CheckpointException is a BaseException)
                failures.append(url)
                log(env, f"warning: skipping snapshot {shown(url)}: it cannot be loaded "
                         f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:300]})")
                continue
            same_world = marker["world_size"] == env.world_size
            resumed = Resumed(url, int(marker["step"]), marker,
                              marker["ranks"][env.rank] if same_world else None,
                              int(marker["world_size"]))
            break
        if failures and resumed is None:
            raise CheckpointError(f"no snapshot could be loaded (tried {len(failures)}, newest "
                                  f"{shown(failures[0])}); remove the damaged ones or pass "
                                  "checkpoint.resume=never with another run.dir")
        if env.is_master:
            after = resumed.step if resumed else -1
            for s in self.store.snapshots():
                if s.step > after:
                    log(env, f"removing snapshot folder {shown(s.url)} (beyond the resume point)")
                    self.store.remove(s.url)
        env.barrier()
        return resumed

    def _candidates(self) -> list[tuple[str, dict]]:
        """Rank 0: the snapshots to try, newest first."""
        mode, attempt = self.cfg.checkpoint.resume, self.env.attempt
        warn = lambda m: log(self.env, f"warning: {m}")  # noqa: E731
        if attempt == 0 and mode in ("auto", "never"):
            snaps = self.store.snapshots()
            if snaps and self.cfg.run.overwrite:  # replacing a run replaces its snapshots
                log(self.env, f"run.overwrite: removing {len(snaps)} snapshot folder(s) under "
                              f"{shown(self.store.root)}")
                for s in snaps:
                    self.store.remove(s.url)
                return []
            if mode == "never":
                if snaps:
                    raise CheckpointError(
                        f"checkpoint.dir {shown(self.store.root)!r} already holds snapshots (up "
                        f"to step {snaps[-1].step}); pass checkpoint.resume=auto to continue "
                        "from them, or run.overwrite=true to replace them")
                return []
        found = [(s.url, m) for s, m in self.store.usable(warn)]
        if mode in ("auto", "never"):
            return found
        store, step = snapshot.split(mode)
        why = store.problem(store.url(step)) if step is not None else \
            "it is not a snapshot folder (step-NNNNNNN)"
        if why:
            raise CheckpointError(f"checkpoint.resume={shown(mode)!r} cannot be used: {why}")
        named = (store.url(step), store.marker(store.url(step)))
        return (found if attempt > 0 else []) + [named]  # type: ignore[list-item]

    def _load(self, url: str, marker: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        state = self._state_dicts()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=url, planner=snapshot.SafeLoadPlanner(),
                     process_group=self._pg, no_dist=not self.env.distributed)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(marker["scheduler"])
        if self.scaler is not None and marker.get("scaler"):
            self.scaler.load_state_dict(marker["scaler"])
        if marker["world_size"] == self.env.world_size:  # dropout continues where it was
            _set_rng_state(marker["ranks"][self.env.rank], self.env.device)


def _rng_state(device: torch.device) -> dict:
    out = {"rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        out["cuda_rng"] = base64.b64encode(
            torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return out


def _set_rng_state(state: dict, device: torch.device) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)
    torch.set_rng_state(tensor(state["rng"]))
    if device.type == "cuda" and state.get("cuda_rng"):
        torch.cuda.set_rng_state(tensor(state["cuda_rng"]), device)


def _redacted_config(cfg: TrainConfig) -> dict:
    from .config import redact_secrets
    return redact_secrets(cfg.to_dict())


def trim_jsonl(path: Path, last_step: int) -> None:
    """Drop the lines of a per-step log beyond `last_step`: after a resume those steps are run
    again and logged again, once."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    from .metrics import write_text_atomic
    write_text_atomic(path, "".join(line + "\n" for line in keep))


class SampleRecorder(torch.utils.data.Sampler):
    """A test aid (`checkpoint.record_samples=true`): passes a sampler's indices through and
    remembers them, so the loop can write which samples every step trained on."""

    def __init__(self, inner: torch.utils.data.Sampler):
        self.inner = inner
        self.taken: list[int] = []

    def __iter__(self):
        for i in self.inner:
            self.taken.append(int(i))
            yield i

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def pop(self) -> list[int]:
        out, self.taken = self.taken, []
        return out


def export_snapshot(path: str, out: str | Path) -> Path:
    """The model weights of a sharded snapshot as one file. OUT ending in .safetensors: that file
    alone; otherwise a model folder (weights, config.json, tokenizer.json) that `paratrain
    generate` and `load_model` read."""
    from safetensors.torch import save_file

    from . import precision
    from .models import ModelArgs, build_model
    url = snapshot.resolve(path)
    store, _ = snapshot.split(url)
    marker = store.marker(url)
    if marker is None:
        raise CheckpointError(f"snapshot {shown(url)!r} is not committed; nothing to export")
    args = ModelArgs.from_dict(marker["model"])
    model = precision.prepare_model(build_model(args), marker.get("precision") or "fp32")
    weights = snapshot.load_model_weights(url, model.state_dict())
    out = Path(out)
    if out.suffix == ".safetensors":
        tensors = {k: v.contiguous() for k, v in weights.items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(_drop_tied(tensors) if args.tie_embeddings else tensors, str(out),
                  metadata={"format": "pt", "producer": "paratrain", "step": str(marker["step"])})
        return out
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / TOKENIZER
        try:
            store.fs.get_file(f"{store._path(url)}/{snapshot.TOKENIZER}", str(tok))
        except FileNotFoundError:
            tok = None  # type: ignore[assignment]
        return save_model(out, weights, args.to_dict(), tok)
