"""Prometheus text exposition (format 0.0.4), written by hand: no client library needed.

Three metric kinds, each a family of label sets::

    reg = Registry()
    hits = reg.counter("eldr_x_total", "What it counts.", ("policy",))
    hits.inc(policy="eldr")
    lat = reg.histogram("eldr_latency_seconds", "Routing latency.", buckets=(1e-4, 1e-3))
    lat.observe(2e-4)
    reg.render()  # -> str, served at GET /metrics

A gauge may also be computed at scrape time (``reg.gauge(..., collect=fn)`` where ``fn()``
returns ``{label_values_tuple: value}``), so live values such as in-flight counts are read
where they are kept instead of being mirrored. Everything runs on the event loop thread:
no locks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

__all__ = ["Counter", "Gauge", "Histogram", "Registry", "parse_samples"]

LabelValues = tuple[str, ...]

DEFAULT_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Family:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        try:
            if len(labels) == len(self.labelnames):
                return tuple([str(labels[n]) for n in self.labelnames])
        except KeyError:
            pass
        raise ValueError(f"{self.name}: labels {sorted(labels)} given, "
                         f"expected {list(self.labelnames)}")

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> Iterable[str]:
        raise NotImplementedError


class Counter(_Family):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def lines(self) -> Iterable[str]:
        for key, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_fmt(v)}"


class Gauge(_Family):
    """A value per label set that goes up and down, set directly or collected on scrape."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                 collect: Callable[[], dict[LabelValues, float]] | None = None) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}
        self._collect = collect

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)

    def get(self, **labels: str) -> float:
        key = self._key(labels)
        values = self._collect() if self._collect else self.values
        return values.get(key, 0.0)

    def lines(self) -> Iterable[str]:
        values = self._collect() if self._collect else self.values
        for key, v in sorted(values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_fmt(v)}"


