"""ELDR's decode router for Ray Serve LLM's own PD builder: a Serve ``RequestRouter``.

Since about Ray 2.55, ``build_pd_openai_app`` sends each request to a *decode* replica
first, and that replica calls its prefill (docs/ray.md). Serve's router of the decode
deployment therefore chooses before any prefill ran: it sees the prompt, never its
expert counts. :class:`EldrDecodeRouter` chooses there as ``eldr serve --decode-first``
does, and adopting it is one ``request_router_config`` entry of the decode deployment:

1. the prompt of a ``chat`` / ``completions`` call (``pending_request.args[0]``: the
   request model, or a dict) is tokenized and the artifact's prompt predictor gives its
   routing inputs (``route_inputs_from_prompt``), **off Serve's router loop and bounded**:
   ``eldr serve``'s own :class:`eldr.proxy.request.offload.PromptOffload` (a thread pool,
   tokenizer processes, at most ``prompt_queue`` jobs in flight, a decision waits at most
   ``prompt_timeout`` seconds). Without a predictor, on a full queue or a late job the
   request has no inputs: the policy routes it by load, and the fallback is counted;
2. the decision is the shared :class:`~eldr.integrations.ray.table.DecodeTable`'s: the
   policy ``eldr serve`` builds (``build_state``, same artifact, same ``eldr.routing``
   policy, no copy), on the loads of every router of the deployment, one Ray call
   (``reserve``) that also holds the decoder. The reservation is released when Serve
   reports the request completed (``on_request_completed``: success or error alike), or
   when its routing is cancelled (the client left before a replica was assigned);
3. the answer ranks the chosen replica first and every other after it, so Serve's own
   queue-length check still applies: a full replica is passed over, and the reservation
   then moves to the replica Serve used (``DecodeTable.move``).

Any other method of the deployment (``models``, ``llm_config``, ...) holds no decoder and
goes to the least busy replica (Serve's probe). A table that does not answer within
``table_timeout`` seconds: the request is routed by Serve's load check, counted.

The table is one named, detached Ray actor per (application, deployment, table
settings), made by the first router that needs it (``get_if_exists``), as Ray's own
prefix-aware router keeps its tree, and registered with Serve's controller so that
``serve.shutdown()`` removes it. Every router of the deployment (one per process holding
a handle to it: each ingress replica, on any node) shares it.

Known limits (docs/ray.md): Serve reports neither success nor failure to a router, so
every release is ``completed``; when a replica rejects a request (it is at
``max_ongoing_requests``) and Serve retries it before the rejected attempt's completion
arrives, that completion releases the new attempt's reservation (the request then runs
unheld: its load is missed, never leaked). A reservation nobody releases (a router
process that died) expires after ``reservation_ttl``.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hashlib
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

from ray.serve.request_router import RequestRouter

__all__ = ["ROUTED_METHODS", "DecodeRouterConfig", "EldrDecodeRouter", "prompt_body"]

_log = logging.getLogger("eldr.ray")

# the decode deployment's methods that generate, and the prompt kind each takes
ROUTED_METHODS = {"chat": "chat", "completions": "completions"}
# what tokenizing a prompt reads of a request body (eldr.proxy.request.prompts)
_PROMPT_KEYS = ("prompt", "prompt_embeds", "add_special_tokens", "messages",
                "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


@dataclass(frozen=True)
class DecodeRouterConfig:
    """``request_router_kwargs`` of :class:`EldrDecodeRouter` (JSON values only: Serve
    requires them); validated on construction.

    Serve pickles this module *by value* with the router class (its
    ``_serialize_request_router_cls``): nothing here may hold a lock or a handle at
    module level or in a class attribute (a ``functools.cached_property`` did, in
    Python 3.11)."""

    artifact: str | None = None  # routing artifact directory, as eldr serve --artifact
    policy: str = "eldr_cost"  # a name in eldr.routing.POLICIES, as eldr serve --policy
    tau: float | None = None  # locality band width; None: the artifact's
    load_slack: float | None = None  # eldr_cost's bounded-load slack
    cost_layer_stride: int = 1  # eldr_cost prices every s-th layer (eldr serve's option)
    num_decode: int | None = None  # decode replicas; None: the artifact's worker count
    tokenizer: str | None = None  # the model's tokenizer folder; None: the artifact's model
    chat_template: str | None = None  # a chat template file overriding the tokenizer's
    prompt_threads: int = 2  # prediction threads (eldr serve --prompt-threads)
    prompt_processes: int = 1  # tokenizer processes; 0: the threads tokenize
    prompt_queue: int = 32  # prediction jobs in flight at most; more: routed by load
    prompt_timeout: float = 0.25  # seconds a decision waits for its prediction
    table_timeout: float = 2.0  # seconds a decision waits for the table
    reservation_ttl: float = 600.0  # seconds an unreleased reservation holds its decoder
    heartbeat_timeout: float = 30.0  # seconds a replica unseen by any router stays routable
    allow_untested_ray: bool = False  # run on a Ray outside TESTED_RAY (with a warning)
    _decoders: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        t = self.table_timeout
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                and 0 < t <= 60):
            raise ValueError(f"table_timeout must be a number of seconds in (0, 60], got {t!r}")
        if self.artifact is None and self.num_decode is None:
            raise ValueError("num_decode (the decode deployment's num_replicas) is required "
                             "without an artifact")
        object.__setattr__(self, "_decoders", self._count_decoders())
        self.serve_config()  # the policy, τ and the prompt work settings, as eldr serve checks
        self.table_config()

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> DecodeRouterConfig:
        """The config of a ``request_router_kwargs`` mapping; unknown keys are refused."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"EldrDecodeRouter: unknown request_router_kwargs "
                             f"{sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs)

    @property
    def decoders(self) -> int:
        """K: the artifact's worker count (``num_decode``, if given, must equal it), else
        ``num_decode``; the artifact is read once, on construction."""
        return self._decoders

    def _count_decoders(self) -> int:
        if self.artifact is None:
            return self.num_decode
        from eldr.fit import artifact as artifact_mod

        K = len(artifact_mod.load(self.artifact).worker_ids)
        if self.num_decode is not None and self.num_decode != K:
            raise ValueError(f"the artifact {self.artifact} has {K} decode workers, but "
                             f"num_decode is {self.num_decode}")
        return K

    def table_config(self):
        """The shared table's :class:`~eldr.integrations.ray.table.TableConfig`."""
        from eldr.integrations.ray.table import TableConfig

        return TableConfig(num_decode=self.decoders, artifact=self.artifact,
                           policy=self.policy, tau=self.tau, load_slack=self.load_slack,
                           cost_layer_stride=self.cost_layer_stride,
                           reservation_ttl=self.reservation_ttl,
                           heartbeat_timeout=self.heartbeat_timeout)

    def serve_config(self):
        """The :class:`~eldr.proxy.config.ServeConfig` ``eldr serve`` would run with (its
        URLs are placeholders, never called): what ``build_state`` and the prompt
        offload read."""
        from eldr.proxy.config import ServeConfig

        K = self.decoders
        return ServeConfig(prefill_urls=("http://prefill.invalid:1",),
                           decode_urls=tuple(f"http://slot-{k}.invalid:1" for k in range(K)),
                           artifact=self.artifact, policy=self.policy, tau=self.tau,
                           load_slack=self.load_slack,
                           cost_layer_stride=self.cost_layer_stride, tokenizer=self.tokenizer,
                           chat_template=self.chat_template,
                           prompt_threads=self.prompt_threads,
                           prompt_processes=self.prompt_processes,
                           prompt_queue=self.prompt_queue, prompt_timeout=self.prompt_timeout)


