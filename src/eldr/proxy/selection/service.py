"""The decode-selection API's logic: select a decoder, reserve it, mark the prefill
complete, release; reservations that expire (docs/selection-api.md).

:class:`Selection` decides with the router's own routing snapshot (``live``: its policy,
encoder, artifact) on the router's own live loads (``pool.tracker``), so a reservation is
load for the proxy's requests and the proxy's requests are load for a selection. A
reservation is dispatched to the policy (``policy.on_dispatch``, so ``eldr_cost`` counts
its expected experts on the decoder) and counted in the pool (``pool.begin``: the loads,
``/health``, ``eldr_decoder_in_flight`` and ``eldr_decoder_load``, a drain waits for it)
until it is released or expires; then it is released exactly once to the policy it was
dispatched to, as the request flow does.

With ``eldr serve --workers N`` the reservations live in a
:class:`~eldr.proxy.selection.table.SelectionTable` every worker shares; a worker applies
what other workers were asked about its reservations on its next sweep (every
``sweep_interval`` seconds), see :mod:`eldr.proxy.selection.table`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eldr.proxy.errors import ProxyError
from eldr.proxy.request import read_inputs
from eldr.proxy.request.signatures import payload_shape
from eldr.proxy.selection.table import ACTIVE, ENDED, OUTCOME_CODES, OUTCOMES, SelectionTable
from eldr.routing import NoHealthyWorkerError, RouteRequest

if TYPE_CHECKING:
    from eldr.proxy.engines import Instance, UpstreamPool
    from eldr.proxy.metrics import RouterMetrics
    from eldr.proxy.request import LiveRouting, RoutingState
    from eldr.routing import Policy

__all__ = ["Query", "Selection", "SelectionConfig"]

log = logging.getLogger("eldr.serve")


@dataclass(frozen=True, slots=True)
class SelectionConfig:
    """Lifetimes of reservations and the size of the reservation table."""

    reserve_ttl: float = 60.0  # s a reservation lives until its prefill is marked complete
    decode_ttl: float = 600.0  # s it lives after that (the decode), unless released
    max_ttl: float = 3600.0  # the longest ``ttl`` a caller may ask for
    sweep_interval: float = 0.05  # s between sweeps for expiry and other workers' requests
    capacity: int = 4096  # reservation records per router process

    def __post_init__(self) -> None:
        for name in ("reserve_ttl", "decode_ttl", "max_ttl", "sweep_interval"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if max(self.reserve_ttl, self.decode_ttl) > self.max_ttl:
            raise ValueError(f"reserve_ttl and decode_ttl must be <= max_ttl "
                             f"({self.max_ttl}), got {self.reserve_ttl} and {self.decode_ttl}")
        if not (isinstance(self.capacity, int) and self.capacity >= 1):
            raise ValueError(f"capacity must be an int >= 1, got {self.capacity!r}")


@dataclass(frozen=True, slots=True)
class Query:
    """One select or reserve request, checked (eldr.proxy.selection.routes parses it)."""

    token_ids: np.ndarray | None = None  # (P,) int64 prompt token ids, or None
    # {"prompt": text or ids} or {"messages": [...]}: tokenized by the router, or None
    text: dict | None = None
    payload: object = None  # the capture plugin's eldr payload, or None
    prompt_tokens: int | None = None  # the prompt's length (the decoder's context), if known
    candidates: tuple[str, ...] | None = None  # decoder names to choose among (None: all)
    request_id: str | None = None  # the caller's id, echoed (ours keys the reservation)
    ttl: float | None = None  # reserve: seconds until expiry (None: reserve_ttl)


@dataclass(frozen=True, slots=True)
class _Choice:
    worker: int  # decoder index in the pool
    route: RouteRequest  # what the policy decided with
    source: str  # "payload", "token_ids", "prompt" or "none": what it was made from
    fallback: str | None  # why it was routed by load only (None: it was not)
    band_size: int | None
    cost: float | None


@dataclass(slots=True)
class _Held:
    """A reservation this process owns: what its release must undo."""

    inst: Instance  # the decoder, as counted by ``pool.begin``
    policy: Policy  # the policy it was dispatched to (its routing snapshot's)
    rid: str  # the reservation id (the policy's request id)


class Selection:
    """The selection API of one router process (the HTTP side is
    :mod:`eldr.proxy.selection.routes`).

    ``live``/``pool``/``metrics``: the router's routing snapshot, engines and metrics.
    ``table``/``row``: the reservation table and this process's row of it (default: a
    table of its own); :meth:`share` switches to one shared by ``--workers N`` before the
    app starts. ``clock``: the monotonic time reservations' deadlines are kept in (the
    same in every process of a shared table; tests move one by hand).
    """

    def __init__(self, live: LiveRouting, pool: UpstreamPool, metrics: RouterMetrics, *,
                 config: SelectionConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.live, self.pool, self.metrics = live, pool, metrics
        self.clock = clock
        self.config = config if config is not None else SelectionConfig()
        self.table = SelectionTable(1, self.config.capacity)
        self.row = 0
        self._held: dict[int, _Held] = {}  # record index in our row -> what it holds
        self._keys: dict[str, int] = {}  # one process: decoder name -> key (else: slots)
        self._cursor = 0  # next record index to try (records are reused round robin)
        self._task: asyncio.Task | None = None
        self._register_metrics(metrics.registry)

    def share(self, table: SelectionTable, row: int) -> None:
        """Use ``table`` (made before ``fork`` by ``eldr serve --workers N``), row ``row``
        (this worker's, cleared: a restarted worker's reservations died with it)."""
        if not 0 <= row < table.num_workers:
            raise ValueError(f"row {row} is not a row of a table of {table.num_workers}")
        if self._held:
            raise ValueError("share() is for a router that has made no reservation yet")
        table.clear_row(row)
        self.table, self.row = table, row

    # -- metrics ---------------------------------------------------------------------------
    def _register_metrics(self, reg) -> None:
        self.m_decisions = reg.counter(
            "eldr_selection_decisions_total", "Selection API decisions (select and reserve) "
            "by decoder and by what they were made from (payload, token_ids, prompt, none).",
            ("decoder", "input"))
        self.m_fallbacks = reg.counter(
            "eldr_selection_fallbacks_total", "Selection API decisions made by load only "
            "although an input was given, by reason.", ("reason",))
        self.m_events = reg.counter(
            "eldr_selection_reservations_total", "Selection API reservation events: "
            "reserved, prefill_complete, completed, failed, cancelled, expired (never "
            "released in time).", ("event",))
        self.m_events.prime(*((e,) for e in ("reserved", "prefill_complete", *OUTCOME_CODES)))
        reg.gauge("eldr_selection_reservations_active", "Reservations holding each "
                  "decoder now (every router process of --workers N).", ("decoder",),
                  collect=self._active_by_name)

    def _active_by_name(self) -> dict[tuple[str], float]:
        counts = self.table.active_by_key()
        out = {}
        for inst in self.pool.decode:
            out[(inst.name,)] = float(counts.get(self._key_of(inst), 0))
        return out

    # -- decoder keys: the same decoder, the same number, in every worker ------------------
    def _key_of(self, inst: Instance) -> int:
        slots = getattr(self.pool.tracker, "slots", None)  # SharedLoadTracker (--workers N)
        if slots is not None:
            return int(slots[inst.index])
        return self._keys.setdefault(inst.name, len(self._keys))

    def _instance_of_key(self, key: int) -> Instance | None:
        slots = getattr(self.pool.tracker, "slots", None)
        for inst in self.pool.decode:
            if (int(slots[inst.index]) if slots is not None else self._keys.get(inst.name)) \
                    == key:
                return inst
        return None

    # -- life cycle ------------------------------------------------------------------------
    async def start(self, app=None) -> None:
        self._task = asyncio.ensure_future(self._sweep_loop())

    async def stop(self, app=None) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for index in list(self._held):  # the router stops: nothing stays counted
            self._finish(index, "cancelled")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            try:
                self.sweep()
            except Exception:  # a bug of ours: logged, the next sweep still runs
                log.exception("selection API: sweeping reservations failed")

    def sweep(self, now: float | None = None) -> int:
        """Apply the releases other workers wrote for our reservations and expire those
        past their deadline; returns how many ended."""
        t, row = self.table, self.row
        now = self.clock() if now is None else now
        gen = t.gen[row]
        active = t.state[row] == ACTIVE
        released = active & (t.release_gen[row] == gen)
        deadline = np.where(t.prefill_gen[row] == gen, t.prefill_deadline[row],
                            t.deadline[row])
        expired = active & ~released & (deadline < now)
        for index in np.flatnonzero(released):
            self._finish(int(index), OUTCOMES[int(t.release_outcome[row, index])] or
                         "completed", now)
        for index in np.flatnonzero(expired):
            self._finish(int(index), "expired", now)
        return int(released.sum() + expired.sum())

    # -- deciding --------------------------------------------------------------------------
    def _mask(self, candidates: tuple[str, ...] | None) -> np.ndarray:
        """(K,) bool decoders the decision may pick: available, among the candidates."""
        pool = self.pool
        mask = pool.decode_available()
        if candidates is not None:
            names = {i.name: i.index for i in pool.decode}
            unknown = [c for c in candidates if c not in names]
            if unknown:
                raise ProxyError(400, f"unknown worker(s) {unknown} in 'candidates'; the "
                                      f"workers are {sorted(names)}", code="unknown_worker",
                                 param="candidates")
            wanted = np.zeros_like(mask)
            wanted[[names[c] for c in candidates]] = True
            mask &= wanted
        if not mask.any():
            among = " among the candidates" if candidates is not None else ""
            raise ProxyError(503, f"no healthy decode worker{among} takes requests now",
                             code="no_decoder")
        return mask

    def _inputs(self, state: RoutingState, query: Query
                ) -> tuple[np.ndarray | None, np.ndarray | None, int, str, str | None]:
        """(signature, profile, context tokens, source, fallback reason) for the policy."""
        context = query.prompt_tokens or 0
        want_sig, want_profile = state.needs_signature, state.needs_profile
        if not (want_sig or want_profile):
            return None, None, context, "none", None
        problem = None
        if query.payload is not None:
            reading = read_inputs({}, query.payload, state, query.prompt_tokens)
            if reading.problem in ("malformed", "mismatch") and reading.source == "payload":
                raise ProxyError(400, _payload_error(query.payload, state, reading.problem),
                                 code="invalid_payload", param="eldr")
            got = (reading.signature is not None) if want_sig else \
                (reading.profile is not None)
            if got:
                return (reading.signature, reading.profile, reading.context_tokens,
                        "payload", None)
            problem = reading.problem
        ids, source = query.token_ids, "token_ids"
        if ids is not None or query.text is not None:
            if query.text is not None:
                source = "prompt"
            predict = _prompt_predict(state)
            if predict is None:
                return None, None, context or (0 if ids is None else len(ids)), source, \
                    problem or "no_prompt_predictor"
            if ids is None:
                ids, why = _tokenize(state, query.text)
                if ids is None:
                    return None, None, context, source, problem or why
            try:
                signature, profile = predict(ids)
            except ValueError as exc:  # empty prompt, ids outside the vocabulary
                raise ProxyError(400, f"the prompt cannot be routed: {exc}",
                                 code="invalid_token_ids", param=source) from None
            signature = np.asarray(signature, dtype=np.float32).reshape(-1)
            if want_profile and profile is not None:
                bind = getattr(state.policy, "bind", None)
                if bind is not None:
                    bind(*np.shape(profile))
            return (signature if want_sig else None, profile if want_profile else None,
                    context or len(ids), source, None)
        if query.payload is not None:
            return None, None, context, "payload", problem or "unusable"
        return None, None, context, "none", "no_input"

    def choose(self, query: Query, request_id: str,
               state: RoutingState | None = None) -> _Choice:
        """The decoder for ``query`` (nothing is reserved)."""
        state = self.live.state if state is None else state
        mask = self._mask(query.candidates)
        signature, profile, context, source, reason = self._inputs(state, query)
        route = RouteRequest(request_id, signature=signature, profile=profile,
                             context_tokens=int(context))
        try:
            decided = state.policy.decide(route, self.pool.tracker.loads,
                                          None if mask.all() else mask)
        except NoHealthyWorkerError:
            raise ProxyError(503, "no healthy decode worker takes requests now",
                             code="no_decoder") from None
        k = int(decided.worker)
        fallback = reason if (decided.fallback or reason is not None) else None
        if fallback is not None and source != "none":
            self.m_fallbacks.inc(reason=fallback)
        self.m_decisions.inc(decoder=self.pool.decode[k].name, input=source)
        return _Choice(k, route, source, fallback, decided.band_size,
                       None if decided.cost is None else float(decided.cost))

    def describe_choice(self, choice: _Choice) -> dict:
        inst = self.pool.decode[choice.worker]
        loads = self.pool.tracker.loads
        return {"worker": inst.name, "url": inst.url, "input": choice.source,
                "fallback": choice.fallback, "band_size": choice.band_size,
                "cost": choice.cost, "load": float(loads[choice.worker]),
                "loads": {i.name: float(loads[i.index]) for i in self.pool.decode}}

    def select(self, query: Query) -> dict:
        """``POST .../select``: which decoder, nothing reserved."""
        choice = self.choose(query, f"select-{time.monotonic_ns()}")
        return self.describe_choice(choice)

    # -- reservations ----------------------------------------------------------------------
    def _ttl(self, ttl: float | None, default: float) -> float:
        if ttl is None:
            return default
        if ttl > self.config.max_ttl:
            raise ProxyError(400, f"'ttl' must be <= {self.config.max_ttl} s, got {ttl}",
                             code="invalid_request", param="ttl")
        return ttl

    def _free_record(self) -> int:
        t, row = self.table, self.row
        free = np.flatnonzero(t.state[row] != ACTIVE)
        if free.size == 0:
            raise ProxyError(429, f"all {t.capacity} reservation records of this router "
                                  f"process are held; release reservations (or let them "
                                  f"expire) before reserving more", code="reservations_full")
        after = free[free >= self._cursor]
        index = int(after[0] if after.size else free[0])
        self._cursor = (index + 1) % t.capacity
        return index

    def reserve(self, query: Query) -> dict:
        """``POST .../reserve``: choose, then hold the decoder until released or expired."""
        ttl = self._ttl(query.ttl, self.config.reserve_ttl)
        t, row = self.table, self.row
        index = self._free_record()
        gen = int(t.gen[row, index]) + 1
        rid = t.make_id(row, index, gen)
        state = self.live.state
        choice = self.choose(query, rid, state)
        inst = self.pool.decode[choice.worker]
        now = self.clock()
        t.gen[row, index] = gen
        t.key[row, index] = self._key_of(inst)
        t.created[row, index], t.deadline[row, index] = now, now + ttl
        t.outcome[row, index], t.ended[row, index] = 0, 0.0
        t.state[row, index] = ACTIVE
        self.pool.begin(inst)
        state.policy.on_dispatch(choice.route, choice.worker)
        self._held[index] = _Held(inst, state.policy, rid)
        self.m_events.inc(event="reserved")
        doc = self.describe_choice(choice)
        doc["reservation"] = self.describe(rid)
        if query.request_id is not None:
            doc["request_id"] = query.request_id
        return doc

    def _lookup(self, rid: str) -> tuple[int, int, int]:
        """(row, index, gen) of reservation ``rid``; ours is expired first if its deadline
        passed since the last sweep (an answer never shows a dead reservation active)."""
        t = self.table
        where = t.parse_id(rid)
        if where is None or not t.is_current(*where):
            raise ProxyError(404, f"no reservation {rid!r} (unknown, or ended long ago)",
                             code="reservation_not_found")
        row, index, _gen = where
        if row == self.row and t.state[row, index] == ACTIVE and \
                t.effective_deadline(row, index) < self.clock():
            self.sweep()
        return where

    def _check_active(self, rid: str, where: tuple[int, int, int], action: str) -> None:
        t = self.table
        row, index, gen = where
        if t.state[row, index] == ENDED or t.release_gen[row, index] == gen:
            ended = self.describe(rid)
            outcome = ended["outcome"] or "released"
            status, code = (410, "reservation_expired") if outcome == "expired" else \
                (409, "reservation_ended")
            raise ProxyError(status, f"reservation {rid} has ended ({outcome}); it cannot "
                                     f"be {action}", code=code)

    def prefill_complete(self, rid: str, ttl: float | None = None) -> dict:
        """``POST .../reservations/{id}/prefill_complete``: the decode starts; the
        reservation now lives ``ttl`` (default ``decode_ttl``) seconds more."""
        where = self._lookup(rid)
        self._check_active(rid, where, "marked prefill-complete")
        ttl = self._ttl(ttl, self.config.decode_ttl)
        row, index, gen = where
        if self.table.prefill_gen[row, index] == gen:
            raise ProxyError(409, f"reservation {rid} was already marked prefill-complete",
                             code="already_prefilled")
        self.table.request_prefill(row, index, gen, self.clock() + ttl)
        self.m_events.inc(event="prefill_complete")
        return {"reservation": self.describe(rid)}

    def release(self, rid: str, outcome: str = "completed") -> dict:
        """``POST .../reservations/{id}/release``: the request ended (``outcome``:
        completed, failed or cancelled). Applied at once by the worker that owns the
        reservation, by the owner's next sweep otherwise."""
        if outcome not in ("completed", "failed", "cancelled"):
            raise ProxyError(400, f"'outcome' must be completed, failed or cancelled, got "
                                  f"{outcome!r}", code="invalid_request", param="outcome")
        where = self._lookup(rid)
        self._check_active(rid, where, "released")
        row, index, gen = where
        if row == self.row:
            self._finish(index, outcome)
        else:
            self.table.request_release(row, index, gen, outcome)
        doc = self.describe(rid)
        doc.update(state="ended", outcome=outcome)  # the owner applies it on its sweep
        return {"reservation": doc}

    def _finish(self, index: int, outcome: str, now: float | None = None) -> None:
        """End our reservation at ``index``: out of the loads and the policy, once."""
        t, row = self.table, self.row
        held = self._held.pop(index, None)
        if t.state[row, index] == ACTIVE:
            t.outcome[row, index] = OUTCOME_CODES[outcome]
            t.ended[row, index] = self.clock() if now is None else now
            t.state[row, index] = ENDED
        if held is None:
            return
        if not held.inst.removed:
            self.pool.end(held.inst)
        held.policy.on_release(held.rid, "cancelled" if outcome == "expired" else outcome)
        self.m_events.inc(event=outcome)
        if outcome == "expired":
            log.warning("selection API: reservation %s at %s expired (never released)",
                        held.rid, held.inst.name)

    def describe(self, rid: str) -> dict:
        """A reservation as the API shows it (any worker may answer)."""
        row, index, gen = self._lookup(rid)
        t = self.table
        inst = self._instance_of_key(int(t.key[row, index]))
        state = int(t.state[row, index])
        released = state == ACTIVE and t.release_gen[row, index] == gen
        mono, wall = self.clock(), time.time()
        doc = {"id": rid, "worker": inst.name if inst is not None else None,
               "url": inst.url if inst is not None else None,
               "state": "ended" if state == ENDED or released else "active",
               "prefill_complete": bool(t.prefill_gen[row, index] == gen),
               "outcome": (OUTCOMES[int(t.outcome[row, index])] if state == ENDED else
                           OUTCOMES[int(t.release_outcome[row, index])] if released else
                           None) or None,
               "created_at": wall - (mono - float(t.created[row, index])),
               "expires_at": None}
        if doc["state"] == "active":
            doc["expires_at"] = wall + (t.effective_deadline(row, index) - mono)
        return doc

    def num_active(self) -> int:
        """Active reservations of every worker."""
        return int((self.table.state == ACTIVE).sum())