class Histogram(_Family):
    """Cumulative buckets, sum and count per label set (upper bounds inclusive)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> None:
        super().__init__(name, help_text, labelnames)
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(set(bounds)) or not all(math.isfinite(b)
                                                                  for b in bounds):
            raise ValueError(f"{name}: buckets must be finite, strictly increasing and "
                             f"non-empty, got {list(buckets)}")
        self.bounds = tuple(bounds)
        self.series: dict[LabelValues, list[float]] = {}  # key -> [count per bucket.., +Inf, sum]

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        row = self.series.get(key)
        if row is None:
            row = self.series[key] = [0.0] * (len(self.bounds) + 2)
        i = 0
        for i, b in enumerate(self.bounds):  # noqa: B007 - i is used after the loop
            if value <= b:
                break
        else:
            i = len(self.bounds)
        row[i] += 1
        row[-1] += value

    def count(self, **labels: str) -> int:
        row = self.series.get(self._key(labels))
        return 0 if row is None else int(sum(row[:-1]))

    def lines(self) -> Iterable[str]:
        for key, row in sorted(self.series.items()):
            cum = 0.0
            for b, n in zip((*self.bounds, math.inf), row[:-1], strict=True):
                cum += n
                le = f'le="{_fmt(b)}"'
                yield f"{self.name}_bucket{_labels(self.labelnames, key, le)} {_fmt(cum)}"
            yield f"{self.name}_sum{_labels(self.labelnames, key)} {_fmt(row[-1])}"
            yield f"{self.name}_count{_labels(self.labelnames, key)} {_fmt(cum)}"


class Registry:
    """The metric families of one process, rendered in registration order."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def _add(self, family: _Family) -> _Family:
        if family.name in self._families:
            raise ValueError(f"metric {family.name!r} is already registered")
        self._families[family.name] = family
        return family

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, labelnames))  # type: ignore[return-value]

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = (),
              collect: Callable[[], dict[LabelValues, float]] | None = None) -> Gauge:
        return self._add(Gauge(name, help_text, labelnames, collect))  # type: ignore[return-value]

    def histogram(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help_text, labelnames, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        out: list[str] = []
        for fam in self._families.values():
            out += fam.header()
            out += fam.lines()
        return "\n".join(out) + "\n"


def parse_samples(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of every sample of each metric in ``names`` from a Prometheus text page.

    Used to read an engine's own load (``vllm:num_requests_running``...). Label sets are
    summed (an engine may report one series per model or engine index); a metric absent
    from the page is absent from the result; unparsable values are skipped.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 > space) else space
        if end <= 0:
            continue
        name = line[:end]
        if name not in wanted:
            continue
        tail = line[line.rfind("}") + 1:] if brace >= 0 else line[end:]
        fields = tail.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out


_BREAKER_VALUE = {"closed": 0.0, "half_open": 0.5, "open": 1.0}


class RouterMetrics:
    """The router's metric families (names are the public contract; docs/serve.md)."""

    def __init__(self, pool) -> None:
        reg = self.registry = Registry()
        self.requests = reg.counter(
            "eldr_requests_total", "Client requests by endpoint and HTTP status.",
            ("endpoint", "status"))
        self.decisions = reg.counter(
            "eldr_routing_decisions_total", "Decode routing decisions by policy and decoder.",
            ("policy", "decoder"))
        self.signatures = reg.counter(
            "eldr_signatures_total", "Prefill responses by where the signature came from.",
            ("source",))
        self.partial = reg.counter(
            "eldr_partial_signatures_total",
            "Signatures counted over fewer tokens than the prompt (prefix-cache or KV "
            "connector hits on the prefill instance).")
        self.fallbacks = reg.counter(
            "eldr_routing_fallbacks_total",
            "Requests routed by load only because their signature was missing or unusable.",
            ("reason",))
        self.band = reg.histogram(
            "eldr_routing_band_size", "Decoders inside the locality band (eldr policies).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
        self.latency = reg.histogram(
            "eldr_routing_latency_seconds",
            "Signature decode + encode + policy decision, per request.")
        self.retries = reg.counter(
            "eldr_retries_total", "Fresh prefill + another decoder after a decode failure.")
        self.abandoned = reg.counter(
            "eldr_prefills_abandoned_total",
            "Prefills whose decode did not complete (their KV may stay held on the prefill "
            "instance until its connector's timeout), by reason.", ("reason",))
        self.kv_releases = reg.counter(
            "eldr_kv_releases_total",
            "One-token decodes sent to read (and so free) the KV of a prefill whose decoder "
            "refused the request, by result.", ("result",))
        self.upstream_errors = reg.counter(
            "eldr_upstream_errors_total", "Failures talking to engines, by role and kind.",
            ("role", "instance", "kind"))
        self.client_disconnects = reg.counter(
            "eldr_client_disconnects_total", "Clients that left before their answer ended.")
        self.slow_clients = reg.counter(
            "eldr_slow_clients_total",
            "Clients dropped for leaving an answer unread past the write timeout (their "
            "decode aborted).")
        self.reloads = reg.counter(
            "eldr_artifact_reloads_total", "Routing artifact reloads by result.", ("result",))
        reg.gauge("eldr_decoder_in_flight", "Requests of this router at each decoder.",
                  ("decoder",), collect=lambda: {(i.name,): i.in_flight for i in pool.decode})
        reg.gauge("eldr_decoder_load", "Load the policy sees per decoder (in-flight, or the "
                  "engine's running + waiting when scraped).", ("decoder",),
                  collect=lambda: {(i.name,): float(pool.tracker.loads[i.index])
                                   for i in pool.decode})
        reg.gauge("eldr_decoder_breaker_open", "1 while the decoder's circuit breaker holds "
                  "requests off (open), 0.5 half-open (one probe allowed), 0 closed.",
                  ("decoder",), collect=lambda: {(i.name,): _BREAKER_VALUE[i.breaker.state]
                                                 for i in pool.decode})
        reg.gauge("eldr_decoder_breaker_opens", "Times the decoder's breaker opened.",
                  ("decoder",), collect=lambda: {(i.name,): float(i.breaker.num_opened)
                                                 for i in pool.decode})
        reg.gauge("eldr_prefill_in_flight", "Requests of this router at each prefill instance.",
                  ("instance",), collect=lambda: {(i.name,): i.in_flight for i in pool.prefill})
        reg.gauge("eldr_upstream_healthy", "1 if the instance is taking requests, else 0.",
                  ("role", "instance"),
                  collect=lambda: {(i.role, i.name): float(i.healthy)
                                   for i in (*pool.prefill, *pool.decode)})
