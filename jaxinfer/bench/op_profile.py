"""Where the device's time goes, operation by operation: a `jax.profiler` trace of some work, summed by XLA
operation (`python -m jaxinfer.bench --profile DIR`).

On CPU, XLA's thunk executor records every operation it runs (an event per run, named by its HLO op and
module) on the host plane's XLA threads; on a GPU the kernels sit on the device planes' streams (not yet
run on a GPU). Loops and conditionals are left out of the sums: their time is that of the operations they
run, which are counted themselves. The trace directory also opens in TensorBoard or xprof.
`hlo_sources` names each operation by the program code it came from (its HLO metadata's op_name), read
from the compiled programs' text.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from pathlib import Path

import jax

_CONTROL_FLOW = re.compile(r"^(cond|while|conditional|call)(\.[\w.]*)?$")
_MODULE = re.compile(r"^HloModule ([\w.\-]+)", re.M)
_OP_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{[^}]*?op_name=\"([^\"]*)\"", re.M)
_OP_SHAPE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[\d,]*\])(?:\{[^}]*\})? ([\w\-]+)\(", re.M)


@dataclasses.dataclass(frozen=True)
class OpTime:
    name: str           # XLA's name for the operation in its module (e.g. a fusion)
    module: str         # the compiled program it belongs to
    seconds: float      # summed over every time it ran
    count: int          # how many times it ran
    source: str = ""    # the program code it came from (hlo_sources), where known


def _op_lines(plane: jax.profiler.ProfilePlane):
    """The lines whose events are operations running: XLA:CPU's executor threads, a GPU's streams."""
    for line in plane.lines:
        on_cpu = plane.name == "/host:CPU" and line.name.startswith("tf_XLA")
        on_device = plane.name.startswith("/device:") and line.name.startswith("Stream")
        if on_cpu or on_device:
            yield line


def hlo_sources(texts: list[str]) -> dict[tuple[str, str], str]:
    """(module, operation) -> its op_name metadata without the "jit(...)/" prefix (e.g. "while/body/...
    /...e,oe->...o/dot_general") or, where XLA kept none, its opcode and result shape (e.g. "dot
    f32[1,1,32000]"), from compiled programs' text (`Compiled.as_text()`)."""
    sources = {}
    for text in texts:
        module = _MODULE.search(text)
        module = module.group(1) if module else ""
        for op, shape, opcode in _OP_SHAPE.findall(text):
            sources[module, op] = f"{opcode} {shape}"
        for op, op_name in _OP_NAME.findall(text):
            sources[module, op] = op_name.split("/", 1)[-1]
    return sources


def op_times(directory: str | os.PathLike, sources: dict[tuple[str, str], str] | None = None) -> list[OpTime]:
    """Every operation's total time and count in the newest trace under `directory`, longest first, each
    named by `sources` (hlo_sources) where it holds the operation."""
    traces = sorted(Path(directory).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {directory}")
    data = jax.profiler.ProfileData.from_file(str(traces[-1]))
    seconds, counts = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in _op_lines(plane):
            for event in line.events:
                stats = {key: value for key, value in event.stats}
                if "hlo_op" not in stats or _CONTROL_FLOW.match(stats["hlo_op"]):
                    continue
                key = stats["hlo_op"], stats.get("hlo_module", "")
                seconds[key] += event.duration_ns / 1e9
                counts[key] += 1
    sources = sources or {}
    return [OpTime(name, module, s, counts[name, module], sources.get((module, name), ""))
            for (name, module), s in seconds.most_common()]
