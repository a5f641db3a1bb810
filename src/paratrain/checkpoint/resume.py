"""Resuming a run (the Snapshotter's other half): which snapshot to continue from, each rank
verifying its share of the shards before anything is loaded, the load itself, and what becomes of
the snapshots beyond the resume point (removed, or moved aside when damaged).

`Resuming` reads the fields `Snapshotter.__init__` sets (cfg, env, info, store, model, optimizer,
scheduler, scaler, _pg) and is mixed into it, so a run holds one object for saving and resuming.
"""

from __future__ import annotations

import warnings
from typing import Optional

from ..errors import CheckpointError, ConfigError, ParatrainError
from ..formatting import first_line
from ..records.console import log
from ..redact import redact_url
from . import integrity, store
from .rundir import unloadable_message
from .snapshot_state import Resumed, dcp_state, set_rng_state, state_options


class Resuming:
    """Snapshotter's resume side (see the module's docstring)."""

    def resume(self) -> Optional[Resumed]:
        """Per `checkpoint.resume`: load the newest usable snapshot (auto), a named one (PATH),
        or none (never). A restarted worker group (env.attempt > 0) always continues from this
        run's newest snapshot. Snapshot folders beyond the resume point belong to the future
        that was lost: rank 0 deletes them, so the steps they named can be saved again."""
        env = self.env
        candidates = self._candidates_of_rank0()
        from torch.distributed.checkpoint.api import CheckpointException
        resumed = None
        failures, damaged = [], []
        for i, (url, marker) in enumerate(candidates):
            if marker.get("global_batch") != self.info["global_batch"]:
                raise ConfigError(
                    f"snapshot {redact_url(url)} was trained with a global batch of "
                    f"{marker.get('global_batch')} sequences, this run has "
                    f"{self.info['global_batch']}; set trainer.global_batch_size="
                    f"{marker.get('global_batch')} to continue it exactly")
            then = (f"falling back to {redact_url(candidates[i + 1][0])}"
                    if i + 1 < len(candidates) else "no older snapshot to fall back to")
            bad = self._verify_shares(url, marker)  # before anything of it is loaded
            if bad:
                damaged.append((url, marker))
                log(env, f"warning: skipping snapshot {redact_url(url)}: {bad}; {then}")
                continue
            try:
                self._load(url, marker)
            # raised on every rank alike: DCP gathers the errors of all ranks (CheckpointException
            # is a BaseException)
            except (Exception, CheckpointException) as e:
                failures.append((url, marker))
                log(env, f"warning: skipping snapshot {redact_url(url)}: it cannot be loaded "
                         f"({integrity.cause_line(e)[:300]}); {then}")
                continue
            if integrity.recorded(marker) is None:
                log(env, f"warning: snapshot {redact_url(url)} has no checksums (written before "
                         "paratrain recorded them): its sizes were checked, its contents cannot "
                         "be verified")
            same_world = marker["world_size"] == env.world_size
            self.committed_url = url
            resumed = Resumed(url, int(marker["step"]), marker,
                              marker["ranks"][env.rank] if same_world else None,
                              int(marker["world_size"]))
            break
        named = self.cfg.checkpoint.resume not in ("auto", "never")
        if resumed is None and (failures or damaged and named):  # a setting changed, or damage
            tried = [c for c in candidates if c in failures + damaged]  # newest first
            raise CheckpointError(unloadable_message(tried, self.cfg))
        if env.is_master:
            self._clear_beyond(resumed.step if resumed else -1, failures + damaged)
        env.barrier()
        return resumed

    def _clear_beyond(self, after: int, bad: list) -> None:
        """Rank 0: the snapshot folders beyond the resume point go: a partial or deliberately
        passed-over one is removed, a damaged one (it failed its checks or to load; with
        resume=auto, every committed one not resumed) is moved aside to step-N.corrupt."""
        suspect = {u for u, _ in bad}
        if self.cfg.checkpoint.resume == "auto" or self.env.attempt > 0:
            suspect |= {s.url for s in self.store.snapshots() if s.committed}
        for s in self.store.snapshots():
            if s.step <= after:
                continue
            if s.url in suspect and self._set_aside(s.url):
                continue
            log(self.env, f"removing snapshot folder {redact_url(s.url)} (beyond the resume "
                          "point)")
            self.store.remove(s.url)

    def _set_aside(self, url: str) -> bool:
        """Rank 0: a damaged snapshot moved aside (said so); False when the storage would not
        (it is then removed, as the steps it named are saved again)."""
        try:
            dest = self.store.set_aside(url)
        except Exception as e:
            log(self.env, f"warning: damaged snapshot {redact_url(url)} could not be moved aside "
                          f"({first_line(e)}); it is removed")
            return False
        log(self.env, f"snapshot {redact_url(url)} is damaged and beyond the resume point: moved "
                      f"aside to {redact_url(dest)}, not deleted (`paratrain checkpoint verify` "
                      "lists such folders and how to clear them)")
        return True

    def _candidates_of_rank0(self) -> list[tuple[str, dict]]:
        """Collective: rank 0's list of snapshots to try, or its error, raised on every rank
        (else the others would wait for rank 0 in vain)."""
        found: dict = {}
        if self.env.is_master:
            try:
                found = {"candidates": self._candidates()}
            except Exception as e:
                kind = type(e).__name__ if isinstance(e, ParatrainError) else "CheckpointError"
                found = {"error": (kind, str(e) if isinstance(e, ParatrainError) else
                                   f"cannot read snapshots under {redact_url(self.store.root)!r}: "
                                   f"{type(e).__name__}: {e}")}
        found = self.env.broadcast_object(found)
        if "error" in found:
            kind, msg = found["error"]
            raise {"ConfigError": ConfigError}.get(kind, CheckpointError)(msg)
        return found["candidates"]

    def _candidates(self) -> list[tuple[str, dict]]:
        """Rank 0: the snapshots to try, newest first."""
        mode, attempt = self.cfg.checkpoint.resume, self.env.attempt
        warn = lambda m: log(self.env, f"warning: {m}")  # noqa: E731
        if attempt == 0 and mode in ("auto", "never"):
            snaps = self.store.snapshots()
            if snaps and self.cfg.run.overwrite:  # replacing a run replaces its snapshots
                log(self.env, f"run.overwrite: removing {len(snaps)} snapshot folder(s) under "
                              f"{redact_url(self.store.root)}")
                for s in snaps:
                    self.store.remove(s.url)
                return []
            if mode == "never":
                if snaps:
                    raise CheckpointError(
                        f"checkpoint.dir {redact_url(self.store.root)!r} already holds snapshots (up "
                        f"to step {snaps[-1].step}); pass checkpoint.resume=auto to continue "
                        "from them, or run.overwrite=true to replace them")
                return []
        found = [(s.url, m) for s, m in self.store.usable(warn)]
        if mode in ("auto", "never"):
            return found
        named_store, step = store.split(mode)
        why = named_store.problem(named_store.url(step)) if step is not None else \
            "it is not a snapshot folder (step-NNNNNNN)"
        if why:
            raise CheckpointError(f"checkpoint.resume={redact_url(mode)!r} cannot be used: {why}")
        named = (named_store.url(step), named_store.marker(named_store.url(step)))
        return (found if attempt > 0 else []) + [named]  # type: ignore[list-item]

    def _verify_shares(self, url: str, marker: dict) -> Optional[str]:
        """Collective: each rank reads its share of the snapshot's shard files (file i by rank
        i mod world size) against the checksums recorded when they were written; the first
        mismatch any rank found (None: all match, or none were recorded)."""
        sums = integrity.recorded(marker) or {}
        names = sorted(n for n in sums if n.endswith(".distcp"))
        mine = {n: sums[n] for n in names[self.env.rank::self.env.world_size]}
        try:
            found = self.store.mismatch(url, mine)
        except Exception as e:  # unreadable: told to every rank, or they would wait in vain
            found = f"it cannot be read ({integrity.cause_line(e)})"
        return next((f for f in self.env.gather_objects(found) if f), None)

    def _load(self, url: str, marker: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        state = dcp_state(self.model, self.optimizer)
        # The parameter names of each optimizer group as this rank holds them. A snapshot keeps
        # one rank's lists, and a pipeline's ranks hold different parts of the model: the
        # groups' hyper-parameters are what is loaded (groups are built in the same order on
        # every layout, runtime/optim.py), the names stay this rank's own.
        own_names = [group["params"] for group in state["optim"].get("param_groups", [])]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=url, planner=store.SafeLoadPlanner(),
                     process_group=self._pg, no_dist=not self.env.distributed)
        for group, names in zip(state["optim"].get("param_groups", []), own_names):
            group["params"] = names
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=state_options(self.model))
        self.scheduler.load_state_dict(marker["scheduler"])
        if self.scaler is not None and marker.get("scaler"):
            self.scaler.load_state_dict(marker["scaler"])
        if marker["world_size"] == self.env.world_size:  # dropout continues where it was
            set_rng_state(marker["ranks"][self.env.rank], self.env.device)
