"""The elastic decoder pool: decoders added and removed while the router serves.

Admin routes (bearer token, as ``/admin/reload``)::

    GET    /admin/decoders              the decoders, their health, load, draining flag
    POST   /admin/decoders              {"url": "http://HOST:PORT", "name": "d-3"} (name
                                        optional) → 201; the decoder takes requests as soon
                                        as its first health check passes (done before the
                                        answer)
    DELETE /admin/decoders/{name}       → 202: it drains; ``?wait=true`` → 200 once removed

**Adding.** The decoder gets the next index K in the pool, the load tracker and the policy
(``Policy.add_worker``). ``eldr_cost`` needs nothing fitted: the new decoder's footprint is
empty, so it is the cheapest place for the next requests at once. The band (``eldr``,
``eldr_top1``) needs a centroid: the new decoder copies the centroid of the decoder that
took the most decisions so far (the largest cluster by traffic), so the two split that
cluster (both are always in the same band; load decides between them) until a refit fits
K + 1 centroids. Load-only policies just count one more decoder.

**Removing.** The decoder drains: it takes no new request (``UpstreamPool.decode_available``
masks it), its in-flight requests run to their end (no timeout beyond the decode's own),
then, under the lock reloads take too, it leaves the pool, the tracker and the policy
(``Policy.remove_worker``: decoders above it move down one index) and its per-decoder
gauges leave ``/metrics``. The last decoder that is not draining cannot be removed (409).

**The routing snapshot.** Each change swaps the router's routing state for a copy with the
new decoder names (the policy object is the same, changed in place) and its config for one
whose ``decode_urls``/``decode_ids`` list the new set (``Router.swap``), so that an
artifact reload — and a learned artifact, which ``--learn`` fits for the router's current
decoders — is checked against the set being served. An artifact fitted for the old set is
refused (409) after a change. A request whose snapshot names another decoder set takes the
current one before it routes (``eldr.proxy.request.flow``); releases go to the policy object
it dispatched to.

**The decoders file.** ``eldr serve --decoders-file PATH`` (instead of ``--decode``) reads
the decoders from a file, one ``[ID=]URL`` a line; on ``SIGHUP`` the router re-reads it
(:meth:`ElasticPool.sync_file`): URLs new to the pool are added (named by their ID, else
``decode-N``), decoders whose URL is gone from the file drain and are removed, then the
artifact is reloaded as before.

**--workers N.** Each change goes through the workers' pool journal
(:mod:`eldr.proxy.workers.poollink`, ``self.link``): the parent checks and orders it, every
worker applies it (:meth:`ElasticPool.apply_add`, :meth:`ElasticPool.apply_drain`), and the
asking worker answers once it applied it itself; ``?wait=true`` answers once EVERY worker
has removed the decoder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from eldr.proxy.config import DECODER_NAME, ServeConfig, check_url, read_decoders_file
from eldr.proxy.control.admin import AdminToken, JournalLink
from eldr.proxy.errors import ProxyError
from eldr.proxy.request import LiveRouting, RoutingState, method_not_allowed

if TYPE_CHECKING:
    from eldr.proxy.engines import Instance, UpstreamPool
    from eldr.proxy.metrics import RouterMetrics

__all__ = ["ElasticPool"]

log = logging.getLogger("eldr.serve")

_DRAIN_POLL = 0.02  # seconds between looks at a draining decoder's in-flight count


class ElasticPool:
    """Adds and removes decoders of ``pool`` while the router serves.

    ``live``/``swap``: the routing snapshot and the router's one way to replace it;
    ``metrics``: the pool-change counters, the per-decoder series, the decisions (which
    decoder a new one copies); ``lock``: shared with artifact reloads, one change at a
    time; ``on_change(names)``: told the new decoder set after each change (the learner).
    """

    def __init__(self, live: LiveRouting, swap: Callable[[RoutingState, ServeConfig], None],
                 pool: UpstreamPool, metrics: RouterMetrics, token: AdminToken,
                 lock: asyncio.Lock, on_change: Callable[[tuple[str, ...]], None]) -> None:
        self.live, self._swap, self.pool, self.metrics = live, swap, pool, metrics
        self.token, self.lock, self._on_change = token, lock, on_change
        self._drains: dict[str, asyncio.Task] = {}  # name -> its drain-and-remove task
        self.link: JournalLink | None = None  # the pool journal, in a worker of --workers N

    # -- HTTP ------------------------------------------------------------------------------
    async def collection(self, request):
        """``GET`` lists, ``POST`` adds; any other method 405."""
        from aiohttp import web

        if request.method not in ("GET", "POST"):
            return method_not_allowed("GET, POST")
        self.token.authorize(request)
        if request.method == "GET":
            return web.json_response(self.describe())
        body = await _json_body(request)
        unknown = set(body) - {"url", "name"}
        if unknown:
            raise ProxyError(400, f"unknown field(s) {sorted(unknown)}; expected 'url' and "
                                  f"optionally 'name'", code="invalid_request")
        url, name = body.get("url"), body.get("name")
        if url is None:
            raise ProxyError(400, "'url' is required: the decoder's base URL, "
                                  "http://HOST:PORT", param="url")
        try:
            url = check_url(url, "decode")
        except ValueError as exc:
            raise ProxyError(400, str(exc), param="url") from None
        if name is not None and not (isinstance(name, str) and DECODER_NAME.fullmatch(name)):
            raise ProxyError(400, "'name' must be 1-64 characters of letters, digits and "
                                  "'._:-', starting with a letter or digit", param="name")
        inst = await self.add(url, name)
        return web.json_response({"added": inst.describe(), **self.describe()}, status=201)

    async def item(self, request):
        """``DELETE /admin/decoders/{name}``: drain, then remove."""
        from aiohttp import web

        if request.method != "DELETE":
            return method_not_allowed("DELETE")
        self.token.authorize(request)
        name = request.match_info["name"]
        wait = request.query.get("wait", "false").lower()
        if wait not in ("true", "false", "1", "0"):
            raise ProxyError(400, "'wait' must be true or false", param="wait")
        task = await self.start_removal(name)
        if wait in ("true", "1"):
            failed = await asyncio.shield(task)  # a client that leaves: the drain goes on
            if failed is True or self._find(name) is not None:  # _drain logged why
                raise ProxyError(500, f"removing {name} failed; it stays draining (no new "
                                      f"requests); see the router's log",
                                 code="remove_failed")
            return web.json_response({"removed": name, **self.describe()})
        inst = self._find(name)
        return web.json_response({"draining": name,
                                  "in_flight": 0 if inst is None else inst.in_flight,
                                  **self.describe()}, status=202)

    def describe(self) -> dict:
        pool = self.pool
        return {"policy": self.live.state.policy.name,
                "decoders": [{**i.describe(), "load": float(pool.tracker.loads[i.index])}
                             for i in pool.decode]}

    # -- operations ------------------------------------------------------------------------
    def _find(self, name: str) -> Instance | None:
        return next((i for i in self.pool.decode if i.name == name), None)

    def drains(self) -> list[asyncio.Task]:
        """The drains running now (a journal reload waits for them)."""
        return list(self._drains.values())

    async def add(self, url: str, name: str | None = None):
        """Add a decoder (checked once for health first); returns its ``Instance``.
        ``ProxyError`` 409 for a URL or name already in the pool."""
        pool = self.pool
        if self.link is not None:  # --workers: the parent checks and orders it
            like = self._largest_cluster()
            return await self.link.add(url, name, None if like is None else
                                       pool.decode[like].name)
        async with self.lock:
            if any(i.url == url for i in pool.decode):
                raise ProxyError(409, f"a decoder with URL {url} is already in the pool",
                                 code="decoder_exists", param="url")
            names = {i.name for i in pool.decode}
            if name is None:
                name = next(f"decode-{n}" for n in range(len(names) + 1)
                            if f"decode-{n}" not in names)
            elif name in names:
                raise ProxyError(409, f"a decoder named {name!r} is already in the pool",
                                 code="decoder_exists", param="name")
            like = self._largest_cluster()
            inst = self._add_now(url, name, like)
            healthy = pool.session is not None and await pool.check(inst)
        self._log_added(inst, like, healthy)
        return inst

    async def apply_add(self, url: str, name: str, like: str | None, slot: int):
        """A journal entry (``--workers``): add ``name`` at shared load slot ``slot``,
        sharing the cluster of the decoder named ``like``."""
        async with self.lock:
            k = self._index_of(like)
            inst = self._add_now(url, name, k, slot)
            healthy = self.pool.session is not None and await self.pool.check(inst)
        self._log_added(inst, k, healthy)
        return inst

    def replay_add(self, url: str, name: str, like: str | None, slot: int) -> None:
        """A journal entry replayed before a restarted worker serves (no health check:
        the first round of checks does it)."""
        self._add_now(url, name, self._index_of(like), slot)

    def replay_drain(self, name: str) -> None:
        """A drain replayed before a restarted worker serves: nothing runs there yet, so
        the decoder is removed at once."""
        inst = self._find(name)
        if inst is not None:
            self._remove_now(inst)

    def _add_now(self, url: str, name: str, like: int | None,
                 slot: int | None = None) -> Instance:
        pool = self.pool
        if any(i.url == url or i.name == name for i in pool.decode):  # nothing changes
            raise ValueError(f"decoder {name} ({url}) is already in the pool")
        state = self.live.state
        state.policy.add_worker(like=like)  # first: if it refuses, nothing else changed
        if slot is not None:
            pool.tracker.reserve(slot)  # the shared load table's column for it
        inst = pool.add_decoder(url, name)  # out of rotation until the check passes
        self._rename(state, (*state.worker_names, name))
        self.metrics.prime_instances(pool, (inst,))
        self.metrics.pool_changes.inc(action="added")
        return inst

    def _log_added(self, inst: Instance, like: int | None, healthy: bool) -> None:
        state = self.live.state
        log.info("decoder %s (%s) added at index %d%s%s", inst.name, inst.url, inst.index,
                 "" if like is None or "signature" not in state.policy.inputs else
                 f", sharing the cluster of {state.worker_names[like]} until a refit",
                 "" if healthy else f"; not healthy yet ({inst.last_error}), it takes "
                                    f"requests once a health check passes")
        self._on_change(state.worker_names)

    def _index_of(self, name: str | None) -> int | None:
        inst = None if name is None else self._find(name)
        return None if inst is None or inst.draining else inst.index

    async def start_removal(self, name: str):
        """Start removing ``name`` (:meth:`remove`; with ``--workers`` in every worker,
        once the parent accepted it). Returns what ends once it is out of every pool."""
        if self.link is None:
            return self.remove(name)
        seq = await self.link.drain(name)  # the parent knows the pool: 404, 409 from there
        return asyncio.ensure_future(self.link.freed(seq))

    def remove(self, name: str) -> asyncio.Task:
        """Start draining decoder ``name`` (or return the drain already running); the task
        ends once it is out of the pool."""
        running = self._drains.get(name)
        if running is not None:
            return running
        inst = self._find(name)
        if inst is None:
            known = [i.name for i in self.pool.decode]
            raise ProxyError(404, f"no decoder named {name!r}; the decoders are {known}",
                             code="decoder_not_found")
        if not any(not i.draining for i in self.pool.decode if i is not inst):
            raise ProxyError(409, f"{name} is the last decoder taking requests; add another "
                                  f"before removing it", code="last_decoder")
        return self._start_drain(inst)

    def apply_drain(self, name: str) -> asyncio.Task | None:
        """A journal entry (``--workers``): drain ``name`` here (None: not in this pool)."""
        inst = self._find(name)
        if inst is None:
            return None
        return self._drains.get(name) or self._start_drain(inst)

    def _start_drain(self, inst: Instance) -> asyncio.Task:
        name = inst.name
        inst.draining = True
        self.metrics.pool_changes.inc(action="draining")
        log.info("decoder %s (%s) draining: no new requests, %d in flight", name, inst.url,
                 inst.in_flight)
        task = asyncio.ensure_future(self._drain(inst))
        self._drains[name] = task
        task.add_done_callback(lambda _: self._drains.pop(name, None))
        return task

    async def _drain(self, inst: Instance) -> None:
        try:
            await self._drain_and_remove(inst)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of ours: logged; the decoder stays draining (no traffic)
            log.exception("removing decoder %s failed; it stays draining", inst.name)
            if self.link is not None:  # ?wait=true answers 500 in whichever worker
                self.link.send({"op": "remove_failed", "name": inst.name})

    async def _drain_and_remove(self, inst: Instance) -> None:
        while inst.in_flight > 0:
            await asyncio.sleep(_DRAIN_POLL)
        async with self.lock:
            self._remove_now(inst)
        log.info("decoder %s (%s) drained and removed; %d decoders left", inst.name, inst.url,
                 len(self.pool.decode))
        if self.link is not None:
            self.link.removed(inst.name)
        self._on_change(self.live.state.worker_names)

    def _remove_now(self, inst: Instance) -> None:
        state = self.live.state
        k = inst.index
        state.policy.remove_worker(k)  # first: if it refuses, nothing else changed
        self.pool.remove_decoder(inst)
        self._rename(state, state.worker_names[:k] + state.worker_names[k + 1:])
        self.metrics.pool_changes.inc(action="removed")

    async def sync_file(self) -> dict:
        """Re-read ``config.decoders_file`` and make the pool match it: its new URLs are
        added, decoders whose URL it no longer lists drain. Returns
        ``{"added": [names], "draining": [names]}``; raises ``ValueError``/``OSError`` for a
        bad file (nothing changes)."""
        path = self.live.config.decoders_file
        specs = await asyncio.to_thread(read_decoders_file, path)
        listed = {u for _, u in specs}
        added, draining = [], []
        for name, url in specs:
            inst = next((i for i in self.pool.decode if i.url == url), None)
            if inst is not None:
                if inst.draining:
                    log.warning("decoders file: %s (%s) is still draining; it is not taken "
                                "back (list it again once it is removed)", inst.name, url)
                continue
            try:
                added.append((await self.add(url, name)).name)
            except ProxyError as exc:  # e.g. an id already naming another decoder
                log.error("decoders file: %s not added: %s", url, exc.message)
        for inst in list(self.pool.decode):
            if inst.url not in listed and not inst.draining:
                try:
                    await self.start_removal(inst.name)
                    draining.append(inst.name)
                except ProxyError as exc:
                    log.error("decoders file: %s not removed: %s", inst.name, exc.message)
        log.info("decoders file %s applied: added %s, draining %s", path, added, draining)
        return {"added": added, "draining": draining}

    async def stop(self) -> None:
        """Cancel drains still waiting (the router stops)."""
        for task in list(self._drains.values()):
            task.cancel()
        await asyncio.gather(*self._drains.values(), return_exceptions=True)

    # -- helpers ---------------------------------------------------------------------------
    def _largest_cluster(self) -> int | None:
        """The index of the decoder with the most routing decisions so far (None before any
        decision): the cluster a new decoder splits, for the policies that have clusters."""
        policy = self.live.state.policy
        if "signature" not in policy.inputs and getattr(policy, "footprint", None) is None:
            return None
        taken = self.metrics.decisions.values
        counts = [(taken.get((policy.name, i.name), 0.0), -i.index, i.index)
                  for i in self.pool.decode if not i.draining]
        best = max(counts, default=None)
        return None if best is None or best[0] == 0 else best[2]

    def _rename(self, state: RoutingState, names: tuple[str, ...]) -> None:
        """The router's snapshot and config for the pool as it is now (``names``)."""
        self._swap(dataclasses.replace(state, worker_names=names), dataclasses.replace(
            self.live.config, decode_urls=tuple(i.url for i in self.pool.decode),
            decode_ids=names))


async def _json_body(request) -> dict:
    import json

    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        raise ProxyError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object, e.g. "
                              "{\"url\": \"http://HOST:PORT\"}", code="invalid_request")
    return body
