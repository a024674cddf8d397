"""/metrics render cost (hand-written exposition vs prometheus_client) and engine-scrape parse
cost (eldr's parse_samples vs prometheus_client.parser), timed in the same run.

    PYTHONPATH=src python benchmarks/bench_metrics.py [--old REV]

``--old`` names the git revision whose hand-written ``eldr/proxy/metrics.py`` is the
baseline (default: the commit before the port). The engine page is synthetic but sized like
vLLM's (about 40 families, histograms of 20-30 buckets, per-model/engine labels).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from types import SimpleNamespace

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from eldr.proxy.metrics import RouterMetrics, parse_samples

ROOT = Path(__file__).resolve().parent.parent
LOAD = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def fake_pool(num_decoders: int):
    def inst(role, i):
        return SimpleNamespace(role=role, name=f"{role}-{i}", index=i, in_flight=i, healthy=True,
                               breaker=SimpleNamespace(state="closed", num_opened=0))
    return SimpleNamespace(config=SimpleNamespace(policy="eldr_cost"),
                           decode=[inst("decode", i) for i in range(num_decoders)],
                           prefill=[inst("prefill", 0)],
                           tracker=SimpleNamespace(loads=[0.0] * num_decoders))


def record(m, num_decoders: int, n: int = 2000) -> None:
    for i in range(n):
        d = f"decode-{i % num_decoders}"
        m.requests.inc(endpoint="completions", status="200")
        m.decisions.inc(policy="eldr_cost", decoder=d)
        m.signatures.inc(source="payload")
        m.band.observe(1 + i % 4)
        m.latency.observe(1e-4 * (1 + i % 7))


def old_metrics(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:src/eldr/proxy/metrics.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_metrics.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_metrics", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def vllm_like_page() -> str:
    reg = prometheus_client.CollectorRegistry()
    labels = ("model_name", "engine")
    series = [("tiny-moe", str(e)) for e in range(2)]
    for i in range(12):
        g = prometheus_client.Gauge(f"vllm:gauge_{i}", "g", labels, registry=reg)
        for s in series:
            g.labels(*s).set(i)
    for name in LOAD:
        g = prometheus_client.Gauge(name, "load", labels, registry=reg)
        for s in series:
            g.labels(*s).set(3)
    for i in range(12):
        c = prometheus_client.Counter(f"vllm:counter_{i}", "c", labels, registry=reg)
        for s in series:
            c.labels(*s).inc(100)
    for i in range(14):
        h = prometheus_client.Histogram(f"vllm:hist_{i}", "h", labels, registry=reg,
                                        buckets=[0.001 * 1.6 ** k for k in range(24)])
        for s in series:
            h.labels(*s).observe(0.05)
    return prometheus_client.generate_latest(reg).decode()


def per_call_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="41aa137", help="revision of the hand-written module")
    ap.add_argument("--decoders", type=int, default=8)
    args = ap.parse_args()

    new = RouterMetrics(fake_pool(args.decoders))
    old = old_metrics(args.old).RouterMetrics(fake_pool(args.decoders))
    record(new, args.decoders)
    record(old, args.decoders)
    t_old = per_call_us(old.registry.render, 200)
    t_new = per_call_us(new.registry.render, 200)
    print(f"/metrics render, {args.decoders} decoders (us per scrape): hand-written "
          f"{t_old:.0f}, prometheus_client {t_new:.0f} ({t_new / t_old:.2f}x), page "
          f"{len(old.registry.render())} -> {len(new.registry.render())} bytes")
    i_old = per_call_us(lambda: old.decisions.inc(policy="eldr_cost", decoder="decode-1"),
                        20000)
    i_new = per_call_us(lambda: new.decisions.inc(policy="eldr_cost", decoder="decode-1"),
                        20000)
    print(f"labelled counter inc (us): hand-written {i_old:.2f}, prometheus_client "
          f"{i_new:.2f}")

    page = vllm_like_page()
    want = parse_samples(page, LOAD)

    def with_library():
        out = {}
        for fam in text_string_to_metric_families(page):
            for s in fam.samples:
                if s.name in LOAD:
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    assert with_library() == want, (with_library(), want)
    p_own = per_call_us(lambda: parse_samples(page, LOAD), 200)
    p_lib = per_call_us(with_library, 20)
    print(f"engine scrape parse, {len(page.splitlines())}-line page (us): parse_samples "
          f"{p_own:.0f}, prometheus_client.parser {p_lib:.0f} ({p_lib / p_own:.0f}x slower)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
