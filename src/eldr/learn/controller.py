"""The learner: collect completed requests, decide when to fit, validate, hand over.

:class:`Learner` runs on the router's event loop and does nothing heavy there: appending a
record and pushing a signature into the drift window are O(1); a fit (and the drift
calibration that comes with it) runs in a worker process of a ``ProcessPoolExecutor``
started with ``spawn`` (:func:`eldr.learn.refit.run_fit_job`); a drift window's test and
the buffer's writes run in a thread. When to fit:

- **first fit**: no artifact is running and ``min_requests`` requests are buffered (after
  a refused first candidate: again once ``min_requests / 2`` more have come);
- **refit on drift**: an artifact runs, its drift detector declared drift, and
  ``min_requests`` requests have completed since the drift began: the fit then uses those
  newest requests (the new traffic), not the whole buffer. A refused candidate means the
  running artifact is at least as good on the new traffic ("worse" is decided by a paired
  interval over held-out folds, :func:`eldr.learn.refit.judge`, so a difference within
  the folds' noise never refuses): the drift reference moves to that traffic (the next
  shift is measured from there);
- **drift calibration only**: an artifact runs (given with ``--artifact``, or learned
  before a restart) without a drift reference: one is calibrated on the buffered traffic
  once ``min_requests`` requests are in.

An accepted candidate is written to ``DIR/artifacts/NNNN`` and handed to ``swap`` (the
router's own reload, which may still refuse it: counted as a refusal); a refused one is
deleted and the running artifact stays. Every stage is reported through ``on_event(name,
info)`` (the router turns events into metrics and log lines): ``collected`` (each
``min_requests``-th), ``fit_started``, ``fit_accepted``, ``fit_refused``, ``fit_failed``,
``swapped``, ``drift_checked``, ``drift``, ``persisted``, ``pool_refit`` (the decoders
changed while a fit ran: a refit for the new set follows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from eldr.learn import buffer as buffer_io
from eldr.learn.buffer import LearnBuffer, Record
from eldr.learn.config import LearnConfig
from eldr.learn.drift import DriftDetector
from eldr.learn.refit import FitJob, FitOutcome, run_fit_job

__all__ = ["Learner", "learned_artifact"]

log = logging.getLogger("eldr.learn")

_BUFFER = "buffer"
_ARTIFACTS = "artifacts"


def learned_artifact(directory: str) -> str | None:
    """The learned artifact that ran last in ``directory`` (from its saved state), if it is
    still there; None otherwise."""
    try:
        _, doc = buffer_io.load(Path(directory) / _BUFFER)
    except ValueError:
        return None
    path = (doc.get("state") or {}).get("artifact") if doc else None
    return path if isinstance(path, str) and (Path(path) / "artifact.json").is_file() else None


class Learner:
    """Learning from live traffic for one router (module docstring).

    ``worker_ids()`` gives the router's decoder names, ``current_artifact()`` the directory
    of the artifact it runs (or None), ``swap(path)`` makes it run ``path`` (raising to
    refuse). ``executor``: a ``concurrent.futures`` executor for fits (default: one spawned
    worker process, created at :meth:`start`).
    """

    def __init__(self, config: LearnConfig, *, worker_ids: Callable[[], tuple[str, ...]],
                 current_artifact: Callable[[], str | None],
                 swap: Callable[[str], Awaitable[object]],
                 on_event: Callable[[str, dict], None] | None = None,
                 executor=None) -> None:
        self.config = config
        self.directory = Path(config.directory).absolute()  # saved paths survive a cd
        self.buffer = LearnBuffer(config.max_requests)
        self._worker_ids = worker_ids
        self._current = current_artifact
        self._swap = swap
        self._on_event = on_event or (lambda name, info: None)
        self._executor = executor
        self._own_executor = executor is None
        self.detector: DriftDetector | None = None  # calibrated for the running artifact
        self.fit_task: asyncio.Task | None = None
        self._persist_task: asyncio.Task | None = None
        self._checks: set[asyncio.Task] = set()
        self._dirty = False
        self._calibrated_at = -(1 << 62)  # num_seen at the last drift calibration
        self._pool_pending = False  # the refit due is for a decoder change, not drift
        self._stopping = False
        self._persist_lock = asyncio.Lock()
        # (fingerprint, vocab size) of the router's tokenizer, for the prompt predictor
        self.tokenizer: tuple[str, int] | None = None
        self.state: dict = {"fits": 0, "accepted": 0, "refused": 0, "failed": 0,
                            "drifts": 0, "artifact": None, "drift_point": None,
                            "last_attempt_seen": None, "last": None}

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Reload ``DIR`` (buffer and state), start the fit process and the periodic write."""
        self.directory.mkdir(parents=True, exist_ok=True)
        saved = await asyncio.to_thread(buffer_io.restore, self.buffer,
                                        self.directory / _BUFFER)
        self.state.update({k: v for k, v in saved.items() if k in self.state})
        if self._executor is None:
            import concurrent.futures
            import multiprocessing

            self._executor = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self._persist_task = asyncio.ensure_future(self._persist_loop())
        self._emit("started", requests=len(self.buffer), seen=self.buffer.num_seen,
                   artifact=self._current())
        if self._current() is not None and self.config.drift and \
                len(self.buffer) >= self.config.drift_window + 10:
            self._calibrated_at = self.buffer.num_seen
            self._launch("calibrate", self.buffer.snapshot(), fit=False)

    async def stop(self) -> None:
        """Write the buffer one last time and let the fit process go."""
        self._stopping = True
        for task in (self._persist_task, *self._checks):
            if task is not None:
                task.cancel()
        if self.fit_task is not None and not self.fit_task.done():
            self.fit_task.cancel()  # the process finishes its job; its answer is dropped
        await asyncio.gather(*(t for t in (self._persist_task, self.fit_task, *self._checks)
                               if t is not None), return_exceptions=True)
        await self.persist()
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- requests -------------------------------------------------------------------------
    def observe(self, record: Record, signature: np.ndarray | None = None) -> None:
        """One completed request (on the event loop). ``signature``: its signature under
        the running artifact, for drift (None without an artifact)."""
        self.buffer.add(record)
        self._dirty = True
        if self.buffer.num_seen % self.config.min_requests == 0:
            self._emit("collected", requests=len(self.buffer), seen=self.buffer.num_seen)
        det = self.detector
        if det is not None and signature is not None and self.state["drift_point"] is None \
                and signature.shape == (det.dim_,):
            window = det.push(signature, record.decode_counts)
            if window is not None:
                task = asyncio.ensure_future(self._check(det, window))
                self._checks.add(task)
                task.add_done_callback(self._checks.discard)
        self._maybe_fit()

    def observe_steps(self, decoder: str, distinct: np.ndarray) -> None:
        """Measured distinct experts per layer of a decoder's steps (engine input, optional)."""
        if self.detector is None:
            return
        rep = self.detector.push_steps(decoder, distinct)
        if rep is not None:
            self._emit("drift_checked", reports=[rep], decoder=decoder)
            self._after_check()

    async def _check(self, det: DriftDetector, window) -> None:
        reports = await asyncio.to_thread(det.check, window)
        if det is not self.detector:
            return  # an artifact was swapped in meanwhile: this window tested the old one
        det.conclude(reports)
        self._emit("drift_checked", reports=reports)
        self._after_check()

    def _after_check(self) -> None:
        det = self.detector
        if det is None or not det.drifted or self.state["drift_point"] is not None:
            return
        signals = sorted(s for s, n in det.consecutive_.items() if n >= det.patience)
        start = self.buffer.num_seen - det.patience * det.window
        self.state["drift_point"] = max(start, 0)
        self.state["drifts"] += 1
        self._dirty = True
        self._emit("drift", signals=signals, scores={s: det.last_[s].score for s in signals},
                   since=self.state["drift_point"])
        det.reset()
        self._maybe_fit()

    # -- fitting --------------------------------------------------------------------------
    def _maybe_fit(self) -> None:
        if self.fit_task is not None and not self.fit_task.done():
            return
        cfg, seen = self.config, self.buffer.num_seen
        if self._current() is None:
            last = self.state["last_attempt_seen"]
            wait = 0 if last is None else cfg.min_requests // 2
            if len(self.buffer) >= cfg.min_requests and (last is None or seen - last >= wait):
                self._launch("first", self.buffer.snapshot())
        elif self.state["drift_point"] is not None:
            since = seen - int(self.state["drift_point"])
            if since >= cfg.min_requests:
                reason = "pool" if self._pool_pending else "drift"
                self._pool_pending = False
                self._launch(reason, self.buffer.snapshot(last=min(since, cfg.max_requests)))
        elif cfg.drift and self.detector is None and seen - self._calibrated_at >= \
                cfg.min_requests and len(self.buffer) >= max(cfg.min_requests,
                                                             cfg.drift_window + 10):
            # an artifact given with --artifact (or learned before a restart) and no drift
            # reference yet: calibrate on the traffic it has been serving
            self._calibrated_at = seen
            self._launch("calibrate", self.buffer.snapshot(), fit=False)

    def _launch(self, reason: str, records: list[Record], *, fit: bool = True) -> None:
        self.fit_task = asyncio.ensure_future(self._run_fit(reason, records, fit))
        self.fit_task.add_done_callback(self._after_fit)

    def _after_fit(self, task: asyncio.Task) -> None:
        """A fit ended: start what became due meanwhile (a refit for decoders that
        changed during it) without waiting for the next request."""
        if not self._stopping and not task.cancelled():
            self._maybe_fit()

    def _job(self, records: list[Record], fit: bool) -> FitJob:
        cfg = self.config
        seq = self.state["fits"] + 1
        drift = (None if not cfg.drift else
                 {"window": cfg.drift_window, "alpha": cfg.drift_alpha,
                  "patience": cfg.drift_patience, "random_state": cfg.seed})
        return FitJob(records=records, model=self.buffer.model, top_k=int(self.buffer.top_k),
                      worker_ids=tuple(self._worker_ids()),
                      output=str(self.directory / _ARTIFACTS / f"{seq:04d}"),
                      current=self._current(), holdout=cfg.holdout,
                      batch_size=cfg.batch_size, min_gain=cfg.min_gain,
                      max_balance=cfg.max_balance, rho_tolerance=cfg.rho_tolerance,
                      tau=cfg.tau, seed=cfg.seed,
                      drift=drift, fit=fit,
                      tokenizer_fingerprint=self.tokenizer[0] if self.tokenizer else "",
                      vocab_size=self.tokenizer[1] if self.tokenizer else None)

    async def _run_fit(self, reason: str, records: list[Record], fit: bool) -> None:
        loop = asyncio.get_running_loop()
        job = self._job(records, fit)
        if fit:
            self.state["fits"] += 1
            self.state["last_attempt_seen"] = self.buffer.num_seen
            self._emit("fit_started", reason=reason, requests=len(records))
        try:
            outcome: FitOutcome = await loop.run_in_executor(self._executor, run_fit_job, job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a fit must never take the router down
            self.state["failed"] += 1
            self._emit("fit_failed", reason=reason, error=f"{type(exc).__name__}: {exc}")
            return
        finally:
            self._dirty = True
        if not fit:
            self.detector = outcome.detector
            self._emit("calibrated", requests=outcome.num_requests,
                       drift=outcome.detector is not None, notes=outcome.notes)
            return
        info = {"reason": reason, "requests": outcome.num_requests,
                "with_decode": outcome.num_with_decode, "seconds": outcome.seconds,
                "pid": outcome.pid, "candidate": outcome.candidate,
                "running": outcome.current, "notes": outcome.notes}
        if outcome.accepted:
            try:
                await self._swap(outcome.artifact)
            except Exception as exc:
                shutil.rmtree(outcome.artifact, ignore_errors=True)
                outcome.accepted = False
                outcome.reasons = [f"reload: the router refused it: {exc}"]
        self.state["last"] = {k: info[k] for k in ("reason", "requests", "with_decode",
                                                   "seconds", "candidate", "running")}
        self.state["last"].update(accepted=outcome.accepted, reasons=outcome.reasons)
        if outcome.accepted:
            self.state["accepted"] += 1
            self.state["artifact"] = outcome.artifact
            self.state["drift_point"] = None
            self.detector = outcome.detector
            self._prune()
            self._emit("fit_accepted", **info, artifact=outcome.artifact)
            self._emit("swapped", artifact=outcome.artifact)
        else:
            self.state["refused"] += 1
            self.state["drift_point"] = None  # drift must be declared anew to refit
            if self.detector is None or outcome.detector is not None:
                self.detector = outcome.detector or self.detector
            self._emit("fit_refused", **info, reasons=outcome.reasons)
        if tuple(self._worker_ids()) != job.worker_ids:
            self._pool_changed_during_fit()
        await self.persist()

    def pool_changed(self) -> None:
        """The router's decoders changed. Fits read them when they start, so a first fit
        is simply for the new set; with an artifact running (fitted for the old set) a
        refit on the whole buffer is due now (reason ``pool``). A fit running now finishes
        for the old set; the refit follows it (:meth:`_run_fit`)."""
        if self._current() is not None:
            if self.state["drift_point"] is None:
                self.state["drift_point"] = max(0, self.buffer.num_seen - len(self.buffer))
            self._pool_pending = True
        self._maybe_fit()

    def _pool_changed_during_fit(self) -> None:
        """The decoders changed while a fit ran for the old set (its candidate could not
        be swapped in, or now runs for a set that is gone): refit for the new set on the
        whole buffer at once."""
        if self._current() is None:
            self.state["last_attempt_seen"] = None  # the first fit again, no waiting
        else:
            self.state["drift_point"] = max(0, self.buffer.num_seen - len(self.buffer))
            self._pool_pending = True
        self._emit("pool_refit", decoders=list(self._worker_ids()))

    def _prune(self) -> None:
        """Keep the running learned artifact and the one before it."""
        root = self.directory / _ARTIFACTS
        keep = sorted(p for p in root.iterdir() if p.is_dir())[-2:] if root.is_dir() else []
        for p in sorted(root.glob("*")) if root.is_dir() else []:
            if p.is_dir() and p not in keep and str(p) != self._current():
                shutil.rmtree(p, ignore_errors=True)

    # -- persistence ----------------------------------------------------------------------
    async def persist(self) -> None:
        """Write the buffer and state to ``DIR/buffer`` (in a thread, one write at a time)."""
        async with self._persist_lock:
            records = self.buffer.snapshot()
            self._dirty = False
            await asyncio.to_thread(
                buffer_io.save, self.directory / _BUFFER, records, model=self.buffer.model,
                top_k=self.buffer.top_k, num_seen=self.buffer.num_seen,
                num_dropped=self.buffer.num_dropped, state=dict(self.state))
        self._emit("persisted", requests=len(records))

    async def _persist_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.persist_interval)
            if self._dirty:
                with contextlib.suppress(OSError, ValueError):
                    await self.persist()

    def _emit(self, name: str, **info) -> None:
        try:
            self._on_event(name, info)
        except Exception:  # reporting must never break learning
            log.exception("learn event handler failed on %s", name)
