"""End to end: ELDR's decode router (eldr.integrations.ray.router) inside real Ray Serve.

A local Ray with Serve; a plain deployment of two replicas stands for Serve LLM's decode
deployment (no engine: each call answers which replica ran it), with the router adopted
the way docs/ray.md says, one ``request_router_config`` entry. Serve constructs the
router itself, in the process holding the handle (here the test's), and the router makes
the shared table actor. The artifact is fitted on the two-domain toy trace with the tiny
MoE's tokenizer (its prompt predictor knows which token ids mean which decoder).

Checks: prompts of two families, given as token ids and as text, reach the replica
holding the decoder the artifact's prediction names; both replicas are used; every
reservation is released (loads back to zero); ``serve.shutdown()`` removes the table
actor. No vLLM: about half a minute, most of it Ray and Serve starting.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

NAMES = ("w-code", "w-other")


def _table_actor():
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("EldrDecodeTable-"):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    return None


def test_the_router_routes_a_serve_deployment_on_the_prompts_prediction(tmp_path):
    from _prompt_data import two_domain_trace
    from _ray_serve import local_serve, skip_reason

    if skip_reason():
        pytest.skip(skip_reason())
    from eldr.fit import artifact as art_mod
    from eldr.proxy.request.prompts import PromptTokenizer, tokenizer_dir_for

    tiny = tokenizer_dir_for("tiny_moe")
    if tiny is None:
        pytest.skip("the tiny MoE's tokenizer is not shipped here")
    art = art_mod.fit_artifact(two_domain_trace(), worker_ids=NAMES, tau=0.0, tokenizer=tiny,
                               random_state=0)
    art_mod.save(art, tmp_path / "artifact")
    prompts = [list(range(i, i + 12)) for i in (0, 45, 20, 60)]
    prompts.append("def add(a, b): return a + b")

    def nearest(prompt) -> str:
        ids = prompt if isinstance(prompt, list) else \
            PromptTokenizer(tiny).encode(prompt, add_special_tokens=True)
        sig, _ = art.route_inputs_from_prompt(np.asarray(ids))
        return NAMES[int(np.argmax(np.asarray(art.centroids) @ np.asarray(sig).reshape(-1)))]

    want = [nearest(p) for p in prompts]
    assert set(want) == set(NAMES)

    import ray
    from ray import serve

    with local_serve(num_cpus=6):

        @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1},
                          request_router_config={
                              # the one entry docs/ray.md asks a Serve LLM user to add
                              "request_router_class":
                                  "eldr.integrations.ray.router:EldrDecodeRouter",
                              "request_router_kwargs": {
                                  "artifact": str(tmp_path / "artifact"), "policy": "eldr",
                                  "tokenizer": tiny, "prompt_processes": 0,
                                  "prompt_timeout": 5.0}})
        class Decode:  # a stand-in for Serve LLM's decode server: who served the call
            async def completions(self, request, raw_request_info=None):
                return serve.get_replica_context().replica_id.to_full_id_str()

        handle = serve.run(Decode.bind(), name="router-e2e", route_prefix=None)
        # the router builds its routing state (artifact, tokenizer, compiled kernel) on a
        # thread of its own; until then requests go by load: warm it with one call
        handle.completions.remote({"model": "toy", "prompt": [1, 2, 3]}).result(timeout_s=60)
        def on_prompt(snap) -> int:
            return sum(n for k, n in snap["decisions"].items() if k.endswith("|prompt"))

        deadline = time.monotonic() + 60
        served = []
        while time.monotonic() < deadline:
            before = on_prompt(ray.get(_table_actor().snapshot.remote()))
            served = [handle.completions.remote({"model": "toy", "prompt": p}).result(
                timeout_s=60) for p in prompts]
            snap = ray.get(_table_actor().snapshot.remote())
            if on_prompt(snap) - before == len(prompts):
                break  # every one of this round was decided on its prediction
            time.sleep(1.0)
        slot_of = {d["replica"]: d["name"] for d in snap["decoders"]}
        assert [slot_of[r] for r in served] == want
        assert len(set(served)) == 2
        for _ in range(50):  # releases are sent without waiting for them
            snap = ray.get(_table_actor().snapshot.remote())
            if snap["held"] == 0:
                break
            time.sleep(0.1)
        assert snap["held"] == 0 and [d["load"] for d in snap["decoders"]] == [0.0, 0.0], snap
        assert snap["counters"]["reservations:completed"] == \
            snap["counters"]["reservations:reserved"] - snap["counters"].get(
                "reservations:cancelled", 0)
        serve.shutdown()
        for _ in range(50):
            if _table_actor() is None:
                break
            time.sleep(0.1)
        assert _table_actor() is None  # serve.shutdown() removed the table
