"""The router's settings: one frozen, validated record handed whole to every component."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["DECODER_NAME", "ServeConfig", "check_url", "parse_decode_spec",
           "read_decoders_file"]

# a decoder's name (its artifact worker id): in metric labels, URLs and the decoders file
DECODER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_MAX_FILE_BYTES = 1 << 20  # a decoders file larger than this is refused


def check_url(url: str, what: str) -> str:
    if not isinstance(url, str):
        raise ValueError(f"{what} URL must be a string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} URL {url!r} must look like http://HOST:PORT")
    if parts.query or parts.fragment:
        raise ValueError(f"{what} URL {url!r} must not have a query or fragment")
    return url.rstrip("/")


def parse_decode_spec(spec: str) -> tuple[str | None, str]:
    """``"ID=URL"`` → (ID, URL); a bare ``"URL"`` → (None, URL).

    An id names the artifact's decode worker the URL serves; without ids, decode URLs are
    matched to the artifact's workers in order.
    """
    head, sep, tail = spec.partition("=")
    if sep and "://" not in head:
        if not head:
            raise ValueError(f"decode spec {spec!r}: the worker id before '=' is empty")
        return head, check_url(tail, "decode")
    return None, check_url(spec, "decode")


def read_decoders_file(path: str) -> list[tuple[str | None, str]]:
    """[(id or None, url)] of a decoders file: one ``[ID=]URL`` a line; blank lines and
    ``#`` comments skipped. ``ValueError`` (with the line) for a bad line, a repeated URL
    or id, ids on some lines only, or no decoder at all; ``OSError`` if unreadable."""
    from eldr.fileio import open_regular

    with open_regular(path, max_bytes=_MAX_FILE_BYTES, what="a decoders file") as fh:
        try:
            text = fh.read().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: the decoders file is not UTF-8 text") from None
    specs: list[tuple[str | None, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            spec = parse_decode_spec(line)
        except ValueError as exc:
            raise ValueError(f"{path} line {n}: {exc}") from None
        if spec[0] is not None and not DECODER_NAME.fullmatch(spec[0]):
            raise ValueError(f"{path} line {n}: the id {spec[0]!r} must be 1-64 characters "
                             f"of letters, digits and '._:-'")
        specs.append(spec)
    if not specs:
        raise ValueError(f"{path}: the decoders file lists no decoder")
    for what, values in (("URL", [u for _, u in specs]),
                         ("id", [i for i, _ in specs if i is not None])):
        if len(set(values)) != len(values):
            raise ValueError(f"{path}: a decoder {what} is listed twice")
    if len({i is None for i, _ in specs}) > 1:
        raise ValueError(f"{path}: give ids on every line (ID=URL) or on none")
    return specs


@dataclass(frozen=True)
class ServeConfig:  # repr=False on secrets below: a logged config must not leak them
    """Everything ``eldr serve`` needs; validated on construction, never mutated."""

    prefill_urls: tuple[str, ...]  # base URLs of the prefill instances (no trailing /)
    decode_urls: tuple[str, ...]  # base URLs of the decode instances, index k = worker k
    decode_ids: tuple[str, ...] | None = None  # artifact worker id per decode URL; None: by order
    artifact: str | None = None  # routing artifact directory; required by eldr policies
    policy: str = "eldr_cost"  # a name in eldr.routing.POLICIES (not an evaluation-only one)
    tau: float | None = None  # locality band width; None: the artifact's τ
    load_slack: float | None = None  # eldr_cost's bounded-load slack; None: unbounded
    cost_layer_stride: int = 1  # eldr_cost prices every s-th layer (1: all)
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port (0: any free port)
    # bearer token of /admin/* and /health's details; None: admin endpoints refuse all
    admin_token: str | None = field(default=None, repr=False)
    # bearer key the engines require (vllm --api-key); None: the client's is forwarded
    upstream_api_key: str | None = field(default=None, repr=False)
    models: tuple[str, ...] = ()  # accepted model names; (): learned from upstream /v1/models
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    # the generate routes' server: "fast" (eldr.proxy.front, aiohttp for everything else)
    # or "aiohttp" (aiohttp's hardened server for every request)
    http_front: str = "fast"
    connect_timeout: float = 3.0  # seconds to open a connection to an instance
    prefill_timeout: float = 120.0  # seconds for a whole prefill response
    decode_read_timeout: float = 120.0  # seconds without a byte from a decoder (first included)
    write_timeout: float = 30.0  # seconds a client may leave a write unread before it is dropped
    max_prefill_bytes: int = 64 * 1024 * 1024  # a prefill answer (payload included) above: error
    max_response_bytes: int = 64 * 1024 * 1024  # a buffered (non-streaming) decode answer
    max_buffered_bytes: int = 512 * 1024 * 1024  # all buffered answers at once (they wait)
    health_interval: float = 2.0  # seconds between health checks of each instance
    health_timeout: float = 2.0  # seconds a health check may take
    unhealthy_after: int = 2  # consecutive failed checks that take an instance out
    scrape_interval: float = 0.0  # seconds between engine /metrics scrapes; 0: off
    engine_footprint: str = "auto"  # "auto": the scrape reads engine footprints; "off"
    max_attempts: int = 3  # prefill+decode attempts per request (retries = attempts - 1)
    release_kv: bool = True  # after a decoder's 4xx, read the prefill's KV (1-token decode)
    # a prompt whose token count is surely below this is served whole by a decoder (no
    # prefill, no KV transfer); 0: always disaggregate. None: one KV block, as the engines
    # report it on /metrics (vllm:cache_config_info), else 16 (docs/failures.md)
    short_prompt_tokens: int | None = None
    poison_ttl: float = 300.0  # seconds the body of a request that killed 2 engines is refused
    poison_capacity: int = 4096  # bodies the poison list holds (older ones replaced)
    retry_budget_ratio: float = 0.2  # retries allowed per request over the window ...
    retry_budget_min: float = 5.0  # ... plus this many per second, whatever the traffic
    retry_budget_window: int = 10  # seconds the retry budget counts over
    breaker_failures: int = 3  # consecutive failed requests that open a decoder's breaker
    breaker_backoff: float = 5.0  # seconds it stays open first; doubled per failed probe
    breaker_max_backoff: float = 120.0  # the longest it stays open
    affinity_block_chars: int = 128  # prompt bytes per block of the prefill affinity hash
    affinity_max_blocks: int = 512  # only the first blocks·chars bytes of a prompt count
    affinity_capacity: int = 100_000  # remembered block → prefill entries (LRU)
    affinity_spill: float = 4.0  # the affine prefill is skipped if this much busier than least
    random_state: int | None = 0  # seed of randomised policies (random, p2c)
    # without an artifact, a policy that needs one runs eldr_cost until one is loaded
    # (--learn sets it: the learner's first artifact then switches to ``policy``)
    stand_in: bool = False
    workers: int = 1  # router processes on the port (SO_REUSEPORT), sharing decode loads
    decoders_file: str | None = None  # [ID=]URL per line; SIGHUP syncs the pool to it
    # routing on the prompt (docs/serve.md, "Routing on the prompt"): the tokenizer's folder
    # (None: the artifact's model folder when known) and a chat template file overriding it
    tokenizer: str | None = None
    chat_template: str | None = None
    # prompt work off the event loop (eldr.proxy.request.offload): prediction threads,
    # tokenizer processes (0: the threads tokenize), jobs in flight at most, and the seconds
    # a decision waits for its job; a full queue or a late job: routed by load, counted
    prompt_threads: int = 2
    prompt_processes: int = 1
    prompt_queue: int = 32
    prompt_timeout: float = 0.25
    # choose the decoder before the prefill is sent (from the prompt's prediction, else by
    # load), and name it in the prefill request's kv_transfer_params
    decode_first: bool = False
    # (decoder name, JSON object) pairs: what the prefill's kv_transfer_params get when that
    # decoder was chosen first (a push connector's address of it); decode_first only
    decode_kv_params: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        self._check_engines()
        self._check_routing()
        self._check_server()
        self._check_bounds()
        self._check_prompt_work()

    def _check_engines(self) -> None:
        """URLs well-formed, none twice; decode ids one per decode URL, none twice."""
        object.__setattr__(self, "prefill_urls",
                           tuple(check_url(u, "prefill") for u in self.prefill_urls))
        object.__setattr__(self, "decode_urls",
                           tuple(check_url(u, "decode") for u in self.decode_urls))
        if not self.prefill_urls:
            raise ValueError("at least one --prefill URL is required")
        if not self.decode_urls:
            raise ValueError("at least one --decode URL is required")
        for name, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            if len(set(urls)) != len(urls):
                raise ValueError(f"a {name} URL is listed twice: {list(urls)}")
        if self.decode_ids is not None:
            ids = tuple(self.decode_ids)
            if len(ids) != len(self.decode_urls):
                raise ValueError(f"{len(ids)} decode ids for {len(self.decode_urls)} decode URLs")
            if len(set(ids)) != len(ids):
                raise ValueError(f"a decode worker id is listed twice: {list(ids)}")
            object.__setattr__(self, "decode_ids", ids)

    def _check_routing(self) -> None:
        """A policy the router can run, and its settings."""
        from eldr.routing import POLICIES
        from eldr.routing.cost import check_layer_stride

        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; known: {sorted(POLICIES)}")
        if POLICIES[self.policy].evaluation_only:
            raise ValueError(f"policy {self.policy!r} needs oracle information a live request "
                             f"does not carry; it is for simulation only")
        if self.tau is not None and not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"tau must be finite and >= 0, got {self.tau}")
        if self.load_slack is not None and not (math.isfinite(self.load_slack)
                                                and self.load_slack >= 0):
            raise ValueError(f"load_slack must be finite and >= 0, got {self.load_slack}")
        check_layer_stride(self.cost_layer_stride, "cost_layer_stride")
        self._check_decode_first()

    def _check_decode_first(self) -> None:
        """Decoder kv params: decode-first only, named decoders, JSON objects, once each."""
        pairs = tuple((str(n), str(v)) for n, v in self.decode_kv_params)
        object.__setattr__(self, "decode_kv_params", pairs)
        if pairs and not self.decode_first:
            raise ValueError("decoder kv_transfer_params (--decode-kv-params) need "
                             "--decode-first: only then is the decoder known before the "
                             "prefill")
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"kv_transfer_params are given twice for a decoder: {names}")
        for name, _ in pairs:
            if not DECODER_NAME.fullmatch(name):
                raise ValueError(f"--decode-kv-params: {name!r} is not a decoder name")
        self.decoder_kv_params()  # each parses

    def decoder_kv_params(self) -> dict[str, dict]:
        """{decoder name: the kv_transfer_params its prefill requests get} (decode-first)."""
        # here, not at the top: eldr.capture imports numpy, which a config need not load
        from eldr.capture.payload import LAYERS_KEY, PAYLOAD_KEY

        out = {}
        for name, text in self.decode_kv_params:
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError):
                raise ValueError(f"--decode-kv-params {name}: not valid JSON") from None
            if not isinstance(doc, dict) or not doc:
                raise ValueError(f"--decode-kv-params {name}: must be a non-empty JSON object")
            reserved = sorted(set(doc) & {"do_remote_decode", "do_remote_prefill", PAYLOAD_KEY,
                                          LAYERS_KEY})
            if reserved:
                raise ValueError(f"--decode-kv-params {name}: the router sets {reserved} "
                                 f"itself")
            out[name] = doc
        return out

    def _check_server(self) -> None:
        """Port, secrets, models, processes."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin token must be at least 8 characters")
        if self.upstream_api_key is not None and (
                not self.upstream_api_key or any(c in self.upstream_api_key for c in "\r\n")):
            raise ValueError("the upstream API key must be non-empty, on one line")
        object.__setattr__(self, "models", tuple(self.models))
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) \
                or not 1 <= self.workers <= 256:
            raise ValueError(f"workers must be an integer in [1, 256], got {self.workers!r}")

    def _check_prompt_work(self) -> None:
        for name, lo, hi in (("prompt_threads", 1, 64), ("prompt_processes", 0, 64),
                             ("prompt_queue", 1, 1 << 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        t = self.prompt_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                math.isfinite(t) and 0 < t <= 60):
            raise ValueError(f"prompt_timeout must be a number of seconds in (0, 60], got "
                             f"{t!r}")

    def _check_bounds(self) -> None:
        """Timeouts, sizes, intervals, the breaker, containment, footprints, affinity."""
        positive = ("max_body_bytes", "connect_timeout", "prefill_timeout",
                    "decode_read_timeout", "write_timeout", "max_prefill_bytes",
                    "max_response_bytes", "max_buffered_bytes", "health_interval",
                    "health_timeout",
                    "unhealthy_after", "max_attempts", "breaker_failures", "breaker_backoff",
                    "breaker_max_backoff", "affinity_block_chars", "poison_ttl",
                    "affinity_max_blocks", "affinity_capacity")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.breaker_backoff > self.breaker_max_backoff:
            raise ValueError(f"breaker_backoff ({self.breaker_backoff}) must not exceed "
                             f"breaker_max_backoff ({self.breaker_max_backoff})")
        if self.max_buffered_bytes < self.max_response_bytes:
            raise ValueError(f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least "
                             f"max_response_bytes ({self.max_response_bytes})")
        if self.short_prompt_tokens is not None and (
                isinstance(self.short_prompt_tokens, bool)
                or not isinstance(self.short_prompt_tokens, int)
                or not 0 <= self.short_prompt_tokens <= 1 << 20):
            raise ValueError(f"short_prompt_tokens must be an integer in [0, 1048576] (0: "
                             f"always disaggregate), got {self.short_prompt_tokens!r}")
        if isinstance(self.poison_capacity, bool) or not isinstance(self.poison_capacity, int) \
                or not 1 <= self.poison_capacity <= 1 << 24:
            raise ValueError(f"poison_capacity must be an integer in [1, 16777216], got "
                             f"{self.poison_capacity!r}")
        if isinstance(self.retry_budget_window, bool) or \
                not isinstance(self.retry_budget_window, int) or \
                not 1 <= self.retry_budget_window <= 3600:
            raise ValueError(f"retry_budget_window must be an integer number of seconds in "
                             f"[1, 3600], got {self.retry_budget_window!r}")
        for name in ("retry_budget_ratio", "retry_budget_min"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if self.http_front not in ("fast", "aiohttp"):
            raise ValueError(f"http_front must be 'fast' or 'aiohttp', got {self.http_front!r}")
        if self.engine_footprint not in ("auto", "off"):
            raise ValueError(f"engine_footprint must be 'auto' or 'off', "
                             f"got {self.engine_footprint!r}")
        for name in ("scrape_interval", "affinity_spill"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
