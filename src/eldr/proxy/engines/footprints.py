"""The decode engines' own footprints, read for the routing policy (docs/serve.md).

With ``--scrape-interval S`` > 0 and ``--engine-footprint auto`` (the default), each
scrape round also calls every healthy decoder's ``GET /eldr/footprint`` (the eldr vLLM
plugin's route, docs/capture.md) when the routing policy takes engine footprints
(``policy.engine_footprint_shape``: ``eldr_cost`` once it knows the model's (L, E)). A
valid reading, per (layer, expert) the share of the engine's last decode steps whose batch
selected it, goes to ``policy.observe_engine``, valid for ``max(3·S, 1)`` seconds after
the engine took it. Every other outcome is counted, logged at debug level and otherwise
ignored (never an error, never a change of health): ``missing`` (no such route: an engine
without the plugin, or no decode step yet; unreachable), ``invalid`` (malformed, wrong
shape), ``stale`` (older than the bound: an idle engine), ``refused`` (the policy said no).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from eldr.capture.decode import decode_engine_footprint
from eldr.proxy.bodies import read_upto
from eldr.proxy.metrics import FOOTPRINT_RESULTS

__all__ = ["FOOTPRINT_PATH", "FootprintReader"]

log = logging.getLogger("eldr.serve")

FOOTPRINT_PATH = "/eldr/footprint"
_BODY_LIMIT = 1024 * 1024  # 48 x 128 cells take ~6 KiB; 3 digits for 4096 x 128 ~1.5 MiB


class FootprintReader:
    """Reads decoders' engine footprints into the current policy; counts the outcomes."""

    def __init__(self, scrape_interval: float, mode: str = "auto") -> None:
        self.enabled = mode == "auto" and scrape_interval > 0
        self.max_age = max(3.0 * scrape_interval, 1.0)  # seconds a reading stays in force
        # the current routing policy (set by the router: reloads replace it)
        self.policy_of: Callable[[], object] | None = None
        self.counts = dict.fromkeys(FOOTPRINT_RESULTS, 0)
        self.on_result: Callable[[str], None] | None = None  # metrics hook

    def target(self):
        """(policy, (L, E)) when a reading would be used now, else None."""
        if not self.enabled or self.policy_of is None:
            return None
        policy = self.policy_of()
        shape = getattr(policy, "engine_footprint_shape", None)
        return None if shape is None else (policy, tuple(shape))

    def _count(self, result: str) -> str:
        self.counts[result] += 1
        if self.on_result is not None:
            self.on_result(result)
        return result

    async def read(self, session, inst, *, timeout, headers: dict) -> str | None:
        """One decoder's reading into the policy; returns the outcome (None: not wanted)."""
        target = self.target()
        if target is None:
            return None
        try:
            async with session.get(f"{inst.url}{FOOTPRINT_PATH}", timeout=timeout,
                                   headers=headers) as resp:
                raw, whole = await read_upto(resp, _BODY_LIMIT)
                status = resp.status
        except Exception as exc:  # health checks decide about health
            log.debug("engine footprint of %s not read: %s", inst.url, exc)
            return self._count("missing")
        if status != 200:
            return self._count("missing")
        policy, (L, E) = target
        try:
            if not whole:
                raise ValueError(f"larger than {_BODY_LIMIT} bytes")
            fp = decode_engine_footprint(json.loads(raw), L, E, now=time.time())
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError included
            log.debug("engine footprint of %s ignored: %s", inst.url, exc)
            return self._count("invalid")
        if fp.age >= self.max_age:
            return self._count("stale")
        if inst.removed or self.policy_of() is not policy:
            return None  # the pool or the policy changed while reading: nothing to update
        if not policy.observe_engine(inst.index, fp.freq, fp.age, self.max_age):
            return self._count("refused")
        return self._count("read")