def _tokenize(state: RoutingState, text: dict) -> tuple[np.ndarray | None, str | None]:
    """((P,) token ids of a ``{"prompt"}`` or ``{"messages"}`` body with the router's
    tokenizer (chat template included), None) or (None, why not: ``no_tokenizer``,
    ``no_chat_template``); ``ProxyError`` 400 for a prompt that has no tokens or is not one
    text. A prompt of token ids needs no tokenizer."""
    from eldr.proxy.request.prompts import Untokenizable, prompt_token_ids

    routing = getattr(state, "prompt", None)  # eldr.proxy.request.prompts.PromptRouting
    field = "messages" if "messages" in text else "prompt"
    try:
        return prompt_token_ids(text, "chat" if field == "messages" else "completions",
                                getattr(routing, "tokenizer", None)), None
    except Untokenizable as exc:
        if exc.reason in ("no_tokenizer", "no_chat_template"):
            return None, exc.reason
        raise ProxyError(400, f"'{field}' cannot be tokenized: {exc}",
                         code="invalid_request", param=field) from None
    except (ValueError, RecursionError) as exc:  # a template that fails on these messages
        raise ProxyError(400, f"'{field}' cannot be rendered and tokenized: {exc}",
                         code="invalid_request", param=field) from None


def _prompt_predict(state: RoutingState):
    """The routing snapshot's prompt prediction, ``token_ids -> (signature, profile)``
    (the artifact's ``route_inputs_from_prompt``), or None: no prompt predictor loaded."""
    prompt = getattr(state, "prompt", None)  # eldr.proxy.request.prompts.PromptRouting
    predict = getattr(prompt, "predict", None)
    return predict if callable(predict) else None


def _payload_error(payload: object, state: RoutingState, problem: str) -> str:
    if problem == "mismatch":
        return (f"the eldr payload is for (layers, experts) = {list(payload_shape(payload))}, "
                f"the router's artifact for {list(state.shape or ())}")
    return ("'eldr' is not a valid eldr payload (the capture plugin's "
            "kv_transfer_params['eldr']: version, shape, counts)")

