"""The decode table: one load and reservation state for every ingress replica of a Ray app.

A Ray Serve application may run several ingress (router) replicas, on several nodes. Each
chooses decode engines for its own requests; if each kept its own loads, two replicas
would send their next requests to the same "idle" decoder. So the loads, the
reservations and the routing policy live in ONE object, :class:`DecodeTable`, which the
app runs as a single-replica Serve deployment (:mod:`eldr.integrations.ray.app`) that
every ingress replica calls: ``reserve`` after the prefill answered, ``release`` when the
decode ended (completed, failed, or cancelled when the client left).

Why a Serve deployment and not ``eldr serve``'s selection API (docs/ray.md): it lives
and dies with the application (no second server, port or admin token to run beside Ray),
Ray places and restarts it, and a call is one Ray RPC from any node. The selection API
remains the way for orchestrators outside Ray.

The decision is ``eldr serve``'s, not a copy of it: the policy and the signature encoder
come from :func:`eldr.proxy.request.decision.build_state` (the artifact, ``--policy``,
``--tau``), the routing inputs from :func:`eldr.proxy.request.signatures.read_inputs`
(the capture plugin's payload in the prefill's ``kv_transfer_params``), loads from
:class:`eldr.routing.loads.LoadTracker`, and the policy gets the same ``on_dispatch`` /
``on_release`` events.

The same table serves Ray's own PD builder through
:class:`eldr.integrations.ray.router.EldrDecodeRouter`, a Serve ``RequestRouter``: there
the decoders are Serve LLM's decode replicas, which register nothing; the router passes
the replica ids it sees with every ``reserve`` (``replicas``), which registers and
heartbeats them, and the prompt's predicted inputs (``reading``) instead of a payload.

Decode engines are replicas of a Serve deployment: they come and go. The artifact names
``K`` decoders; the table has ``K`` slots (the artifact's worker ids) and each decode
replica takes a free slot when it registers (every health check re-registers it: a
heartbeat). A replica Serve started to replace a dead one takes the dead one's slot. A
slot whose holder missed its heartbeats, or whose engine an ingress could not reach, is
unhealthy: the policy skips it. Extra replicas beyond ``K`` wait as spares.

Pure Python: Ray is not imported here, so the whole state is unit-tested without Ray.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["DecodeTable", "TableConfig"]

_log = logging.getLogger("eldr.ray")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class TableConfig:
    """How the table decides; validated on construction."""

    num_decode: int  # K: decode slots (the artifact's worker count when there is one)
    artifact: str | None = None  # routing artifact directory, as eldr serve --artifact
    policy: str = "eldr_cost"  # a name in eldr.routing.POLICIES, as eldr serve --policy
    tau: float | None = None  # locality band width; None: the artifact's
    load_slack: float | None = None  # eldr_cost's bounded-load slack, as eldr serve
    cost_layer_stride: int = 1  # eldr_cost prices every s-th layer, as eldr serve
    reservation_ttl: float = 600.0  # seconds an unreleased reservation holds its decoder
    heartbeat_timeout: float = 30.0  # seconds without a heartbeat that make an engine unhealthy

    def __post_init__(self) -> None:
        if isinstance(self.num_decode, bool) or not isinstance(self.num_decode, int) \
                or not 1 <= self.num_decode <= 1024:
            raise ValueError(f"num_decode must be an integer in [1, 1024], got "
                             f"{self.num_decode!r}")
        from eldr.routing.cost import check_layer_stride

        check_layer_stride(self.cost_layer_stride, "cost_layer_stride")  # early: at app build
        for name in ("reservation_ttl", "heartbeat_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass
class _Engine:
    """One registered engine replica (mutable: heartbeats refresh it)."""

    replica: str  # Serve's replica id
    url: str  # the engine's base URL
    pid: int | None  # the engine's process id (its process group), for operators and tests
    node: str | None  # the Ray node it runs on
    seen: float  # clock time of its last heartbeat
    failed_at: float | None = None  # when an ingress last could not reach it


@dataclass(frozen=True, slots=True)
class _Held:
    """One reservation: which slot it loads, the policy it was dispatched to, and the
    request as the policy saw it (a :meth:`DecodeTable.move` dispatches it again)."""

    slot: int
    policy: object
    deadline: float
    request: object = None  # the eldr.routing.RouteRequest dispatched


class DecodeTable:
    """Loads, reservations and the routing policy of one Ray app (see the module doc).

    Every method is synchronous and short: the Serve deployment around it runs one call at
    a time, so each call sees and leaves a consistent state.
    """

    def __init__(self, config: TableConfig, *, clock: Callable[[], float] = time.monotonic,
                 state=None) -> None:
        from eldr.routing.loads import LoadTracker

        self.config = config
        self.clock = clock
        self.state = state if state is not None else _build_state(config)
        self.names: tuple[str, ...] = tuple(self.state.worker_names)  # (K,) slot names
        K = len(self.names)
        self.slots: list[_Engine | None] = [None] * K
        self.spares: dict[str, _Engine] = {}  # decode replicas beyond K
        self.prefills: dict[str, _Engine] = {}  # replica -> prefill engine
        self.tracker = LoadTracker(K)
        self.held: dict[str, _Held] = {}  # reservation id -> what it holds
        self.counters: Counter[str] = Counter()  # "reservations:completed", "fallbacks:..."
        self.decisions: Counter[tuple[str, str]] = Counter()  # (decoder, input) -> count

    # -- engines ---------------------------------------------------------------------------
    def register(self, role: str, replica: str, url: str, pid: int | None = None,
                 node: str | None = None) -> dict:
        """An engine replica is up (first call) or still up (heartbeat). Returns the slot
        name it serves (``None`` for a prefill or a spare)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        now = self.clock()
        if role == "prefill":
            eng = self.prefills.get(replica)
            if eng is None or eng.url != url:
                self.prefills[replica] = _Engine(replica, url, pid, node, now)
            else:
                eng.seen, eng.failed_at = now, None
            return {"slot": None}
        for k, eng in enumerate(self.slots):
            if eng is not None and eng.replica == replica:
                eng.seen, eng.url, eng.pid, eng.failed_at = now, url, pid, None
                return {"slot": self.names[k]}
        fresh = _Engine(replica, url, pid, node, now)
        k = self._free_slot(now)
        if k is None:
            known = replica in self.spares
            self.spares[replica] = fresh
            if known:  # a spare's heartbeat: said once
                return {"slot": None}
            _log.warning("decode replica %s is a spare: all %d slots of the artifact are held",
                         replica, len(self.slots))
            return {"slot": None}
        old = self.slots[k]
        if old is not None:
            _log.warning("decode slot %s: replica %s replaces %s", self.names[k], replica,
                         old.replica)
        self.spares.pop(replica, None)
        self.slots[k] = fresh
        return {"slot": self.names[k]}

    def _free_slot(self, now: float) -> int | None:
        """An empty slot, else the one whose holder has been silent longest past its
        heartbeat timeout (a dead replica Serve replaced), else None."""
        for k, eng in enumerate(self.slots):
            if eng is None:
                return k
        stale = [(eng.seen, k) for k, eng in enumerate(self.slots)
                 if not self._is_alive(eng, now)]
        return min(stale)[1] if stale else None

    def unregister(self, replica: str) -> None:
        """A replica stopped (Serve scaled it down or replaced it): its slot is free; a
        spare, if any, takes it."""
        self.prefills.pop(replica, None)
        self.spares.pop(replica, None)
        for k, eng in enumerate(self.slots):
            if eng is not None and eng.replica == replica:
                self.slots[k] = None
                if self.spares:
                    spare = self.spares.pop(next(iter(self.spares)))
                    self.slots[k] = spare

    def mark_failed(self, decoder: str) -> None:
        """An ingress could not reach ``decoder``'s engine: unhealthy until its next
        heartbeat (which its replica sends only while its engine answers)."""
        k = self.names.index(decoder) if decoder in self.names else None
        if k is not None and self.slots[k] is not None:
            self.slots[k].failed_at = self.clock()

    def _is_alive(self, eng: _Engine | None, now: float) -> bool:
        return eng is not None and eng.failed_at is None \
            and now - eng.seen <= self.config.heartbeat_timeout

    def healthy(self) -> np.ndarray:
        """(K,) bool: slots with a live, reachable engine."""
        now = self.clock()
        return np.array([self._is_alive(eng, now) for eng in self.slots], dtype=bool)

    # -- prefill ---------------------------------------------------------------------------
    def prefill_targets(self) -> list[dict]:
        """Live prefill engines: [{replica, url}]. Each ingress replica picks among them by
        its own prefills in flight (a prefill holds no decoder, so its load needs no
        shared count; one call fewer per request)."""
        now = self.clock()
        return [{"replica": e.replica, "url": e.url}
                for e in sorted(self.prefills.values(), key=lambda e: e.replica)
                if self._is_alive(e, now)]

    def prefill_params(self) -> dict:
        """What an ingress adds to each prefill request's ``kv_transfer_params`` so the
        engine's payload holds only the layers the policy reads: ``{"eldr_layers": [...]}``
        (the band's layer mask, the rows ``eldr_cost --cost-layer-stride`` prices), or
        ``{}`` for every layer (as ``eldr serve`` asks,
        :func:`eldr.proxy.request.signatures.payload_request`). An ``eldr_cost`` bound to
        the model's shape by its first payload asks for its rows from then on."""
        from eldr.proxy.request.signatures import payload_request

        return payload_request(self.state) or {}

    def prefill_failed(self, replica: str) -> None:
        """An ingress could not get an answer from this prefill engine: unhealthy until
        its next heartbeat."""
        if replica in self.prefills:
            self.prefills[replica].failed_at = self.clock()

    # -- reservations ----------------------------------------------------------------------
    def reserve(self, request_id: str, *, payload: object = None, doc: dict | None = None,
                prompt_tokens: int | None = None, exclude: tuple[str, ...] = (),
                reading=None, replicas: tuple[str, ...] | None = None) -> dict:
        """Choose the decoder for one request and hold it.

        ``payload``: the capture plugin's ``kv_transfer_params["eldr"]`` (or None);
        ``doc``: the rest of the prefill answer the router reads (vLLM's own
        ``routed_experts``), or None; ``prompt_tokens``: ``usage.prompt_tokens``;
        ``exclude``: decoders this request already failed on. ``reading``: an
        :class:`eldr.proxy.request.signatures.Reading` made elsewhere (the prompt's
        prediction, or none with the reason in ``problem``), used instead of the payload.
        ``replicas``: the Serve replica ids the caller may route to (Ray's own PD builder,
        whose decode replicas register nothing): each is registered (a heartbeat) and only
        slots they hold are chosen. Returns ``{"reservation", "decoder", "replica", "url",
        "input", "fallback"}``, or ``{"error": ...}`` when no healthy decoder is left (the
        caller answers 503 or routes by load). ``request_id`` must be unique among held
        reservations (callers make one per attempt).
        """
        from eldr.proxy.request.signatures import read_inputs
        from eldr.routing import NoHealthyWorkerError, RouteRequest

        self.sweep()
        if request_id in self.held:
            raise ValueError(f"reservation {request_id!r} is already held")
        state = self.state
        if reading is None:
            reading = read_inputs(doc or {}, payload, state, prompt_tokens)
        request = RouteRequest(request_id, signature=reading.signature,
                               profile=reading.profile,
                               context_tokens=int(reading.context_tokens or 0))
        serving = None if replicas is None else self._serve_replicas(tuple(replicas))
        mask = self.healthy()
        if serving is not None:
            mask &= serving
        for name in exclude:
            if name in self.names:
                mask[self.names.index(name)] = False
        self.tracker.healthy[:] = mask
        try:
            decision = state.policy.decide(request, self.tracker.loads, mask)
        except NoHealthyWorkerError:
            self.counters["no_healthy_decoder"] += 1
            return {"error": "no healthy decode engine"}
        k = int(decision.worker)
        state.policy.on_dispatch(request, k)
        self.tracker.on_dispatch(k)
        self.held[request_id] = _Held(k, state.policy,
                                      self.clock() + self.config.reservation_ttl, request)
        used = "none" if reading.signature is None and reading.profile is None \
            else reading.source
        fallback = reading.problem if decision.fallback else None
        self.decisions[(self.names[k], used)] += 1
        self.counters["reservations:reserved"] += 1
        if fallback is not None:
            self.counters[f"fallbacks:{fallback}"] += 1
        return {"reservation": request_id, "decoder": self.names[k],
                "replica": self.slots[k].replica, "url": self.slots[k].url, "input": used,
                "fallback": fallback}

    def _serve_replicas(self, replicas: tuple[str, ...]) -> np.ndarray:
        """(K,) bool: slots held by one of ``replicas`` (Serve replica ids), each of which
        is registered first (a heartbeat; a new one takes a free or stale slot). Those
        holding slots beat first: after a quiet spell every slot is stale, and a new
        replica must not take a live one's."""
        held = {eng.replica for eng in self.slots if eng is not None}
        for replica in sorted(replicas, key=lambda r: r not in held):
            self.register("decode", replica, f"serve-replica://{replica}")
        wanted = set(replicas)
        return np.array([eng is not None and eng.replica in wanted for eng in self.slots],
                        dtype=bool)

    def move(self, request_id: str, replica: str) -> dict:
        """The request held as ``request_id`` went to Serve replica ``replica``, not the
        one reserved (Serve's router takes the next rank when the chosen replica is full):
        its load and the policy's state for it move to that replica's slot. A replica
        without a slot (a spare) or an unknown id: nothing moves (``moved`` False)."""
        held = self.held.get(request_id)
        slot = next((k for k, eng in enumerate(self.slots)
                     if eng is not None and eng.replica == replica), None)
        if held is None or slot is None or slot == held.slot:
            return {"moved": False}
        self.tracker.on_complete(held.slot)
        held.policy.on_release(request_id, "cancelled")
        held.policy.on_dispatch(held.request, slot)
        self.tracker.on_dispatch(slot)
        self.held[request_id] = _Held(slot, held.policy, held.deadline, held.request)
        self.counters["reservations:moved"] += 1
        return {"moved": True, "decoder": self.names[slot]}

    def release(self, request_id: str, outcome: str = "completed") -> dict:
        """The decode of ``request_id`` ended (``completed``, ``failed``, ``cancelled``):
        its load and the policy's state for it are taken back. Releasing an unknown or
        already released id is a no-op (``released`` False): an expiry may come first."""
        from eldr.routing import OUTCOMES

        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        held = self.held.pop(request_id, None)
        if held is None:
            return {"released": False}
        self._end(request_id, held, outcome)
        return {"released": True}

    def _end(self, request_id: str, held: _Held, outcome: str) -> None:
        self.tracker.on_complete(held.slot)
        held.policy.on_release(request_id, "failed" if outcome == "expired" else outcome)
        self.counters[f"reservations:{outcome}"] += 1

    def sweep(self) -> int:
        """End the reservations past their deadline (an ingress that died holding them);
        returns how many."""
        now = self.clock()
        gone = [rid for rid, h in self.held.items() if h.deadline < now]
        for rid in gone:
            _log.warning("reservation %s expired unreleased", rid)
            self._end(rid, self.held.pop(rid), "expired")
        return len(gone)

    # -- views -----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything an operator or a test reads: decoders with load and health, prefill
        engines, reservations held, and the counters."""
        self.sweep()
        healthy = self.healthy()
        decoders = []
        for k, name in enumerate(self.names):
            eng = self.slots[k]
            decoders.append({"name": name, "load": float(self.tracker.loads[k]),
                             "healthy": bool(healthy[k]),
                             "replica": None if eng is None else eng.replica,
                             "url": None if eng is None else eng.url,
                             "pid": None if eng is None else eng.pid,
                             "node": None if eng is None else eng.node})
        return {"decoders": decoders,
                "prefills": [{"replica": e.replica, "url": e.url, "pid": e.pid, "node": e.node}
                             for e in self.prefills.values()],
                "spares": sorted(self.spares),
                "held": len(self.held),
                "policy": self.state.policy.name,
                "counters": dict(self.counters),
                "decisions": {f"{d}|{i}": n for (d, i), n in self.decisions.items()}}


def _build_state(config: TableConfig):
    """The routing snapshot ``eldr serve`` builds for the same artifact and policy.

    ``build_state`` maps decoders to URLs; the table's decoders are slots filled by Serve
    replicas later, so it gets one placeholder URL per slot (never called): only their
    count matters, and the names come from the artifact's worker ids."""
    from eldr.proxy.config import ServeConfig
    from eldr.proxy.request.decision import build_state

    K = config.num_decode
    if config.artifact is not None:
        from eldr.fit import artifact as artifact_mod

        K = len(artifact_mod.load(config.artifact).worker_ids)
        if K != config.num_decode:
            raise ValueError(f"the artifact {config.artifact} has {K} decode workers, but "
                             f"{config.num_decode} decode replicas are configured")
    serve = ServeConfig(prefill_urls=("http://prefill.invalid:1",),
                        decode_urls=tuple(f"http://slot-{k}.invalid:1" for k in range(K)),
                        artifact=config.artifact, policy=config.policy, tau=config.tau,
                        load_slack=config.load_slack,
                        cost_layer_stride=config.cost_layer_stride)
    return build_state(serve)
