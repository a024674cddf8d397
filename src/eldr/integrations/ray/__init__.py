"""ELDR inside Ray Serve: a PD application whose decode router is ELDR's (docs/ray.md).

``pip install -e '.[ray]'`` (``ray[serve]`` and the few packages Serve imports; never
``ray[llm]``, which pins another vLLM). In a Serve config::

    import_path: eldr.integrations.ray:build_eldr_pd_app

Or keep Ray's own ``build_pd_openai_app`` and give its decode deployment ELDR's router,
one ``request_router_config`` entry (``request_router_class:
eldr.integrations.ray.router:EldrDecodeRouter``): it decides on the prompt's predicted
expert profile, before the prefill (:mod:`~eldr.integrations.ray.router`; imports Ray,
so not re-exported here).

Modules: :mod:`~eldr.integrations.ray.table` (the shared decode table: loads,
reservations, policy; no Ray), :mod:`~eldr.integrations.ray.relay` (the ingress's request
path; no Ray), :mod:`~eldr.integrations.ray.engine` (one vLLM engine per replica),
:mod:`~eldr.integrations.ray.app` (the builder and its arguments) and
:mod:`~eldr.integrations.ray.deployments` (the Serve classes; imports Ray) and
:mod:`~eldr.integrations.ray.router` (the ``RequestRouter``; imports Ray).
Nothing here imports Ray until an application is built.
"""

from eldr.integrations.ray.app import (
    TESTED_RAY,
    PDAppConfig,
    build_eldr_pd_app,
    check_ray_version,
    parse_args,
)
from eldr.integrations.ray.relay import Answer, PDRelay, RelayConfig
from eldr.integrations.ray.table import DecodeTable, TableConfig

__all__ = [
    "TESTED_RAY",
    "Answer",
    "DecodeTable",
    "PDAppConfig",
    "PDRelay",
    "RelayConfig",
    "TableConfig",
    "build_eldr_pd_app",
    "check_ray_version",
    "parse_args",
]
