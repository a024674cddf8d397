"""The router's Prometheus metrics, on ``prometheus_client`` with one registry per router.

A thin layer over the client library keeps the call sites short (``hits.inc(policy="eldr")``
instead of ``hits.labels(policy="eldr").inc()``) and adds what the router needs::

    reg = Registry()                      # its own CollectorRegistry: routers never collide
    hits = reg.counter("eldr_x_total", "What it counts.", ("policy",))
    hits.prime(("eldr",), ("jsq",))       # zero-valued series, printed before any event
    hits.inc(policy="eldr")
    lat = reg.histogram("eldr_latency_seconds", "Routing latency.", buckets=(1e-4, 1e-3))
    lat.observe(2e-4)
    reg.render()  # -> str, Prometheus text format 0.0.4, served at GET /metrics

A gauge may also be computed at scrape time (``reg.gauge(..., collect=fn)`` where ``fn()``
returns ``{label_values_tuple: value}``), so live values such as in-flight counts are read
where they are kept instead of being mirrored. The ``*_created`` series the client library
adds to counters and histograms are left out of the page (the names on it are the public
contract, docs/serve.md). :func:`parse_samples` reads an engine's own ``/metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import prometheus_client
from prometheus_client.core import GaugeMetricFamily

__all__ = ["FOOTPRINT_RESULTS", "Counter", "Gauge", "Histogram", "Registry", "RouterMetrics",
           "parse_samples"]

LabelValues = tuple[str, ...]

DEFAULT_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class _Family:
    """One metric family with labelled children looked up once per label set."""

    def __init__(self, metric, name: str, labelnames: Sequence[str]) -> None:
        self.metric = metric  # the prometheus_client object
        self.name = name
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple, object] = {}  # kwargs items -> child: no lock per call

    def _child(self, labels: dict[str, str]):
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            if not labels and not self.labelnames:
                child = self.metric
            elif set(labels) != set(self.labelnames):
                raise ValueError(f"{self.name}: labels {sorted(labels)} given, "
                                 f"expected {list(self.labelnames)}")
            else:
                child = self.metric.labels(**{k: str(v) for k, v in labels.items()})
            self._children[key] = child
        return child

    def prime(self, *label_values: Sequence[str]) -> None:
        """Create these label sets at zero, so their series show before any event."""
        for values in label_values:
            self._child(dict(zip(self.labelnames, map(str, values), strict=True)))

    def _sample(self, suffix: str, labels: dict[str, str]) -> float:
        """The value of sample ``name + suffix`` with ``labels`` (0 when never created)."""
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} given, "
                             f"expected {list(self.labelnames)}")
        want = {k: str(v) for k, v in labels.items()}
        for fam in self.metric.collect():
            for s in fam.samples:
                if s.name.endswith(suffix) and s.labels == want:
                    return s.value
        return 0.0


class Counter(_Family):
    """A monotonically increasing count per label set (its name ends in ``_total``)."""

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        self._child(labels).inc(amount)

    def get(self, **labels: str) -> float:
        return self._sample("_total", labels)

    @property
    def values(self) -> dict[LabelValues, float]:
        """Label values -> count, for the label sets that counted something (primed zeros
        left out)."""
        return {tuple(s.labels[n] for n in self.labelnames): s.value
                for fam in self.metric.collect() for s in fam.samples
                if s.name.endswith("_total") and s.value}


class Gauge(_Family):
    """A value per label set that goes up and down, set directly."""

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(float(value))

    def get(self, **labels: str) -> float:
        return self._sample(self.name, labels)


class _CollectedGauge:
    """A gauge family whose label sets and values come from ``collect()`` at scrape time."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str],
                 collect: Callable[[], dict[LabelValues, float]]) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._collect = collect

    def describe(self) -> list[GaugeMetricFamily]:  # names for the registry, no values read
        return [GaugeMetricFamily(self.name, self.help, labels=self.labelnames)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(self.name, self.help, labels=self.labelnames)
        for key, value in sorted(self._collect().items()):
            fam.add_metric([str(k) for k in key], float(value))
        yield fam

    def get(self, **labels: str) -> float:
        key = tuple(str(labels[n]) for n in self.labelnames)
        return float(self._collect().get(key, 0.0))


class Histogram(_Family):
    """Cumulative buckets, sum and count per label set (upper bounds inclusive)."""

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def count(self, **labels: str) -> int:
        return int(self._sample("_count", labels))


class _WithoutCreated:
    """The registry's families minus their ``*_created`` samples (a view for rendering)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self._registry = registry

    def collect(self):
        for fam in self._registry.collect():
            if fam.type in ("counter", "histogram"):
                fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
            yield fam


class Registry:
    """The metric families of one router, rendered in registration order.

    Each instance owns a ``prometheus_client.CollectorRegistry`` (never the library's global
    one), so several routers in one process (tests) keep separate counts.
    """

    def __init__(self) -> None:
        self.collector_registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self._view = _WithoutCreated(self.collector_registry)
        self.names: list[str] = []  # family names, in registration order

    def _named(self, name: str):
        self.names.append(name)
        return name

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: counter names end in '_total'")
        metric = prometheus_client.Counter(self._named(name), help_text, labelnames,
                                           registry=self.collector_registry)
        return Counter(metric, name, labelnames)

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = (),
              collect: Callable[[], dict[LabelValues, float]] | None = None):
        if collect is not None:
            family = _CollectedGauge(self._named(name), help_text, labelnames, collect)
            self.collector_registry.register(family)
            return family
        metric = prometheus_client.Gauge(self._named(name), help_text, labelnames,
                                         registry=self.collector_registry)
        return Gauge(metric, name, labelnames)

    def histogram(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> Histogram:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(set(bounds)) or not all(map(math.isfinite, bounds)):
            raise ValueError(f"{name}: buckets must be finite, strictly increasing and "
                             f"non-empty, got {list(buckets)}")
        metric = prometheus_client.Histogram(self._named(name), help_text, labelnames,
                                             buckets=bounds, registry=self.collector_registry)
        return Histogram(metric, name, labelnames)

    def render(self) -> str:
        return prometheus_client.generate_latest(self._view).decode()


def parse_samples(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of every sample of each metric in ``names`` from a Prometheus text page.

    Used to read an engine's own load (``vllm:num_requests_running``...). Label sets are
    summed (an engine may report one series per model or engine index); a metric absent
    from the page is absent from the result; unparsable values are skipped. Hand-written
    rather than ``prometheus_client.parser``: it looks only at the lines it needs, which
    is much cheaper on a full vLLM page (``benchmarks/bench_metrics.py``).
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

# Label values known at start-up, primed at zero so dashboards show a series from the first
# scrape (a counter with no sample reads "no data", not 0). Values outside these lists
# still count; they appear with their first event.
ENDPOINTS = ("completions", "chat")  # eldr.proxy.app's generation routes
SIGNATURE_SOURCES = ("payload", "routed_experts", "none")  # eldr.proxy.request.signatures
# eldr.proxy.request.signatures' problems, and "unbound" from the flow
FALLBACK_REASONS = ("missing", "malformed", "mismatch", "unencodable", "unknown_shape",
                    "no_encoder", "unbound", "short_prompt", "decode_first")
# what routed a decision: the prefill's expert counts, the prompt's prediction, or neither
ROUTE_INPUT_SOURCES = ("prefill", "prompt", "none")
# eldr.proxy.request.prompts.PREDICTION_RESULTS (repeated: this module imports no request code)
PREDICTION_RESULTS = ("ok", "no_predictor", "no_tokenizer", "no_chat_template",
                      "untokenizable", "invalid", "busy", "timeout", "failed")
ABANDON_REASONS = ("no_decoder", "decoder_4xx", "decode_failed")  # eldr.proxy.request.flow
KV_RELEASE_RESULTS = ("ok", "refused", "failed")
RELOAD_RESULTS = ("ok", "error")
# distinct experts per layer per decode step: from top-k (>= 1) to a model's experts (<= 512)
DISTINCT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 512)
POOL_ACTIONS = ("added", "draining", "removed")  # eldr.proxy.control.elastic
UPSTREAM_ERROR_KINDS = ("timeout", "connect", "disconnect", "protocol", "http_5xx",
                        "too_large", "other")  # eldr.proxy.engines.upstream.error_kind and the flow
# outcomes of reading an engine's footprint (eldr.proxy.engines.footprints)
FOOTPRINT_RESULTS = ("read", "missing", "invalid", "stale", "refused")
# why the fast front handed a connection to aiohttp (eldr.proxy.front, which says what each is)
FRONT_HANDOFF_REASONS = ("route", "head_in_pieces", "malformed", "limits", "body", "framing")


class RouterMetrics:
    """The router's metric families (names are the public contract; docs/serve.md).

    ``pool`` is the :class:`~eldr.proxy.engines.upstream.UpstreamPool`: its instances name the
    per-engine label sets, and its ``config.policy`` the decisions primed at zero.
    """

    def __init__(self, pool) -> None:
        reg = self.registry = Registry()
        # registered in this order, and so rendered: the page's order is part of the contract
        self._register_routing(reg)
        self._register_failures(reg)
        self._register_engines(reg, pool)
        self._register_decode(reg, pool)
        self._prime(pool)

    def _register_routing(self, reg: Registry) -> None:
        """Requests, routing decisions and what they were made from."""
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
        self.route_inputs = reg.counter(
            "eldr_route_inputs_total",
            "Routing decisions by what their policy's inputs came from: the prefill's "
            "expert counts, the prompt's prediction, or none (routed by load).",
            ("source",))
        self.predictions = reg.counter(
            "eldr_prompt_predictions_total",
            "Predictions of a request's routing inputs from its prompt, by result (ok, or "
            "why none: the request is then routed by load).", ("result",))
        self.prompt_queue = reg.histogram(
            "eldr_prompt_queue_seconds",
            "Prompt prediction jobs: seconds from submitted to started on a prompt thread.",
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0))
        self.prompt_work = reg.histogram(
            "eldr_prompt_work_seconds",
            "Prompt prediction jobs: seconds of tokenization (in a tokenizer process or on "
            "the thread) and prediction, off the event loop.",
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0))
        self.prompt_jobs = reg.gauge(
            "eldr_prompt_jobs", "Prompt prediction jobs in flight (running or queued).")
        self.band = reg.histogram(
            "eldr_routing_band_size", "Decoders inside the locality band (eldr policies).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
        self.latency = reg.histogram(
            "eldr_routing_latency_seconds",
            "Signature decode + encode + policy decision, per request.")

    def _register_failures(self, reg: Registry) -> None:
        """Retries, abandoned prefills, containment, errors, clients, reloads, pool changes."""
        self.retries = reg.counter(
            "eldr_retries_total", "Fresh prefill + another decoder after a decode failure.")
        self.abandoned = reg.counter(
            "eldr_prefills_abandoned_total",
            "Prefills whose decode did not complete (their KV may stay held on the prefill "
            "instance until its connector's timeout), by reason.", ("reason",))
        self.short_prompts = reg.counter(
            "eldr_short_prompts_total",
            "Requests served whole by a decoder, without a prefill, because their prompt "
            "has fewer tokens than --short-prompt-tokens.")
        self.engine_deaths = reg.counter(
            "eldr_engine_deaths_total",
            "Engines found dead (a health probe failed) right after a request failed there, "
            "by role and instance.", ("role", "instance"))
        self.poison = reg.counter(
            "eldr_poison_requests_total",
            "Requests during which two engines died (detected: answered 502, their body "
            "put on the poison list) and resends of such a body (refused: 422).",
            ("event",))
        self.retries_refused = reg.counter(
            "eldr_retries_refused_total",
            "Retries the retry budget refused (the request failed instead: 502).")
        self.kv_releases = reg.counter(
            "eldr_kv_releases_total",
            "One-token decodes sent to read (and so free) the KV of a prefill whose decoder "
            "refused the request, by result.", ("result",))
        self.upstream_errors = reg.counter(
            "eldr_upstream_errors_total", "Failures talking to engines, by role and kind.",
            ("role", "instance", "kind"))
        self.client_disconnects = reg.counter(
            "eldr_client_disconnects_total", "Clients that left before their answer ended.")
        self.front_requests = reg.counter(
            "eldr_http_front_requests_total",
            "Generate requests the fast front answered itself (eldr.proxy.front).")
        self.front_handoffs = reg.counter(
            "eldr_http_front_handoffs_total",
            "Client connections the fast front handed to the aiohttp server, by why.",
            ("reason",))
        self.slow_clients = reg.counter(
            "eldr_slow_clients_total",
            "Clients dropped for leaving an answer unread past the write timeout (their "
            "decode aborted).")
        self.reloads = reg.counter(
            "eldr_artifact_reloads_total", "Routing artifact reloads by result.", ("result",))
        self.pool_changes = reg.counter(
            "eldr_decoder_pool_changes_total",
            "Decoders added, put to drain, and removed at run time (POST/DELETE "
            "/admin/decoders).", ("action",))

    def _register_engines(self, reg: Registry, pool) -> None:
        """Per-engine gauges, read from the pool's instances at scrape time."""
        reg.gauge("eldr_decoder_draining", "1 while the decoder drains (no new request; "
                  "removed when its in-flight requests end), else 0.", ("decoder",),
                  collect=lambda: {(i.name,): float(i.draining) for i in pool.decode})
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

    def _register_decode(self, reg: Registry, pool) -> None:
        """What the decode engines measure: their decode payloads and footprints."""
        self.decode_payloads = reg.counter(
            "eldr_decode_payloads_total", "Decode answers by what their engine's decode "
            "payload was (read, invalid: stripped and ignored).", ("result",))
        self.decode_distinct = reg.histogram(
            "eldr_decoder_distinct_experts", "Measured by the decode engine, per completed "
            "request: mean distinct experts per MoE layer per decode step of the batches it "
            "decoded in.", ("decoder",), buckets=DISTINCT_BUCKETS)
        self.engine_footprints = reg.counter(
            "eldr_engine_footprints_total", "Decode engines' expert footprints scraped for "
            "the policy, by result (read; missing, invalid, stale, refused: ignored).",
            ("result",))
        reader = getattr(pool, "footprints", None)  # eldr.proxy.engines.footprints.FootprintReader
        if reader is not None:
            reader.on_result = lambda result: self.engine_footprints.inc(result=result)
        reg.gauge("eldr_decoder_engine_distinct_experts", "A decode engine's own live "
                  "footprint (scraped): mean distinct experts per MoE layer per decode step "
                  "over its last steps.", ("decoder",),
                  collect=lambda: {(i.name,): float(i.engine_distinct) for i in pool.decode
                                   if i.engine_distinct is not None})

    def _prime(self, pool) -> None:
        """Zero-valued series for every label set known at start-up."""
        self.requests.prime(*((e, "200") for e in ENDPOINTS))
        self.signatures.prime(*((s,) for s in SIGNATURE_SOURCES))
        self.fallbacks.prime(*((r,) for r in FALLBACK_REASONS))
        self.route_inputs.prime(*((r,) for r in ROUTE_INPUT_SOURCES))
        self.predictions.prime(*((r,) for r in PREDICTION_RESULTS))
        self.abandoned.prime(*((r,) for r in ABANDON_REASONS))
        self.kv_releases.prime(*((r,) for r in KV_RELEASE_RESULTS))
        self.poison.prime(("detected",), ("refused",))
        self.reloads.prime(*((r,) for r in RELOAD_RESULTS))
        self.decode_payloads.prime(("read",), ("invalid",))
        self.engine_footprints.prime(*((r,) for r in FOOTPRINT_RESULTS))
        self.pool_changes.prime(*((a,) for a in POOL_ACTIONS))
        self.front_requests.prime(())
        self.front_handoffs.prime(*((r,) for r in FRONT_HANDOFF_REASONS))
        self.prime_instances(pool, (*pool.prefill, *pool.decode))

    def prime_instances(self, pool, instances) -> None:
        """Zero-valued per-engine series (at start-up, and for a decoder added later)."""
        policy = getattr(getattr(pool, "config", None), "policy", None)
        if policy is not None:
            self.decisions.prime(*((policy, i.name) for i in instances if i.role == "decode"))
        self.decode_distinct.prime(*((i.name,) for i in instances if i.role == "decode"))
        self.upstream_errors.prime(*((i.role, i.name, k) for i in instances
                                     for k in UPSTREAM_ERROR_KINDS))
        self.engine_deaths.prime(*((i.role, i.name) for i in instances))