def prompt_body(arg: object) -> dict | None:
    """The prompt fields of a request argument (a Serve LLM request model, or a dict), as
    the JSON body ``eldr.proxy.request.prompts`` tokenizes; None when it has none."""
    if isinstance(arg, dict):
        return {k: arg[k] for k in _PROMPT_KEYS if k in arg}
    dump = getattr(arg, "model_dump", None)
    fields = getattr(arg, "model_fields_set", None)
    if dump is None or fields is None:
        return None
    keys = {k for k in _PROMPT_KEYS if k in fields}
    return dump(include=keys) if keys else None


class _Gauge:
    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value


class _Seconds:
    def __init__(self) -> None:
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.count, self.sum = self.count + 1, self.sum + value


class _PromptMetrics:
    """What :class:`~eldr.proxy.request.offload.PromptOffload` records (eldr serve exports
    them to Prometheus; here they are in :meth:`EldrDecodeRouter.stats`)."""

    def __init__(self) -> None:
        self.prompt_jobs, self.prompt_queue, self.prompt_work = _Gauge(), _Seconds(), _Seconds()


@dataclass(eq=False)
class _Ticket:
    """One request this router routes: its prompt (tokenized once), its predicted inputs
    once known, and the reservation it holds."""

    prompt: object  # eldr.proxy.request.prompts.RequestPrompt
    created: float
    reading: object = None  # eldr.proxy.request.signatures.Reading predicted, once known
    reservation: str | None = None  # the table's reservation id, while held
    replica: str | None = None  # the Serve replica it holds
    attempts: int = 0  # reservations made so far (each choice makes one)
    watched: object = None  # the pending request's future its callback is on


