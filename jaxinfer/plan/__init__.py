"""The layout planner: which (dp, pp, tp, ep, sp) for this model, these devices, this workload
(`python -m jaxinfer.plan`, `--mesh auto`; docs/planner.md)."""

from jaxinfer.plan.hardware import DEVICE_KINDS, DeviceKind, device_kind
from jaxinfer.plan.planner import Candidate, Plan, plan
from jaxinfer.plan.workload import Workload, layouts

__all__ = ["DEVICE_KINDS", "Candidate", "DeviceKind", "Plan", "Workload", "device_kind", "layouts", "plan"]
