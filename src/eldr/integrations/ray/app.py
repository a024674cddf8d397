"""``build_eldr_pd_app``: a Ray Serve PD application whose decode router is ELDR's.

A drop-in for Ray Serve LLM's ``build_pd_openai_app`` in a Serve config: the same
``prefill_config`` / ``decode_config`` (LLMConfig-shaped dicts: ``model_loading_config``,
``deployment_config``, ``engine_kwargs``, ``runtime_env``) plus an ``eldr`` block (the
routing artifact, the policy, τ). It builds four deployments:

- ``EldrDecodeTable`` (one replica): loads, reservations and the policy, shared by every
  ingress replica (:mod:`eldr.integrations.ray.table`);
- ``Prefill:<model>`` and ``Decode:<model>``: one vLLM engine per replica, started as
  ``eldr cluster`` starts them (:mod:`eldr.integrations.ray.engine`);
- ``EldrPDIngress`` (the HTTP ingress, any number of replicas): prefill first, decoder
  chosen by the table on the prefill's real expert counts, decode relayed
  (:mod:`eldr.integrations.ray.relay`).

Why not Serve LLM's own deployments: docs/ray.md ("What Serve LLM does and why this
builds its own").
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from eldr.integrations.ray.engine import EngineSpec
from eldr.integrations.ray.relay import RelayConfig
from eldr.integrations.ray.table import TableConfig

__all__ = ["TESTED_RAY", "PDAppConfig", "build_eldr_pd_app", "check_ray_version",
           "parse_args"]

_log = logging.getLogger("eldr.ray")
# the Ray versions this integration was tested with: [low, high)
TESTED_RAY = ("2.60.0", "2.61.0")
# engine_kwargs the engine spec takes as fields; every other one becomes a CLI flag
_SPEC_KWARGS = {"max_model_len": "max_model_len", "dtype": "dtype",
                "max_num_seqs": "max_num_seqs"}
# where each engine listens, its cores, logs, start timeout; "command": a stand-in (tests)
_ENGINE_KEYS = {"host", "cores", "log_dir", "ready_timeout", "chat_template", "command"}
# engine_kwargs eldr cluster's engine command sets itself (a different value is refused)
_FIXED_KWARGS = {"enforce_eager": True, "enable_prefix_caching": False, "block_size": 32}


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_ray_version(version: str | None = None, *, allow_untested: bool = False) -> str:
    """The installed Ray's version, if inside :data:`TESTED_RAY`; else ``RuntimeError``
    (a warning with ``allow_untested``): Serve's internals this relies on (replica
    context, deployment handles passed to constructors, async ``__init__`` and
    ``check_health``) change between releases."""
    if version is None:
        import ray

        version = ray.__version__
    low, high = TESTED_RAY
    if _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        return version
    message = (f"eldr.integrations.ray is tested with Ray >= {low}, < {high}; this is Ray "
               f"{version} (pip install 'ray[serve]=={low}', or set eldr.allow_untested_ray)")
    if not allow_untested:
        raise RuntimeError(message)
    warnings.warn(message, stacklevel=2)
    return version


@dataclass(frozen=True)
class PDAppConfig:
    """Everything :func:`build_eldr_pd_app` builds from; see :func:`parse_args`."""

    prefill: EngineSpec  # what each prefill replica runs
    decode: EngineSpec  # what each decode replica runs
    prefill_deployment: dict  # Serve options of the prefill deployment (num_replicas, ...)
    decode_deployment: dict  # Serve options of the decode deployment
    ingress_deployment: dict  # Serve options of the ingress
    table: TableConfig  # the decode table's settings (artifact, policy)
    relay: RelayConfig = field(default_factory=RelayConfig)  # the ingress's timeouts

    @property
    def model_id(self) -> str:
        return self.decode.served_name


def _options(conf: dict, where: str) -> dict:
    deployment = dict(conf.get("deployment_config") or {})
    replicas = deployment.get("num_replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"{where}.deployment_config.num_replicas must be an integer >= 1 "
                         f"(autoscaling is not supported: the artifact names a fixed number "
                         f"of decoders), got {replicas!r}")
    deployment["num_replicas"] = replicas
    deployment.setdefault("health_check_period_s", 2.0)
    deployment.setdefault("health_check_timeout_s", 30.0)
    deployment.setdefault("max_ongoing_requests", 1000)
    actor = dict(deployment.get("ray_actor_options") or {})
    actor.setdefault("num_cpus", 1)
    deployment["ray_actor_options"] = actor
    return deployment


def _engine_spec(conf: dict, role: str, where: str, store_default: str | None) -> EngineSpec:
    if not isinstance(conf, dict):
        raise ValueError(f"{where} must be a mapping (an LLMConfig's fields), got {conf!r}")
    loading = conf.get("model_loading_config") or {}
    model = loading.get("model_source")
    served = loading.get("model_id")
    if not isinstance(model, str) or not isinstance(served, str):
        raise ValueError(f"{where}.model_loading_config needs model_id and model_source (a "
                         f"local model folder)")
    kwargs = dict(conf.get("engine_kwargs") or {})
    fields: dict = {}
    for key, name in _SPEC_KWARGS.items():
        if key in kwargs:
            fields[name] = kwargs.pop(key)
    for key, want in _FIXED_KWARGS.items():
        if key in kwargs and kwargs.pop(key) != want:
            raise ValueError(f"{where}.engine_kwargs.{key}: eldr's CPU engines run with "
                             f"{key}={want!r} (docs/ray.md)")
    store = store_default
    kv = kwargs.pop("kv_transfer_config", None)
    if kv is not None:
        extra = kv.get("kv_connector_extra_config") or {} if isinstance(kv, dict) else {}
        store = extra.get("shared_storage_path") or store
        if not isinstance(kv, dict) or kv.get("kv_connector") not in (
                None, "EldrExampleConnector"):
            raise ValueError(f"{where}.engine_kwargs.kv_transfer_config: only eldr's CPU "
                             f"connector (EldrExampleConnector with a shared_storage_path) is "
                             f"supported by this builder; got {kv!r}")
    if store is None:
        raise ValueError(f"{where}: the KV connector needs a shared directory (engine_kwargs."
                         f"kv_transfer_config.kv_connector_extra_config.shared_storage_path, "
                         f"or eldr.kv_store)")
    extra_args: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            extra_args.append(flag)
        elif value is False:
            extra_args.append("--no-" + key.replace("_", "-"))
        elif value is not None:
            import json

            extra_args += [flag, json.dumps(value) if isinstance(value, (dict, list))
                           else str(value)]
    env = (conf.get("runtime_env") or {}).get("env_vars") or {}
    eldr_engine = dict(conf.get("eldr_engine") or {})  # how eldr starts each engine
    unknown = set(eldr_engine) - _ENGINE_KEYS
    if unknown:
        raise ValueError(f"{where}.eldr_engine: unknown keys {sorted(unknown)}; known: "
                         f"{sorted(_ENGINE_KEYS)}")
    command = eldr_engine.get("command")
    return EngineSpec(role=role, model=model, served_name=served, store=str(store),
                      extra_args=tuple(extra_args),
                      env=tuple((str(k), str(v)) for k, v in env.items()),
                      cores=tuple(int(c) for c in eldr_engine.get("cores", ())),
                      chat_template=eldr_engine.get("chat_template"),
                      host=eldr_engine.get("host", "127.0.0.1"),
                      log_dir=eldr_engine.get("log_dir"),
                      ready_timeout=float(eldr_engine.get("ready_timeout", 600.0)),
                      command=tuple(command) if command is not None else None, **fields)


def parse_args(args: dict) -> PDAppConfig:
    """Validate a Serve config's ``args`` (the shape of ``build_pd_openai_app``'s, plus
    ``eldr``):

    ``prefill_config``, ``decode_config``: ``model_loading_config`` {model_id,
    model_source (a local folder)}, ``deployment_config`` {num_replicas,
    ray_actor_options, ...: Serve deployment options}, ``engine_kwargs`` (vLLM engine
    arguments; ``kv_transfer_config`` only eldr's CPU connector), ``runtime_env``
    {env_vars}; ``ingress_deployment_config``; ``eldr``: {artifact, policy, tau,
    load_slack, cost_layer_stride, kv_store, max_attempts, allow_untested_ray}.
    """
    if not isinstance(args, dict):
        raise ValueError(f"the application's args must be a mapping, got {args!r}")
    unknown = set(args) - {"prefill_config", "decode_config", "ingress_deployment_config",
                           "eldr"}
    if unknown:
        raise ValueError(f"unknown args {sorted(unknown)} (expected prefill_config, "
                         f"decode_config, ingress_deployment_config, eldr)")
    eldr = dict(args.get("eldr") or {})
    known = {"artifact", "policy", "tau", "load_slack", "cost_layer_stride", "kv_store",
             "max_attempts", "allow_untested_ray", "reservation_ttl", "heartbeat_timeout",
             "stream_write_timeout"}
    if set(eldr) - known:
        raise ValueError(f"unknown eldr settings {sorted(set(eldr) - known)}; known: "
                         f"{sorted(known)}")
    for name in ("prefill_config", "decode_config"):
        if name not in args:
            raise ValueError(f"{name} is required")
    store = eldr.get("kv_store")
    prefill = _engine_spec(args["prefill_config"], "prefill", "prefill_config", store)
    decode = _engine_spec(args["decode_config"], "decode", "decode_config", store)
    if prefill.served_name != decode.served_name:
        raise ValueError(f"prefill and decode serve different model ids "
                         f"({prefill.served_name!r} vs {decode.served_name!r})")
    if prefill.store != decode.store:
        raise ValueError("prefill and decode engines must share one KV store directory")
    decode_opts = _options(args["decode_config"], "decode_config")
    artifact = eldr.get("artifact")
    if artifact is not None and not Path(artifact).is_dir():
        raise ValueError(f"eldr.artifact {artifact}: not a directory")
    table = TableConfig(num_decode=decode_opts["num_replicas"], artifact=artifact,
                        policy=eldr.get("policy", "eldr_cost"), tau=eldr.get("tau"),
                        load_slack=eldr.get("load_slack"),
                        cost_layer_stride=eldr.get("cost_layer_stride", 1),
                        **{k: float(eldr[k]) for k in ("reservation_ttl", "heartbeat_timeout")
                           if k in eldr})
    ingress = dict(args.get("ingress_deployment_config") or {})
    ingress.setdefault("num_replicas", 1)
    ingress.setdefault("max_ongoing_requests", 1000)
    relay = RelayConfig(max_attempts=int(eldr.get("max_attempts", 3)),
                        stream_write_timeout=float(eldr.get(
                            "stream_write_timeout", RelayConfig.stream_write_timeout)))
    return PDAppConfig(prefill=prefill, decode=decode,
                       prefill_deployment=_options(args["prefill_config"], "prefill_config"),
                       decode_deployment=decode_opts, ingress_deployment=ingress, table=table,
                       relay=relay)


def build_eldr_pd_app(args: dict):
    """The Serve application (``import_path: eldr.integrations.ray:build_eldr_pd_app``).

    Validates everything first (Ray's version, the args, the artifact against the
    policy: :class:`~eldr.integrations.ray.table.DecodeTable` is built once here so a bad
    artifact fails the deploy, not the first request)."""
    from eldr.integrations.ray import deployments

    allow = bool((args or {}).get("eldr", {}).get("allow_untested_ray", False)) \
        if isinstance(args, dict) else False
    check_ray_version(allow_untested=allow)
    config = parse_args(args)
    from eldr.integrations.ray.table import DecodeTable

    DecodeTable(config.table)  # the artifact loads and matches the policy, or this raises
    return deployments.bind_app(config)
