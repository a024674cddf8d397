"""Startup and per-request cost of ELDR's Ray Serve PD app against Ray Serve LLM's own
PD builder, on the same vLLM-CPU engines (run by hand, not in CI; docs/ray.md).

    python benchmarks/bench_ray_pd.py --builder eldr --requests 30
    python benchmarks/bench_ray_pd.py --builder ray --requests 30

Both start one prefill and one decode replica of the shipped tiny MoE with the same engine
settings (eager, float32, 1024 tokens, 32-token blocks, no prefix caching, eldr's CPU KV
connector, 1 GiB of KV cache), on a fresh local Ray (8 logical CPUs, 256 MB object
store). ``ray`` is ``ray.serve.llm.build_pd_openai_app`` (needs jsonref, jsonschema,
typer, fsspec, pandas, pyarrow beside ``ray[serve]``; never ``ray[llm]``); ``eldr`` is
``eldr.integrations.ray.build_eldr_pd_app`` (policy ``eldr_cost``, no artifact: it binds to
the first payload's shape and routes on every payload).

Prints one JSON line: seconds from ``serve.run`` to the first answered completion, and
the wall time of ``--requests`` sequential non-streaming completions (distinct prompts of
about 100 tokens, greedy, ``--max-tokens``): p50, p90, mean; for ``eldr`` also the median
of its ``Server-Timing`` phases (the prefill as the ingress saw it, and the route: the
table call that decides). With one decoder both apps
do the same engine work, so the difference is the request path (Serve's proxy, ingress,
handles / HTTP, the routing decision).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

ENGINE_KWARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 1024,
                 "block_size": 32, "enable_prefix_caching": False}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "ELDR_CAPTURE": "prefill"}
TEXT = ("Permission is hereby granted, free of charge, to any person obtaining a copy of "
        "this software and associated documentation files, to deal in the Software without "
        "restriction, including without limitation the rights to use, copy, modify, merge, "
        "publish and distribute copies of the Software, subject to the following conditions")


def _configs(store: str, model: str, builder: str) -> tuple[dict, dict]:
    from eldr.deploy.local import connector_config

    def conf(core: int) -> dict:
        kwargs = dict(ENGINE_KWARGS, kv_transfer_config=connector_config(store))
        out = {"model_loading_config": {"model_id": "tiny", "model_source": model},
               "deployment_config": {"num_replicas": 1},
               "runtime_env": {"env_vars": {**ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core)}},
               "engine_kwargs": kwargs}
        if builder == "ray":
            out["accelerator_config"] = {"kind": "cpu"}
        else:
            out["eldr_engine"] = {"cores": [core]}
        return out
    return conf(0), conf(1)


def _post(url: str, body: dict) -> tuple[bytes, dict[str, float]]:
    """The answer and its Server-Timing durations in ms (eldr's: prefill, route)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        timing = {}
        for part in (r.headers.get("Server-Timing") or "").split(","):
            name, _, dur = part.strip().partition(";dur=")
            if dur:
                timing[name] = float(dur)
        return r.read(), timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builder", choices=("eldr", "ray"), required=True)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--port", type=int, default=18770)
    args = ap.parse_args()

    import numpy as np
    import ray
    from ray import serve

    from eldr.capture import tiny_moe_dir

    tmp = Path(tempfile.mkdtemp(prefix="eldr-bench-ray-"))
    store = tmp / "kv"
    store.mkdir()
    ray.init(num_cpus=8, object_store_memory=256 * 1024 ** 2, include_dashboard=False,
             _temp_dir=str(tmp / "ray"), log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        prefill, decode = _configs(str(store), str(tiny_moe_dir()), args.builder)
        if args.builder == "ray":
            from ray.serve.llm import LLMConfig, build_pd_openai_app

            app = build_pd_openai_app({"prefill_config": LLMConfig(**prefill),
                                       "decode_config": LLMConfig(**decode)})
        else:
            from eldr.integrations.ray import build_eldr_pd_app

            app = build_eldr_pd_app({"prefill_config": prefill, "decode_config": decode})
        url = f"http://127.0.0.1:{args.port}/v1/completions"
        t0 = time.monotonic()
        serve.run(app, name="bench", route_prefix="/")
        while True:
            try:
                _post(url, {"model": "tiny", "prompt": "warm up", "max_tokens": 1})
                break
            except OSError:
                time.sleep(1)
        startup = time.monotonic() - t0
        walls, phases = [], {}
        for i in range(args.requests):
            body = {"model": "tiny", "prompt": f"{i}. {TEXT}", "max_tokens": args.max_tokens,
                    "temperature": 0}
            t = time.perf_counter()
            raw, timing = _post(url, body)
            walls.append(time.perf_counter() - t)
            doc = json.loads(raw)
            for name, ms in timing.items():
                phases.setdefault(name, []).append(ms)
            assert doc["usage"]["completion_tokens"] == args.max_tokens, doc
        w = np.asarray(walls) * 1000
        print(json.dumps({"builder": args.builder, "ray": ray.__version__,
                          "startup_s": round(startup, 1), "requests": args.requests,
                          "max_tokens": args.max_tokens,
                          "wall_ms_p50": round(float(np.median(w)), 1),
                          "wall_ms_p90": round(float(np.percentile(w, 90)), 1),
                          "wall_ms_mean": round(float(w.mean()), 1),
                          **{f"{name}_ms_p50": round(float(np.median(v)), 1)
                             for name, v in phases.items()}}))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