class EldrDecodeRouter(RequestRouter):
    """Serve's router of a decode deployment, deciding with ELDR (module docstring).

    ``request_router_config`` of the decode deployment::

        request_router_class: eldr.integrations.ray.router:EldrDecodeRouter
        request_router_kwargs: {artifact: DIR, policy: eldr}   # DecodeRouterConfig
    """

    def initialize_state(self, table=None, routing_state=None, **kwargs) -> None:
        """Serve calls this with ``request_router_kwargs`` (:class:`DecodeRouterConfig`).

        ``table`` and ``routing_state`` are for tests and embedders (not JSON, so never
        from a Serve config): an object with the table's coroutines (``reserve``,
        ``release``, ``move``) instead of the shared actor, and a ready
        :class:`~eldr.proxy.request.decision.RoutingState` instead of the one built from
        the artifact."""
        import concurrent.futures

        from eldr.integrations.ray.app import check_ray_version
        from eldr.proxy.request.offload import PromptOffload

        self.config = config = DecodeRouterConfig.from_kwargs(kwargs)
        check_ray_version(allow_untested=config.allow_untested_ray)
        self.counters: Counter[str] = Counter()
        self._tickets: dict[str, _Ticket] = {}
        self._tasks: set = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._table = table
        self.prompt_metrics = _PromptMetrics()
        self._offload = PromptOffload(config.serve_config(), self.prompt_metrics)
        self._state: concurrent.futures.Future = concurrent.futures.Future()
        if routing_state is not None:
            self._state.set_result(routing_state)
        else:  # the artifact and tokenizer load off Serve's loop; meanwhile: by load
            import threading

            threading.Thread(target=self._build_state, daemon=True,
                             name="eldr-router-state").start()

    def _build_state(self) -> None:
        from eldr.proxy.request.decision import build_state

        try:
            if self._table is None:  # found or made here: its GCS calls block
                self._table = _actor_table(self.config.table_config(), self._deployment_id)
            state = build_state(self.config.serve_config())
            if state.prompt is not None:
                self._offload.prepare(state.prompt.tokenizer, state.prompt.predict)
            self._state.set_result(state)
        except BaseException as exc:
            _log.error("EldrDecodeRouter: the routing state failed to build (%r): every "
                       "request is routed by load", exc)
            self._state.set_exception(exc)

    def ready(self, timeout: float | None = None):
        """The routing state, once built (blocks: for tests and warm-ups, never the loop)."""
        return self._state.result(timeout)

    # -- the table ---------------------------------------------------------------------------
    def table(self):
        """The shared table's client: the named actor (found or made while the routing
        state builds, or here if a request comes first)."""
        if self._table is None:
            self._table = _actor_table(self.config.table_config(), self._deployment_id)
        return self._table

    def _spawn(self, make) -> None:
        """Run ``make()`` (a coroutine) on the router's loop without waiting for it, in a
        context of its own: a release spawned for a request that was cancelled must not
        be cancelled with it (Ray cancels the actor calls made in a cancelled actor
        task's context, ``ray._raylet.async_task_id``; see :meth:`PDRelay._spawn
        <eldr.integrations.ray.relay.PDRelay._spawn>`)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None

        async def run():
            try:
                await asyncio.wait_for(make(), self.config.table_timeout)
            except Exception as exc:  # a table that died or is slow: the TTL frees it
                self.counters["table_errors"] += 1
                _log.warning("EldrDecodeRouter: a table call failed: %r", exc)

        if running is loop:
            task = loop.create_task(run(), context=contextvars.Context())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            asyncio.run_coroutine_threadsafe(run(), loop)

    def _release(self, ticket: _Ticket, outcome: str) -> None:
        rid, ticket.reservation, ticket.replica = ticket.reservation, None, None
        if rid is not None:
            self.counters[f"released:{outcome}"] += 1
            self._spawn(lambda: self.table().release(rid, outcome))

    # -- Serve's hooks -----------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """[[the replica ELDR chose], [every other]] for a generation; [all] otherwise (Serve
        then takes the least busy). Never raises for a request: any problem routes by
        load, counted in :meth:`stats`."""
        if not candidate_replicas:
            return []
        everyone = [list(candidate_replicas)]
        meta = getattr(pending_request, "metadata", None)
        kind = ROUTED_METHODS.get(getattr(meta, "call_method", None))
        if kind is None:
            return everyone
        self._loop = asyncio.get_running_loop()
        iid = meta.internal_request_id
        ticket = self._tickets.get(iid)
        if ticket is None:
            ticket = self._ticket(iid, pending_request, kind)
        elif ticket.reservation is not None:  # chosen before (Serve backed off or retries)
            self._release(ticket, "cancelled")
        reading = ticket.reading
        if reading is None:
            reading = await self._read(ticket)
        replicas = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        rid = f"{iid}#{ticket.attempts}"
        ticket.attempts += 1
        call = asyncio.ensure_future(
            self.table().reserve(rid, reading=reading, replicas=tuple(replicas)))
        try:
            got = await asyncio.wait_for(asyncio.shield(call), self.config.table_timeout)
        except Exception as exc:
            self.counters["fallbacks:table"] += 1
            _log.warning("EldrDecodeRouter: the table did not decide (%r): routed by load", exc)
            # the call may still land (the actor was starting, or slow): released then.
            # Not released now: an actor of async methods need not run two calls of one
            # caller in the order they were sent
            call.add_done_callback(lambda done: self._late(done, rid))
            return everyone
        chosen = replicas.get(got.get("replica")) if "error" not in got else None
        if chosen is None:  # no healthy decoder among these replicas
            self.counters["fallbacks:no_decoder"] += 1
            if "error" not in got:
                self._spawn(lambda: self.table().release(rid, "cancelled"))
            return everyone
        ticket.reservation, ticket.replica = rid, got["replica"]
        self.counters[f"decisions:{got['input']}"] += 1
        if pending_request.future.done():  # cancelled while the table decided
            self._routed(iid, ticket, pending_request.future)
        elif ticket.watched is not pending_request.future:
            ticket.watched = pending_request.future
            pending_request.future.add_done_callback(
                lambda fut, iid=iid, ticket=ticket: self._routed(iid, ticket, fut))
        rest = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Serve's request ended on ``replica_id`` (answered, failed or cancelled: Serve
        does not say which): the reservation is released."""
        ticket = self._tickets.pop(internal_request_id, None)
        if ticket is not None:
            self._release(ticket, "completed")

    # -- helpers -----------------------------------------------------------------------------
    def _ticket(self, iid: str, pending_request, kind: str) -> _Ticket:
        from eldr.proxy.request.prompts import RequestPrompt

        now = time.monotonic()
        if len(self._tickets) >= 4096:  # tickets Serve never ended (it always should)
            for old, t in list(self._tickets.items()):
                if now - t.created > self.config.reservation_ttl:
                    del self._tickets[old]
        args = getattr(pending_request, "args", None) or [None]
        body = prompt_body(args[0]) or {}
        ticket = self._tickets[iid] = _Ticket(RequestPrompt(body, kind), now)
        return ticket

    async def _read(self, ticket: _Ticket):
        """The policy's inputs predicted from the prompt (kept on the ticket when there
        are some: a second choice for the same request reuses them), or a Reading with
        none whose ``problem`` says why (``prompt_<result>``, counted by the table)."""
        from eldr.proxy.request.signatures import Reading

        state = self._state.result() if self._state.done() and \
            self._state.exception() is None else None
        if state is None:
            result = "warming" if not self._state.done() else "failed"
        elif not (state.needs_signature or state.needs_profile):
            self.counters["predictions:not_used"] += 1
            ticket.reading = Reading(None, None, 0, "none", None)
            return ticket.reading
        else:
            reading, result = await self._offload.predict(state, ticket.prompt)
            if reading is not None:
                self.counters["predictions:ok"] += 1
                ticket.reading = reading
                return reading
        self.counters[f"predictions:{result}"] += 1
        return Reading(None, None, 0, "none", f"prompt_{result}")

    def _late(self, call, rid: str) -> None:
        """A reservation made after its decision gave up waiting: given back."""
        if not call.cancelled() and call.exception() is None \
                and "reservation" in call.result():
            self.counters["released:late"] += 1
            self._spawn(lambda: self.table().release(rid, "cancelled"))

    def _routed(self, iid: str, ticket: _Ticket, fut) -> None:
        """The request's routing ended: cancelled (the caller left before a replica was
        assigned: released), or assigned a replica other than the one held (moved)."""
        if self._tickets.get(iid) is not ticket or ticket.reservation is None:
            return
        if fut.cancelled() or fut.exception() is not None:
            del self._tickets[iid]
            self._release(ticket, "cancelled")
            return
        used = getattr(getattr(fut.result(), "replica_id", None), "to_full_id_str", None)
        used = used() if used is not None else None
        if used is not None and used != ticket.replica:
            ticket.replica = used
            rid = ticket.reservation
            self.counters["moved"] += 1
            self._spawn(lambda: self.table().move(rid, used))

    def stats(self) -> dict:
        """This router's counts: predictions by result, decisions by input, fallbacks,
        releases by outcome, moves, table errors; the tickets held; the prompt work."""
        m = self.prompt_metrics
        return {"counters": dict(self.counters),
                "held": sum(t.reservation is not None for t in self._tickets.values()),
                "tickets": len(self._tickets),
                "prompt_jobs": m.prompt_jobs.value, "prompt_work_count": m.prompt_work.count}

    def close(self) -> None:
        """Stop the prompt work (threads finish what they run)."""
        self._offload.close()


