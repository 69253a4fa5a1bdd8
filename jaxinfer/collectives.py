"""Count the collectives a compiled XLA program executes per call, and the bytes they move.

Why: sharding bugs show up as extra or missing communication long before they show up as wrong numbers,
so tests assert the communication pattern of the *compiled* program (`jit(f).lower(...).compile()`)
against analytical counts.

Rules (per device, per call of the program):
- Kinds: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute. An async pair counts
  once, at its `-start`; `-done`/`-update` are ignored (as are computations they name).
- Bytes are the collective's result buffer(s): elements x dtype size, tuple results summed. Async
  `-start` results carry more than the output: `all-gather-start` is `(operand(s), output(s))`,
  `collective-permute-start` is `(operand, output[, u32[], u32[]])`, and the async-wrapped
  `reduce-scatter-start`/`all-to-all-start` are `((operands), output[, context])`; for all of these
  only tuple element 1 (the output) is counted. `all-reduce-start` returns just its output(s), so its
  whole result is counted.
- Executed code is the ENTRY computation plus everything reached through `calls=` (fusions, async
  wrappers, custom-call `called_computations=`), `to_apply=` of a `call` op, while `body=` (x trip
  count) and `condition=` (x trip count + 1), and conditional branches. A conditional runs one branch,
  which is unknown statically, so each kind's count and bytes are the max over its branches (an upper
  bound). `to_apply=` of reductions (the add of an all-reduce, reduce, sort, ...) is not executed code.
- Trip counts come from the while's `known_trip_count` backend config; failing that, from a
  `compare(i, constant(N))` in the loop condition, assuming the counter starts at 0 and steps by 1
  (LT -> N, LE -> N + 1). Otherwise a ValueError is raised: a guessed count would make the report lie.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->.*)?\{\s*$")
_CLOSE = re.compile(r"^\s*\}\s*(,.*)?$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*((?:\(|[a-z]\w*\[).*)$")  # rhs starts with a shape
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,<=]*)\]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SINGLE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_LIST = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CONST = re.compile(r"\b[su]\d+\[\]\s+constant\((-?\d+)\)")
_COMPARE = re.compile(r"\bcompare\(.*direction=(LT|LE)\b")

_BRANCH_KEYS = ("branch_computations", "true_computation", "false_computation")
Report = dict[str, dict[str, int]]


def _bytes(shape: str) -> int:
    """Bytes of an HLO shape string (array or tuple; layouts ignored; `token[]` is 0)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        m = re.fullmatch(r"(?:bf|[sufc])(\d+)\w*", dtype)
        bits = 8 if dtype == "pred" else 0 if dtype == "token" else int(m.group(1)) if m else None
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r}")
        total += (math.prod(int(d.removeprefix("<=")) for d in dims.split(",") if d) * bits + 7) // 8
    return total


def _split(rhs: str) -> tuple[str, str]:
    """Split `(f32[4]{0}, f32[8]{0}) all-gather-start(%x), ...` into the result shape and the rest."""
    depth = 0
    for i, ch in enumerate(rhs):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0 and ch in ") ":
            return rhs[: i + (ch == ")")], rhs[i + 1 :]
    return rhs, ""


def _elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape: `((f32[4]), f32[1], u32[])` -> `(f32[4])`, `f32[1]`, `u32[]`."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0 or (depth == 1 and ch == ","):
            parts.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            return parts
    raise ValueError(f"unbalanced tuple shape {shape!r}")


