"""The arrays a compiled XLA program writes to device memory per call, from its optimized HLO text.

Why: a decode step is bandwidth-bound, and all it must write is a few activations and the new tokens' K/V;
an array as large as a weight written on every step (a weight dequantized before its matmul, transposed for
the GEMM's operand layout, a scan's slice of stacked weights copied, a matrix-vector product materialised
before its reduction) is that weight's bytes written and read back again, and that is how such a step comes
to run slower than its weights' bytes promise. What a fusion does inside stays in registers, so only the
results of the instructions of executed computations count.

Rules (walked like jaxinfer.collectives: ENTRY, `call`s, while bodies x trip count, and for a conditional
the largest of its branches, since one runs): each instruction's result bytes, except
- what writes nothing or only names memory: parameters, constants, tuples, get-tuple-element, bitcasts,
  while/conditional/call themselves (their computations are walked), async `-start`s (counted at `-done`,
  whose result is the array written), and collectives (jaxinfer.collectives counts those);
- in-place updates, whose result is the buffer they update a slice of (a KV page write): fusions rooted in a
  dynamic-update-slice or scatter, and custom calls whose output aliases an operand.
"""

from __future__ import annotations

import re
from collections import Counter

from jaxinfer.collectives import _BRANCH_KEYS, _INSTR, _STRING, KINDS, _bytes, _callees, _parse, _split, _trip_count

NAMING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
          "opt-barrier", "after-all", "partition-id", "replica-id"}
IN_PLACE = re.compile(r"dynamic[-_]update[-_]slice|scatter")


def written_arrays(hlo_text: str) -> Counter:
    """(instruction, result shape) -> bytes written per call, for every instruction that writes (see the
    module docstring); loops multiply, a conditional contributes its largest branch."""
    comps, entry = _parse(hlo_text)
    memo: dict[str, Counter] = {}

    def visit(name: str) -> Counter:
        if name in memo:
            return memo[name]
        acc = memo[name] = Counter()
        for m in filter(None, map(_INSTR.match, comps[name])):
            shape, rest = _split(m.group(2))
            op = re.match(r"\s*([\w\-]*)", rest).group(1)
            attrs = _STRING.sub("", m.group(2))
            callees = _callees(attrs)
            branches = [visit(c) for k, c in callees if k in _BRANCH_KEYS]
            if branches:
                acc.update(max(branches, key=lambda c: sum(c.values())))
            if op == "call":
                acc.update(visit(dict(callees)["to_apply"]))
            if op == "while":
                loop = dict(callees)
                body = visit(loop["body"])
                if body:
                    n = _trip_count(m.group(2), loop["condition"], comps)
                    acc.update({k: v * n for k, v in body.items()})
            if (op in NAMING or op.endswith("-start") or op.removesuffix("-done") in KINDS
                    or (op == "fusion" and IN_PLACE.search(m.group(1)))
                    or (op == "custom-call" and "output_to_operand_aliasing" in attrs)):
                continue
            acc[(m.group(1), shape.split("{")[0] if not shape.startswith("(") else shape)] += _bytes(shape)
        return acc

    return visit(entry)


def largest(writes: Counter, at_least: int) -> list[tuple[str, str, int]]:
    """(instruction, shape, bytes) of the writes of at least `at_least` bytes, largest first."""
    return [(name, shape, n) for (name, shape), n in writes.most_common() if n >= at_least]
