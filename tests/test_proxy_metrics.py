from types import SimpleNamespace

import pytest

from eldr.proxy.metrics import Registry, RouterMetrics, parse_samples


def test_counter_and_gauge_render_exactly():
    reg = Registry()
    c = reg.counter("x_total", "Things.", ("policy",))
    c.inc(policy="eldr")
    c.inc(2, policy="eldr")
    c.inc(policy='a"b')
    reg.gauge("g", "Live.", ("k",), collect=lambda: {("w0",): 1.5})
    assert reg.render() == (  # no x_created series: the page holds the pinned names only
        "# HELP x_total Things.\n# TYPE x_total counter\n"
        'x_total{policy="eldr"} 3.0\nx_total{policy="a\\"b"} 1.0\n'
        "# HELP g Live.\n# TYPE g gauge\n"
        'g{k="w0"} 1.5\n')
    assert c.get(policy="eldr") == 3
    assert c.get(policy="never") == 0
    assert c.values == {("eldr",): 3.0, ('a"b',): 1.0}


def test_histogram_buckets_are_cumulative_and_inclusive():
    reg = Registry()
    h = reg.histogram("lat", "Latency.", buckets=(1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    lines = reg.render().splitlines()[2:]
    assert lines == ['lat_bucket{le="1.0"} 2.0', 'lat_bucket{le="2.0"} 3.0',
                     'lat_bucket{le="+Inf"} 4.0', "lat_count 4.0", "lat_sum 6.0"]
    assert h.count() == 4


def test_primed_label_sets_print_zero_and_stay_out_of_values():
    reg = Registry()
    c = reg.counter("r_total", "R.", ("result",))
    c.prime(("ok",), ("error",))
    assert reg.render().splitlines()[2:] == ['r_total{result="ok"} 0.0',
                                             'r_total{result="error"} 0.0']
    assert c.values == {}
    c.inc(result="error")
    assert c.values == {("error",): 1.0}


def test_settable_gauge():
    reg = Registry()
    g = reg.gauge("temp", "T.", ("room",))
    g.set(2.5, room="a")
    g.set(-1, room="a")
    assert g.get(room="a") == -1.0
    assert reg.render().splitlines()[2:] == ['temp{room="a"} -1.0']


def test_registries_are_separate():
    a, b = Registry(), Registry()
    ca = a.counter("same_total", "S.")
    cb = b.counter("same_total", "S.")
    ca.inc(5)
    assert (ca.get(), cb.get()) == (5.0, 0.0)
    assert "same_total 0.0" in b.render()


def test_registry_refuses_duplicates_and_bad_use():
    reg = Registry()
    c = reg.counter("a_total", "A.", ("x",))
    with pytest.raises(ValueError, match="Duplicated"):
        reg.counter("a_total", "A.")
    with pytest.raises(ValueError, match="labels"):
        c.inc(y="1")
    with pytest.raises(ValueError, match="labels"):
        c.inc()
    with pytest.raises(ValueError, match="labels"):
        c.get(x="1", y="2")
    with pytest.raises(ValueError, match="cannot decrease"):
        c.inc(-1, x="1")
    with pytest.raises(ValueError, match="buckets"):
        reg.histogram("h", "H.", buckets=(2.0, 1.0))
    with pytest.raises(ValueError, match="_total"):
        reg.counter("b", "B.")


def test_parse_samples_sums_label_sets():
    text = ("# HELP vllm:num_requests_running x\n"
            'vllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 2.0\n'
            "vllm:num_requests_waiting 4\n"
            "vllm:num_requests_waiting_other 100\n"
            "vllm:num_requests_swapped NaN\n")
    got = parse_samples(text, ("vllm:num_requests_running", "vllm:num_requests_waiting",
                               "vllm:num_requests_swapped"))
    assert got == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 4.0}


# -- the public contract: names, types, help texts and labels of the router's metrics -------
PINNED = {  # family -> (type, help text, label names of its samples)
    "eldr_requests_total": ("counter", "Client requests by endpoint and HTTP status.",
                            ("endpoint", "status")),
    "eldr_routing_decisions_total": (
        "counter", "Decode routing decisions by policy and decoder.", ("policy", "decoder")),
    "eldr_signatures_total": (
        "counter", "Prefill responses by where the signature came from.", ("source",)),
    "eldr_partial_signatures_total": (
        "counter", "Signatures counted over fewer tokens than the prompt (prefix-cache or KV "
        "connector hits on the prefill instance).", ()),
    "eldr_routing_fallbacks_total": (
        "counter", "Requests routed by load only because their signature was missing or "
        "unusable.", ("reason",)),
    "eldr_route_inputs_total": (
        "counter", "Routing decisions by what their policy's inputs came from: the prefill's "
        "expert counts, the prompt's prediction, or none (routed by load).", ("source",)),
    "eldr_prompt_predictions_total": (
        "counter", "Predictions of a request's routing inputs from its prompt, by result (ok, "
        "or why none: the request is then routed by load).", ("result",)),
    "eldr_prompt_queue_seconds": (
        "histogram", "Prompt prediction jobs: seconds from submitted to started on a prompt "
        "thread.", ()),
    "eldr_prompt_work_seconds": (
        "histogram", "Prompt prediction jobs: seconds of tokenization (in a tokenizer process "
        "or on the thread) and prediction, off the event loop.", ()),
    "eldr_prompt_jobs": ("gauge", "Prompt prediction jobs in flight (running or queued).", ()),
    "eldr_routing_band_size": (
        "histogram", "Decoders inside the locality band (eldr policies).", ()),
    "eldr_routing_latency_seconds": (
        "histogram", "Signature decode + encode + policy decision, per request.", ()),
    "eldr_retries_total": (
        "counter", "Fresh prefill + another decoder after a decode failure.", ()),
    "eldr_prefills_abandoned_total": (
        "counter", "Prefills whose decode did not complete (their KV may stay held on the "
        "prefill instance until its connector's timeout), by reason.", ("reason",)),
    "eldr_short_prompts_total": (
        "counter", "Requests served whole by a decoder, without a prefill, because their "
        "prompt has fewer tokens than --short-prompt-tokens.", ()),
    "eldr_engine_deaths_total": (
        "counter", "Engines found dead (a health probe failed) right after a request failed "
        "there, by role and instance.", ("role", "instance")),
    "eldr_poison_requests_total": (
        "counter", "Requests during which two engines died (detected: answered 502, their body "
        "put on the poison list) and resends of such a body (refused: 422).", ("event",)),
    "eldr_retries_refused_total": (
        "counter", "Retries the retry budget refused (the request failed instead: 502).", ()),
    "eldr_kv_releases_total": (
        "counter", "One-token decodes sent to read (and so free) the KV of a prefill whose "
        "decoder refused the request, by result.", ("result",)),
    "eldr_upstream_errors_total": (
        "counter", "Failures talking to engines, by role and kind.", ("role", "instance", "kind")),
    "eldr_client_disconnects_total": (
        "counter", "Clients that left before their answer ended.", ()),
    "eldr_http_front_requests_total": (
        "counter", "Generate requests the fast front answered itself (eldr.proxy.front).", ()),
    "eldr_http_front_handoffs_total": (
        "counter", "Client connections the fast front handed to the aiohttp server, by why.",
        ("reason",)),
    "eldr_slow_clients_total": (
        "counter", "Clients dropped for leaving an answer unread past the write timeout (their "
        "decode aborted).", ()),
    "eldr_artifact_reloads_total": ("counter", "Routing artifact reloads by result.", ("result",)),
    "eldr_decoder_pool_changes_total": (
        "counter", "Decoders added, put to drain, and removed at run time (POST/DELETE "
        "/admin/decoders).", ("action",)),
    "eldr_decoder_draining": (
        "gauge", "1 while the decoder drains (no new request; removed when its in-flight "
        "requests end), else 0.", ("decoder",)),
    "eldr_decoder_in_flight": ("gauge", "Requests of this router at each decoder.", ("decoder",)),
    "eldr_decoder_load": (
        "gauge", "Load the policy sees per decoder (in-flight, or the engine's running + "
        "waiting when scraped).", ("decoder",)),
    "eldr_decoder_breaker_open": (
        "gauge", "1 while the decoder's circuit breaker holds requests off (open), 0.5 "
        "half-open (one probe allowed), 0 closed.", ("decoder",)),
    "eldr_decoder_breaker_opens": ("gauge", "Times the decoder's breaker opened.", ("decoder",)),
    "eldr_prefill_in_flight": (
        "gauge", "Requests of this router at each prefill instance.", ("instance",)),
    "eldr_upstream_healthy": (
        "gauge", "1 if the instance is taking requests, else 0.", ("role", "instance")),
    "eldr_decode_payloads_total": (
        "counter", "Decode answers by what their engine's decode payload was (read, invalid: "
        "stripped and ignored).", ("result",)),
    "eldr_decoder_distinct_experts": (
        "histogram", "Measured by the decode engine, per completed request: mean distinct "
        "experts per MoE layer per decode step of the batches it decoded in.", ("decoder",)),
    "eldr_decoder_engine_distinct_experts": (
        "gauge", "A decode engine's own live footprint (scraped): mean distinct experts per "
        "MoE layer per decode step over its last steps.", ("decoder",)),
    "eldr_engine_footprints_total": (
        "counter", "Decode engines' expert footprints scraped for the policy, by result "
        "(read; missing, invalid, stale, refused: ignored).", ("result",)),
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _fake_pool(num_decoders: int = 2):
    def inst(role, i):
        return SimpleNamespace(role=role, name=f"{role}-{i}", index=i, in_flight=i, healthy=True,
                               draining=False,
                               breaker=SimpleNamespace(state="closed", num_opened=0),
                               engine_distinct=4.5)
    decode = [inst("decode", i) for i in range(num_decoders)]
    return SimpleNamespace(config=SimpleNamespace(policy="eldr"), decode=decode,
                           prefill=[inst("prefill", 0)],
                           tracker=SimpleNamespace(loads=[0.0] * num_decoders))


def _record_one_of_each(m) -> None:
    m.requests.inc(endpoint="completions", status="200")
    m.decisions.inc(policy="eldr", decoder="decode-0")
    m.signatures.inc(source="payload")
    m.route_inputs.inc(source="prompt")
    m.predictions.inc(result="ok")
    m.short_prompts.inc()
    m.retries_refused.inc()
    m.partial.inc()
    m.fallbacks.inc(reason="missing")
    m.band.observe(2)
    m.latency.observe(1e-4)
    m.retries.inc()
    m.abandoned.inc(reason="decode_failed")
    m.kv_releases.inc(result="ok")
    m.upstream_errors.inc(role="decode", instance="decode-0", kind="connect")
    m.client_disconnects.inc()
    m.slow_clients.inc()
    m.reloads.inc(result="ok")
    m.decode_payloads.inc(result="read")
    m.decode_distinct.observe(5.0, decoder="decode-0")
    m.pool_changes.inc(action="added")
    m.engine_footprints.inc(result="read")


def _families(text: str) -> dict[str, tuple[str, str, set[tuple[str, ...]]]]:
    """family -> (type, help, label-name tuples of its samples) from an exposition page."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    labels: dict[str, set[tuple[str, ...]]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            types[name] = kind
            labels[name] = set()
        elif line and not line.startswith("#"):
            name, brace, rest = line.partition("{")
            name = name.split(" ")[0]
            keys = tuple(sorted(p.split("=")[0] for p in rest.rpartition("}")[0].split('",')
                                if p)) if brace else ()
            family = name
            if types.get(name) is None:
                for suffix in HISTOGRAM_SUFFIXES:
                    if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                        family = name[: -len(suffix)]
                        keys = tuple(k for k in keys if k != "le")
            assert family in types, f"sample {name} has no # TYPE line"
            labels[family].add(keys)
    assert helps.keys() == types.keys()
    return {n: (types[n], helps[n], labels[n]) for n in types}


def test_router_metric_names_types_help_and_labels_are_pinned():
    m = RouterMetrics(_fake_pool())
    _record_one_of_each(m)
    got = _families(m.registry.render())
    assert sorted(got) == sorted(PINNED)
    for name, (kind, help_text, labelnames) in PINNED.items():
        assert got[name][:2] == (kind, help_text), name
        assert got[name][2] == {tuple(sorted(labelnames))}, name  # order is not semantic


def test_a_fresh_router_prints_every_counter_from_the_start():
    text = RouterMetrics(_fake_pool()).registry.render()
    families = _families(text)
    for name, (_, _, labels) in families.items():
        assert labels, f"{name} prints no sample before its first event"
    assert 'eldr_routing_decisions_total{decoder="decode-1",policy="eldr"} 0.0' in text
    assert 'eldr_requests_total{endpoint="chat",status="200"} 0.0' in text
    assert 'eldr_upstream_errors_total{instance="prefill-0",kind="timeout",role="prefill"} 0.0' \
        in text
    assert 'eldr_routing_fallbacks_total{reason="missing"} 0.0' in text
    assert "eldr_partial_signatures_total 0.0" in text
    assert 'eldr_route_inputs_total{source="prompt"} 0.0' in text
    assert 'eldr_prompt_predictions_total{result="no_tokenizer"} 0.0' in text
    assert "eldr_routing_latency_seconds_count 0.0" in text
