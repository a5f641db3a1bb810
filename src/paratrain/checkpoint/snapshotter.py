"""Training snapshots of one run: when to save, saving (sharded, in the background by default),
committing, finding the one to continue from, and restoring it.

Every rank writes its shard of model + optimizer with torch.distributed.checkpoint; rank 0 commits
once all have written (the layout and the commit rule: store.py). Restoring gives back
everything the next step depends on (weights, optimizer, LR schedule, gradient scaler, every
rank's RNG: snapshot_state.py; the loop's position and loss sums: runtime/loop_state.py's
LoopState), so an interrupted run that resumes is bit-identical to one that never stopped. The
save policy lives here, in `should_save`, as torchtitan's checkpoint manager owns its own.
"""

from __future__ import annotations

import datetime as _dt
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..dist import DistEnv
from ..errors import CheckpointError, TrainingError
from ..formatting import first_line
from ..records.console import log
from ..redact import redact_secrets, redact_url
from ..runplan import RunPlan
from . import integrity, store
from .resume import Resuming
from .snapshot_state import dcp_state, rng_state
from .store import Store

# A one-process run saves with no process group, on purpose; DCP says so once per save, from its
# background thread too, where a `catch_warnings` block in ours cannot reach (and is not
# thread-safe). This one message only, process-wide.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