def _actor_table(config, deployment_id):
    """The shared table of ``deployment_id`` with ``config``: a named, detached Ray actor
    running :class:`~eldr.integrations.ray.deployments.EldrDecodeTable`, made by the first
    router to ask (``get_if_exists``) and registered with Serve's controller, which kills
    it on ``serve.shutdown()`` (best effort: a private call of Ray's, as Ray's own
    prefix-aware router makes). Its name carries a digest of ``config``: a redeploy with
    other settings gets a table of its own. Ray restarts it if its process dies: empty,
    as Serve restarts ``build_eldr_pd_app``'s table (loads from zero; releases of
    reservations it no longer knows are no-ops)."""
    import ray

    from eldr.integrations.ray.deployments import EldrDecodeTable, TableClient

    digest = hashlib.sha256(repr(config).encode()).hexdigest()[:12]
    app = getattr(deployment_id, "app_name", "") or "default"
    name = getattr(deployment_id, "name", "") or "decode"
    actor = ray.remote(EldrDecodeTable).options(
        name=f"EldrDecodeTable-{digest}", namespace=f"eldr::{app}::{name}",
        get_if_exists=True, lifetime="detached", num_cpus=0,
        max_restarts=-1).remote(config)  # restarted empty if its process dies
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(actor)
    except Exception as exc:  # no controller here (a test), or Ray changed the call
        _log.info("EldrDecodeRouter: the table actor is not registered for cleanup (%r)", exc)
    return TableClient(actor)
