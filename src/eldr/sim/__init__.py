"""A discrete-event simulator of a PD-disaggregated MoE cluster (docs/simulator.md).

Requests of a trace arrive (Poisson or replayed), are prefilled on a prefill pool with
prefix-affinity routing, have their KV transferred, and are decoded on a decode pool under
continuous batching. The decode router is any policy of :mod:`eldr.routing`. A decode
step's time depends on the distinct experts its batch selects at each layer THIS step
(:mod:`eldr.sim.steptime`). See docs/simulator.md.

    from eldr.sim import SimConfig, simulate
    res = simulate(trace, SimConfig(qps=60), make_policy("jsq", num_workers=16))
    res.summary()["tpot_median_ms"]
"""

from eldr.sim.config import HARDWARE, Hardware, SimConfig, get_hardware, moe_constants
from eldr.sim.engine import EVENT_NAMES, make_arrivals, simulate
from eldr.sim.hardware import load_hardware, save_hardware
from eldr.sim.metrics import SimResult, write_csv, write_json
from eldr.sim.records import RequestRecord, Requests
from eldr.sim.stepfit import StepFit, fit_step_model
from eldr.sim.steptime import StepModel, deal_bitsets, topk_bitsets, union_distinct
from eldr.sim.tokens import TokenBank

__all__ = [
    "EVENT_NAMES",
    "HARDWARE",
    "Hardware",
    "RequestRecord",
    "Requests",
    "SimConfig",
    "SimResult",
    "StepFit",
    "StepModel",
    "TokenBank",
    "deal_bitsets",
    "fit_step_model",
    "get_hardware",
    "load_hardware",
    "make_arrivals",
    "moe_constants",
    "save_hardware",
    "simulate",
    "topk_bitsets",
    "union_distinct",
    "write_csv",
    "write_json",
]
