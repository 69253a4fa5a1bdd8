"""The workload a layout is planned for, and the layouts a model admits on a number of devices."""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig
from jaxinfer.mesh import AXES, MeshConfig, MeshError
from jaxinfer.sharding import validate, validate_sp


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests of `prompt` tokens generating `output` tokens, `concurrency` of them in flight at once."""

    prompt: int = 2048
    output: int = 256
    concurrency: int = 64

    @classmethod
    def parse(cls, spec: str) -> Workload:
        """"prompt=2048,output=256,concurrency=64"; keys left out keep their defaults."""
        fields, given = {f.name for f in dataclasses.fields(cls)}, {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, eq, value = (s.strip() for s in part.partition("="))
            if key not in fields or not eq:
                raise ValueError(f"cannot read {part!r} in workload {spec!r}: write e.g. "
                                 f"prompt=2048,output=256,concurrency=64 (keys: {', '.join(sorted(fields))})")
            if key in given:
                raise ValueError(f"workload key {key!r} is given twice in {spec!r}")
            try:
                given[key] = int(value)
            except ValueError:
                raise ValueError(f"workload {key}={value!r} is not an integer") from None
            if given[key] < 1:
                raise ValueError(f"workload {key}={given[key]} must be at least 1")
        return cls(**given)

    def __str__(self) -> str:
        return f"prompt={self.prompt},output={self.output},concurrency={self.concurrency}"


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered way of writing n as a product of `parts` positive integers."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, parts - 1)]


def layouts(cfg: ModelConfig, devices: int, workload: Workload, page_size: int = 16) -> list[MeshConfig]:
    """The meshes of exactly `devices` devices this model can be split over (the mesh's own validation) that
    give every replica at least one of the workload's sequences. MeshError if there is none."""
    if devices < 1:
        raise MeshError(f"--devices {devices} must be at least 1")
    found = []
    for shape in factorizations(devices, len(AXES)):
        mesh = MeshConfig(**dict(zip(AXES, shape, strict=True)))
        try:
            validate(cfg, mesh)
            validate_sp(mesh.sp, cfg.context_length, page_size)
        except MeshError:
            continue
        if mesh.dp * mesh.ep <= workload.concurrency:
            found.append(mesh)
    if not found:
        raise MeshError(f"no layout of {cfg.architecture} uses {devices} devices for {workload.concurrency} "
                        f"concurrent sequences: tp is limited by its {cfg.num_heads} heads, pp by its "
                        f"{cfg.num_layers} layers, sp by its context's pages, and dp x ep by the concurrency; "
                        f"plan for fewer devices")
    return found
