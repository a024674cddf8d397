"""Prompt work off the event loop: tokenization, chat templating and prediction.

The event loop relays every request's bytes; anything slow on it delays them all.
Tokenizing a long prompt is slow next to relaying bytes, and the ``tokenizers`` library
holds the GIL while it encodes (a loop beside an encoding thread waits the GIL's switch
interval at a time: docs/serve.md, "Off the event loop"), as jinja2 does while it renders a
chat template. So:

- a **prediction job** (tokenize if needed, then ``route_inputs_from_prompt``) runs on a
  small thread pool (``ServeConfig.prompt_threads``); the compiled prediction kernel
  releases the GIL (:mod:`eldr.fit.prompt_kernel`);
- **tokenization and templating** of text prompts run in ``prompt_processes`` worker
  processes (spawned, each holding its own copy of the tokenizer), where holding the GIL
  stalls no one: the job's thread waits for the answer with the GIL released. With
  ``prompt_processes`` 0 the thread tokenizes itself;
- the work is **bounded**: at most ``prompt_queue`` jobs in flight, and a decision waits
  at most ``prompt_timeout`` seconds for its job. A request that finds the queue full, or
  whose job times out, is routed by load, counted as a fallback
  (``eldr_prompt_predictions_total{result="busy"|"timeout"}``), never refused; a job
  that timed out still finishes (a thread cannot be stopped), keeping its queue place
  until then, and a retry of that request reuses its token ids once it has them.

Queueing is measured (``eldr_prompt_queue_seconds``: submitted → started on a thread;
``eldr_prompt_work_seconds``: the job's own time; ``eldr_prompt_jobs``: in flight).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from eldr.proxy.config import ServeConfig
from eldr.proxy.metrics import RouterMetrics
from eldr.proxy.request.prompts import PromptTokenizer, RequestPrompt, Untokenizable
from eldr.proxy.request.signatures import Reading

__all__ = ["PromptOffload"]

log = logging.getLogger("eldr.serve")


@dataclass(frozen=True, slots=True)
class _Predicted:
    """What a job hands back to the loop."""

    signature: np.ndarray  # (d,) float32 finite unit signature
    profile: np.ndarray  # (L, E) float32 predicted profile
    num_tokens: int  # the prompt's token count (the decision's context)


# -- the tokenizer process ------------------------------------------------------------------
_worker_tokenizer: PromptTokenizer | None = None


def _init_worker(directory: str, chat_template: str | None) -> None:
    """Load the tokenizer once per worker process (the parent's template text, which may
    come from a file given to the parent only)."""
    global _worker_tokenizer
    _worker_tokenizer = PromptTokenizer(directory)
    _worker_tokenizer.chat_template = chat_template


def _tokenize_in_worker(body: dict, kind: str) -> tuple[bytes | None, str]:
    """(int64 ids as bytes, or None; the :data:`PREDICTION_RESULTS` reason)."""
    ids, reason = RequestPrompt(body, kind).token_ids(_worker_tokenizer)
    return (None if ids is None else ids.astype(np.int64).tobytes()), reason


def _warm() -> None:
    """A no-op job: the first real one then finds the process started."""


def _load_kernel(done: concurrent.futures.Future, predict=None) -> None:
    """Load (compile, the first time on a machine) the compiled prediction kernel, and run
    ``predict`` once on a one-token prompt, so that the artifact's predictor has made one
    call (its arrays checked against the kernel's one signature, eldr.fit.prompt_kernel)
    before a request's prompt timeout counts."""
    try:
        from eldr.fit.prompt import compiled_kernels

        compiled_kernels()  # never raises: a kernel that fails is logged, numpy stays
        if predict is not None:
            try:
                predict(np.zeros(1, dtype=np.int64))
            except Exception as exc:  # a warm-up only: requests meet the real error
                log.debug("prompt prediction warm-up: %s", exc)
    finally:
        done.set_result(None)


_TOKENIZE_KEYS = ("prompt", "prompt_embeds", "add_special_tokens", "messages",
                  "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


class _TokenizerProcesses:
    """The tokenizer worker processes of one tokenizer (spawned: never a fork of a process
    running an event loop and threads)."""

    def __init__(self, tokenizer: PromptTokenizer, processes: int) -> None:
        import multiprocessing

        self.tokenizer = tokenizer
        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=processes, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(str(tokenizer.directory), tokenizer.chat_template))
        # started now, each with its tokenizer loaded: done when all answered
        self.ready = [self.pool.submit(_warm) for _ in range(processes)]

    def token_ids(self, prompt: RequestPrompt, timeout: float) -> tuple[np.ndarray | None, str]:
        """The prompt's ids, tokenized in a worker (called on a job's thread: waiting
        releases the GIL); TimeoutError after ``timeout`` s."""
        body = {k: prompt.body[k] for k in _TOKENIZE_KEYS if k in prompt.body}
        raw, reason = self.pool.submit(_tokenize_in_worker, body, prompt.kind).result(timeout)
        return (None if raw is None else np.frombuffer(raw, dtype=np.int64)), reason

    def close(self) -> None:
        """Shut down without waiting (a replaced or failed pool, mid-run: its manager
        thread and workers end on their own)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        """Shut down and wait until the pool's manager thread and worker processes are
        gone (blocking: :meth:`PromptOffload.aclose` runs it on a thread of its own)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def terminate(self) -> None:
        """Kill the worker processes still running (a shutdown that did not finish: a
        stuck tokenization), so that the manager thread, which the interpreter joins at
        exit, ends too."""
        for process in list((getattr(self.pool, "_processes", None) or {}).values()):
            try:
                if process.is_alive():
                    process.terminate()
            except (OSError, ValueError):  # already gone, or closed
                pass


WARM_UP_LIMIT_S = 120.0  # the longest /health reports the prompt machinery as warming up
CLOSE_TIMEOUT_S = 5.0  # the longest aclose() waits for the tokenizer processes to stop


class PromptOffload:
    """Runs prompt predictions off the event loop (module docstring). ``config``: the
    router's (``prompt_threads``, ``prompt_processes``, ``prompt_queue``,
    ``prompt_timeout``); ``metrics``: the router's (``prompt_queue``, ``prompt_work``,
    ``prompt_jobs``)."""

    def __init__(self, config: ServeConfig, metrics: RouterMetrics) -> None:
        self.config, self.metrics = config, metrics
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.prompt_threads, thread_name_prefix="eldr-prompt")
        self._in_flight = 0
        self._processes: _TokenizerProcesses | None = None
        self._lock = threading.Lock()  # guards _processes (jobs' threads create it)
        self._closed = False
        self._kernel: concurrent.futures.Future | None = None  # the kernel's load, once asked
        # what the last prepare() started, and until when it counts as warming up
        self._warming: list[concurrent.futures.Future] = []
        self._warm_until = 0.0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def predict(self, state, prompt: RequestPrompt) -> tuple[Reading | None, str]:
        """(the inputs ``state.policy`` reads, predicted from the prompt, or None; the
        outcome, one of :data:`~eldr.proxy.request.prompts.PREDICTION_RESULTS`)."""
        routing = state.prompt
        if routing is None:
            return None, "no_predictor"
        if prompt.job is not None and not prompt.job.done():
            return None, "timeout"  # the request's last job is still running
        if self._in_flight >= self.config.prompt_queue or self._closed:
            return None, "busy"
        submitted = time.perf_counter()
        job = asyncio.wrap_future(self._threads.submit(self._run, routing, prompt, submitted))
        prompt.job = job
        self._in_flight += 1
        self.metrics.prompt_jobs.set(self._in_flight)
        job.add_done_callback(self._finished)
        try:
            predicted, result = await asyncio.wait_for(asyncio.shield(job),
                                                       self.config.prompt_timeout)
        except TimeoutError:
            return None, "timeout"
        if predicted is None:
            return None, result
        if state.needs_profile:
            bind = getattr(state.policy, "bind", None)
            if bind is not None:  # the policy's own state: touched on the loop only
                bind(*np.shape(predicted.profile))
        return Reading(predicted.signature if state.needs_signature else None,
                       predicted.profile if state.needs_profile else None,
                       predicted.num_tokens, "prompt", None), "ok"

    def _finished(self, job: asyncio.Future) -> None:
        self._in_flight -= 1
        self.metrics.prompt_jobs.set(self._in_flight)
        if not job.cancelled() and job.exception() is not None:
            log.warning("a prompt prediction job failed: %r", job.exception())

    # -- on a job's thread ---------------------------------------------------------------
    def _run(self, routing, prompt: RequestPrompt,
             submitted: float) -> tuple[_Predicted | None, str]:
        started = time.perf_counter()
        self.metrics.prompt_queue.observe(started - submitted)
        try:
            return self._predict(routing, prompt)
        finally:
            self.metrics.prompt_work.observe(time.perf_counter() - started)

    def _predict(self, routing, prompt: RequestPrompt) -> tuple[_Predicted | None, str]:
        ids, result = self._token_ids(routing.tokenizer, prompt)
        if ids is None:
            return None, result
        try:
            signature, profile = routing.predict(ids)
        except ValueError:
            return None, "invalid"
        signature = np.asarray(signature, dtype=np.float32).reshape(-1)  # as payloads give
        if not np.isfinite(signature).all():
            return None, "invalid"
        return _Predicted(signature, profile, int(ids.shape[0])), "ok"

    def _token_ids(self, tokenizer: PromptTokenizer | None,
                   prompt: RequestPrompt) -> tuple[np.ndarray | None, str]:
        """The prompt's ids: in a tokenizer process for text, on this thread for ids (no
        tokenizer) or when processes are off."""
        if tokenizer is None or self.config.prompt_processes == 0 or prompt.is_done \
                or not prompt.needs_tokenizer():
            return prompt.token_ids(tokenizer)
        procs = self._tokenizer_processes(tokenizer)
        if procs is None:  # closed: no new processes (nothing would shut them down)
            return None, "busy"
        try:
            ids, reason = procs.token_ids(prompt, self.config.prompt_timeout * 4 + 1.0)
        except concurrent.futures.TimeoutError:
            return None, "timeout"
        except Untokenizable as exc:
            return None, exc.reason
        except Exception as exc:  # a worker died (BrokenProcessPool) or failed: start anew
            if self._closed:  # cancelled by the shutdown: nothing failed, nothing to restart
                return None, "busy"
            log.warning("the prompt tokenizer process failed (%r): restarting it", exc)
            with self._lock:
                if self._processes is procs:
                    self._processes = None
            procs.close()
            return None, "failed"
        prompt.set_token_ids(ids, reason)
        return ids, reason

    def prepare(self, tokenizer: PromptTokenizer | None, predict=None
                ) -> list[concurrent.futures.Future]:
        """Get ready for a routing state that predicts from prompts (the router calls it
        when it gets one): the compiled prediction kernel loaded on a prompt thread (its
        first compilation takes seconds) and the tokenizer processes for ``tokenizer``
        started, not on the first requests, which would wait for them and be routed by
        load; the futures are done once each is ready."""
        if self._closed:
            return []
        if self._kernel is None or predict is not None:  # on a thread of its own: the
            self._kernel = concurrent.futures.Future()  # prompt threads stay free
            threading.Thread(target=_load_kernel, args=(self._kernel, predict), daemon=True,
                             name="eldr-prompt-kernel").start()
        ready = [self._kernel]
        if tokenizer is not None and self.config.prompt_processes > 0:
            procs = self._tokenizer_processes(tokenizer)
            ready += procs.ready if procs is not None else []
        self._warming, self._warm_until = ready, time.monotonic() + WARM_UP_LIMIT_S
        return ready

    def warming(self) -> bool:
        """Whether what :meth:`prepare` started is still loading (a request now would be
        routed by load, counted): ``/health`` says so, so that a client or a readiness
        probe can wait. Never longer than :data:`WARM_UP_LIMIT_S` after the prepare: a
        tokenizer process that hangs must not hold the router unready for ever."""
        return time.monotonic() < self._warm_until and not all(f.done() for f in self._warming)

    def _tokenizer_processes(self, tokenizer: PromptTokenizer
                             ) -> _TokenizerProcesses | None:
        """The processes of ``tokenizer``, started if need be; None once closed."""
        with self._lock:
            if self._closed:
                return None
            procs = self._processes
            if procs is None or procs.tokenizer is not tokenizer:
                if procs is not None:
                    procs.close()
                procs = self._processes = _TokenizerProcesses(tokenizer,
                                                              self.config.prompt_processes)
            return procs

    def close(self) -> None:
        """Stop taking jobs; running ones are left to finish (threads cannot be stopped).
        Does not wait for the tokenizer processes: from async code, prefer :meth:`aclose`."""
        procs = self._stop()
        if procs is not None:
            procs.close()

    async def aclose(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """:meth:`close`, and wait (at most ``timeout`` s, off the event loop) until the
        tokenizer processes and their pool's manager thread are gone.

        Why: a process pool shut down with ``wait=False`` leaves its manager thread
        running; on CPython 3.11 it can then touch one of the pool's pipes after that
        pipe's file descriptor was closed, and the interpreter prints an ``OSError:
        [Errno 9] Bad file descriptor`` traceback at exit. Shutting down with
        ``wait=True`` joins that thread and the workers first. That blocks, so it runs on
        a daemon thread of its own (not the loop's default executor, which
        ``asyncio.run`` joins without a limit on 3.11). A shutdown that does not finish
        in ``timeout`` (a stuck tokenization) is logged once, its workers are killed,
        and the router's shutdown goes on."""
        procs = self._stop()
        if procs is None:
            return
        finished: concurrent.futures.Future = concurrent.futures.Future()

        def shut_down() -> None:
            # running: a timeout's cancel no longer takes, so the outcome can always be set
            running = finished.set_running_or_notify_cancel()
            try:
                procs.join()
            except Exception as exc:  # reported on the loop
                if running:
                    finished.set_exception(exc)
            else:
                if running:
                    finished.set_result(None)

        threading.Thread(target=shut_down, daemon=True, name="eldr-prompt-close").start()
        try:
            await asyncio.wait_for(asyncio.wrap_future(finished), timeout)
        except TimeoutError:
            log.warning("the prompt tokenizer processes did not stop within %.1f s: "
                        "killing them", timeout)
            procs.terminate()
        except Exception as exc:
            log.warning("stopping the prompt tokenizer processes failed: %r", exc)

    def _stop(self) -> _TokenizerProcesses | None:
        """Stop taking jobs; the tokenizer processes, handed over to be shut down."""
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # a job's thread starts no processes after this
            procs, self._processes = self._processes, None
        return procs