def _parse(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Computation name -> its instruction lines (continuations joined), and the ENTRY name."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo_text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                cur = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif _CLOSE.match(line):
            cur = None
        elif _INSTR.match(line) or not cur:
            cur.append(line.strip())
        elif line.strip():
            cur[-1] += " " + line.strip()
    if entry is None:
        raise ValueError("no ENTRY computation found in HLO text")
    return comps, entry


def _trip_count(line: str, cond: str, comps: dict[str, list[str]]) -> int:
    m = _TRIP.search(line)
    if m:
        return int(m.group(1))
    body = list(comps.get(cond, []))
    for ins in comps.get(cond, []):  # the compare is often inside a fusion the condition calls
        body += [x for _, c in _callees(_STRING.sub("", ins)) for x in comps.get(c, [])]
    consts = {int(c) for ins in body for c in _CONST.findall(ins)}
    cmp = {d for ins in body for d in _COMPARE.findall(_STRING.sub("", ins))}
    if len(consts) == 1 and len(cmp) == 1:
        return consts.pop() + (cmp.pop() == "LE")
    raise ValueError(
        f"cannot determine the trip count of while loop {line.split('=')[0].strip()!r}: no known_trip_count "
        f"in its backend_config and condition {cond!r} is not a compare against one integer constant"
    )


def _callees(attrs: str) -> list[tuple[str, str]]:
    """(attribute, computation) pairs named by an instruction's attributes (quoted strings removed)."""
    lists = [(k, n.strip().lstrip("%")) for k, v in _LIST.findall(attrs) for n in v.split(",")]
    return _SINGLE.findall(attrs) + [(k, n) for k, n in lists if n]


def _add(acc: Report, other: Report, times: int = 1) -> None:
    for k in KINDS:
        acc[k] = {f: acc[k][f] + times * other[k][f] for f in ("count", "bytes")}


def collective_report(hlo_text: str, branches: bool = True) -> Report:
    """Per kind, collectives executed and result bytes per device for one call (see module docstring);
    branches=False leaves out what conditional branches hold: the collectives every call executes."""
    comps, entry = _parse(hlo_text)
    memo: dict[str, Report] = {}

    def visit(name: str) -> Report:
        if name in memo:
            return memo[name]
        if name not in comps:
            raise ValueError(f"HLO references unknown computation {name!r}")
        acc = memo[name] = {k: {"count": 0, "bytes": 0} for k in KINDS}
        for m in filter(None, map(_INSTR.match, comps[name])):
            shape, rest = _split(m.group(2))
            op = re.match(r"\s*([\w\-]*)", rest).group(1)
            base = op.removesuffix("-start")
            if op.endswith(("-done", "-update")):
                continue
            if base in KINDS:  # its only callee is a reduction (to_apply=), which is not executed code
                tuple_start = op.endswith("-start") and base != "all-reduce" and shape.startswith("(")
                nbytes = _bytes(_elements(shape)[1] if tuple_start else shape)
                acc[base] = {"count": acc[base]["count"] + 1, "bytes": acc[base]["bytes"] + nbytes}
                continue
            callees = _callees(_STRING.sub("", m.group(2)))
            taken = [visit(c) for k, c in callees if k in _BRANCH_KEYS and branches]
            if taken:
                _add(acc, {k: {f: max(r[k][f] for r in taken) for f in ("count", "bytes")} for k in KINDS})
            for key, callee in callees:
                if key in ("calls", "called_computations") or (key == "to_apply" and op == "call"):
                    _add(acc, visit(callee))
            if op == "while":
                loop = dict(callees)
                body, cond = visit(loop["body"]), visit(loop["condition"])
                if any(r["count"] for r in (*body.values(), *cond.values())):  # a loop without collectives
                    n = _trip_count(m.group(2), loop["condition"], comps)     # may have a dynamic bound
                    _add(acc, body, n)
                    _add(acc, cond, n + 1)
        return acc

    return visit(entry)


def compiled_report(fn: Callable[..., Any], *args: Any, **jit_kwargs: Any) -> Report:
    """Compile `fn` for `args` exactly as `jax.jit` would and report its collectives."""
    return collective_report(jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text())


def format_report(report: dict[str, Report]) -> str:
    """A table of {phase: report}, e.g. {"prefill": ..., "decode": ...}, for logs and benchmark output."""
    rows = [("phase", "collective", "count", "bytes")]
    rows += [(p, k, f"{r[k]['count']:,}", f"{r[k]['bytes']:,}") for p, r in report.items() for k in KINDS]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}" for a, b, c, d in rows
    )