class Snapshotter(Resuming):
    """Saves and restores one run's training state: model and optimizer (sharded, DCP), LR
    scheduler, gradient scaler, the loop's position, every rank's RNG state, the config.

    Collective: every rank constructs it and calls resume(), save() and wait() at the same
    points. Only global rank 0 commits, prunes and deletes.
    """

    def __init__(self, plan: RunPlan, env: DistEnv, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, *,
                 model_info: dict, tokenizer_path: Optional[Path] = None):
        cfg = plan.cfg
        ck = cfg.checkpoint
        self.plan, self.cfg, self.env = plan, cfg, env
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        # what a marker says about the run that wrote it (inspect shows it; resume checks the batch)
        self.info = {"strategy": plan.strategy, "precision": plan.precision,
                     "model": model_info, "global_batch": plan.global_batch,
                     "steps_per_epoch": plan.steps_per_epoch, "total_steps": plan.total_steps}
        self.tokenizer_path = tokenizer_path
        self.store = Store(store.root_of(cfg))
        self.every, self.keep_last, self.async_save = ck.every_steps, ck.keep_last, ck.async_save
        self.at_epoch_end = ck.at_epoch_end
        self.max_failed_saves = ck.max_failed_saves
        self.failed_in_a_row = 0  # snapshots that could not be written, since the last commit
        # the newest snapshot this run committed or resumed from
        self.committed_url: Optional[str] = None
        self.stalls: list[float] = []  # seconds the loop waited, per snapshot
        self._pending: Optional[tuple[str, Future]] = None
        self._pg = None
        if env.distributed and (self.every or self.at_epoch_end) and self.async_save:
            import torch.distributed as dist
            # A background save runs DCP's collectives while the loop runs its own; on a group of
            # their own the two never interleave on one communicator.
            self._pg = dist.new_group(backend="gloo")

    def should_save(self, step: int) -> bool:
        """After optimizer step `step`: every `checkpoint.every_steps` steps, and at each epoch
        end with `checkpoint.at_epoch_end`; never after the last step (the run then writes
        model/)."""
        plan = self.plan
        return step < plan.total_steps and (
            self.every > 0 and step % self.every == 0
            or self.at_epoch_end and step % plan.steps_per_epoch == 0)

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int, rank: dict, blocking: bool = False) -> Optional[bool]:
        """Snapshot after optimizer step `step`. `rank` is this rank's own (small, JSON) state:
        the loop's (`LoopState.to_snapshot`, runtime/loop_state.py). Returns once the state is
        staged (async: None) or written and committed (sync, or `blocking`: a stop signal's last
        snapshot; True when it was committed, False when it could not be written); the time it
        took is the loop's stall."""
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        self.wait()  # one save at a time: the previous one is committed before the next starts
        ranks = self.env.gather_objects({**rank, **rng_state(self.env.device)})
        url = self.store.url(step)
        marker = None
        if self.env.is_master:
            marker = {"step": step, "epoch": step // self.plan.steps_per_epoch, **self.info,
                      "world_size": self.env.world_size, "nnodes": self.env.nnodes,
                      "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                      "scheduler": self.scheduler.state_dict(),
                      "scaler": self.scaler.state_dict() if self.scaler else None,
                      "ranks": ranks, "config": redact_secrets(self.cfg.to_dict())}
        state = dcp_state(self.model, self.optimizer)
        writer = integrity.writer(url)  # checksums every file as it is written
        kw = dict(checkpoint_id=url, storage_writer=writer, process_group=self._pg,
                  no_dist=not self.env.distributed)
        committed = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming a single process"
            if self.async_save and not blocking:
                self._pending = (url, self._then_commit(dcp.async_save(state, **kw), url, marker,
                                                        writer))
            else:
                from torch.distributed.checkpoint.api import CheckpointException
                error = None
                try:
                    dcp.save(state, **kw)
                    if marker is not None:
                        self._commit(url, marker, writer.files)
                except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
                    error = e
                committed = self._settle(url, error)
        self.stalls.append(time.perf_counter() - t0)
        return committed

    def _then_commit(self, saved: Future, url: str, marker: Optional[dict], writer: Any
                     ) -> Future:
        """A future that completes once the snapshot is committed, not just written: waiting on
        DCP's own future could return before its callbacks (our commit) have run."""
        done: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()
                if marker is not None:
                    self._commit(url, marker, writer.files)
                done.set_result(url)
            except BaseException as e:  # surfaces in wait(), in the training thread
                done.set_exception(e)
        saved.add_done_callback(finish)
        return done

    def _commit(self, url: str, marker: dict, written: dict) -> None:
        """Rank 0, after DCP finished on every rank: every file checked to be there with the
        size its writer wrote, the marker last, then (and only then) prune."""
        self.store.commit(url, marker, written, self.tokenizer_path)
        try:
            gone = self.store.prune(self.keep_last)
        except Exception as e:  # the new snapshot is committed all the same
            gone = []
            log(self.env, f"warning: older snapshots could not be removed: {first_line(e)}")
        log(self.env, f"snapshot {redact_url(url)} committed"
                      + (f"; removed {len(gone)} older" if gone else ""))

    def wait(self) -> Optional[bool]:
        """Block until the snapshot in flight (if any) is committed or has failed (collective,
        like save). True / False: committed or not; None: nothing was in flight."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
        url, future = pending
        error = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            error = e
        return self._settle(url, error)

    def _settle(self, url: str, error: Optional[BaseException]) -> bool:
        """Collective, after every save: did every rank write, and rank 0 commit? A failed
        snapshot loses nothing (no marker; its partial files are removed; the older snapshots
        are untouched, since pruning follows a commit only): one warning line and the run goes
        on, until `checkpoint.max_failed_saves` have failed in a row."""
        why = None if error is None else integrity.cause_line(error)
        why = next((w for w in self.env.gather_objects(why) if w), None)
        if why is None:
            self.failed_in_a_row = 0
            self.committed_url = url
            return True
        self.failed_in_a_row += 1
        if self.env.is_master:
            try:
                self.store.remove(url)  # a partial snapshot: frees its space (disk full)
            except Exception:  # read-only, permissions: it stays, uncommitted (never resumed)
                pass
        newest, listed, older = self._newest_intact()
        n, most = self.failed_in_a_row, self.max_failed_saves
        if n >= most:
            raise CheckpointError(
                f"{n} snapshot(s) in a row could not be written (checkpoint.max_failed_saves="
                f"{most}), the last {redact_url(url)}: {why}; {older}. Fix the storage (space, "
                "permissions, quota) and run the same command to continue"
                + (" from it" if newest else " (from step 0)" if listed else ""))
        log(self.env, f"warning: snapshot {redact_url(url)} could not be written ({why}); it "
                      f"was not committed and {older} ({n} failed in a row; the run stops at "
                      f"checkpoint.max_failed_saves={most})")
        return False

    def outputs_failed(self, step: int, rank: dict, what: str) -> TrainingError:
        """Collective, after rank 0 could not write the run's outputs (`what`: where, and why):
        a snapshot of the last step unless one is committed already, and the error to raise.
        The run dir stays unfinished (no summary.json), so the same command resumes from that
        snapshot, trains nothing, and writes the outputs."""
        url = self.store.url(step)
        saved = url == self.committed_url
        if not saved:
            try:
                saved = bool(self.save(step, rank, blocking=True))
            except CheckpointError:  # the last of checkpoint.max_failed_saves: said already
                saved = False
        if saved:
            then = (f"a snapshot of its last step, {redact_url(url)}, is committed: once that is "
                    "fixed, the same command writes the model without training again")
        else:
            newest, listed, older = self._newest_intact()
            then = ("once that is fixed, the same command " + (
                f"continues from {redact_url(newest)} and trains the steps after it again"
                if newest else "starts over from step 0 (no snapshot was committed)" if listed
                else f"continues from the newest committed snapshot it finds ({older})"))
        return TrainingError(f"the final model could not be written to {what}; the run is not "
                             f"finished; {then}")

    def _newest_intact(self) -> tuple[Optional[str], bool, str]:
        """Collective, after a write failed: (the newest committed snapshot or None, whether the
        store could be listed, the clause that says so). Rank 0 lists the store in a try of its
        own (a failing storage may refuse that too): then the newest one this run committed or
        resumed from is the answer."""
        newest, listed = None, False
        if self.env.is_master:
            try:
                newest = next((s.url for s in reversed(self.store.snapshots()) if s.committed),
                              None)
                listed = True
            except Exception:
                newest = self.committed_url
        newest, listed = self.env.broadcast_object((newest, listed))
        if newest:
            return newest, listed, (f"the newest committed snapshot, {redact_url(newest)}, is "
                                    "intact")
        if listed:
            return None, listed, "no snapshot has been committed yet"
        return None, listed, (f"the snapshots under {redact_url(self.store.root)} could not be "
                              "listed to say which is the newest intact one")

    def report(self) -> dict:
        n = len(self.stalls)
        return {"count": n, "async": self.async_save, "stall_s": sum(self.stalls),
                "mean_stall_s": sum(self.stalls) / n if n else None}

    # ---- resume --------------------------------------------------------------------------
