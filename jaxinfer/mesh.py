"""MeshConfig: parse "dp=2,tp=4" or a TOML preset, validate it against a model, build the 5-axis Mesh."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from importlib import resources
from pathlib import Path

AXES = ("dp", "pp", "tp", "ep", "sp")


class MeshError(ValueError):
    """A mesh that cannot run: the message names the value, the limit and the fix."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    sp: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        named = [f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) > 1]
        return ",".join(named) or "single device"

    @classmethod
    def parse(cls, spec: str | MeshConfig | None) -> MeshConfig:
        """Accepts "tp=8", "dp=2,tp=4", "" (one device), a preset name in meshes/ or a .toml path."""
        if isinstance(spec, MeshConfig):
            return spec
        spec = (spec or "").strip()
        if spec.endswith(".toml") or (spec and "=" not in spec):
            return cls.from_preset(spec)
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in AXES:
                raise MeshError(f"unknown mesh axis {name!r} in {spec!r}; the axes are {', '.join(AXES)}")
            if name in sizes:
                raise MeshError(f"mesh axis {name!r} is given twice in {spec!r}")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise MeshError(f"mesh axis {name}={value!r} is not an integer (write e.g. {name}=2)") from None
        return cls.from_dict(sizes, source=spec)

    @classmethod
    def from_dict(cls, sizes: dict[str, int], source: str = "") -> MeshConfig:
        for name, n in sizes.items():
            if name not in AXES:
                raise MeshError(f"unknown mesh axis {name!r} in {source!r}; the axes are {', '.join(AXES)}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise MeshError(f"mesh axis {name}={n!r} in {source!r} must be an integer >= 1")
        return cls(**sizes)

    @classmethod
    def from_preset(cls, name: str) -> MeshConfig:
        """A TOML preset with a [mesh] table, by path or by name among the packaged meshes/."""
        path = Path(name)
        if path.is_file():
            text = path.read_text()
        else:
            stem = path.name.removesuffix(".toml")
            packaged = resources.files("jaxinfer.meshes") / f"{stem}.toml"
            if not packaged.is_file():
                known = sorted(p.name.removesuffix(".toml") for p in resources.files("jaxinfer.meshes").iterdir()
                               if p.name.endswith(".toml"))
                raise MeshError(f"no mesh preset {name!r}: not a file, and not one of {known}; "
                                f"or write the axes directly, e.g. --mesh dp=2,tp=4")
            text = packaged.read_text()
        try:
            table = tomllib.loads(text).get("mesh")
        except tomllib.TOMLDecodeError as e:
            raise MeshError(f"mesh preset {name!r} is not valid TOML: {e}") from None
        if not isinstance(table, dict):
            raise MeshError(f"mesh preset {name!r} needs a [mesh] table, e.g. [mesh]\\ntp = 8")
        return cls.from_dict(table, source=name)

    def check_devices(self, available: int) -> None:
        if self.size > available:
            raise MeshError(f"mesh {self} needs {self.size} devices but only {available} are available; "
                            f"shrink an axis so the product is at most {available}")

    def make(self, devices=None):
        """The jax Mesh over the first `size` devices, all five axes present (Auto sharding mode)."""
        import jax

        devices = list(jax.devices() if devices is None else devices)
        self.check_devices(len(devices))
        return jax.make_mesh(self.shape, AXES, devices=devices[: self.size],
                             axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


AUTO_CPU_DEVICES = 8   # the fake CPU devices `--mesh auto` plans over where there is no accelerator


def mesh_for_cli(spec: str, processes: int = 1) -> MeshConfig | str:
    """Parse a --mesh flag and, before JAX starts, ask XLA for the CPU devices this process needs. "auto" stays
    "auto" (LLM has the planner choose) with AUTO_CPU_DEVICES fake devices where there is no accelerator."""
    if spec.strip() == "auto":
        provide_host_devices(AUTO_CPU_DEVICES)
        return "auto"
    mesh = MeshConfig.parse(spec)
    if mesh.size % processes:
        raise MeshError(f"mesh {mesh} has {mesh.size} devices, which {processes} processes cannot share evenly")
    provide_host_devices(mesh.size // processes)
    return mesh


def provide_host_devices(n: int) -> None:
    """Ask XLA for n CPU devices; must run before JAX initialises. Harmless when an accelerator exists."""
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()
