"""Layout of the fused embedding layer's per-column metadata: one int64 row per column.

Shared by the op's Python side, its C++ and Triton implementations and the torch reference: the fields of
``META_FIELDS``, then ``MAX_STEPS`` steps of ``STEP_WIDTH`` int64 each, (op, p0..p4); the step ops and their
parameters are listed beside the ``OP_*`` constants below.
"""
from __future__ import annotations

META_FIELDS = (
    "in_value",   # index into the op's input list: the raw values
    "in_col",     # column of a 2-D value tensor, -1 for 1-D
    "in_lengths",  # index of the lengths tensor ([B]) for a jagged column, -1: one value per row
    "lookup",     # 0 gather, 1 pool sum, 2 pool mean
    "empty_id",   # pool: an empty row gives this id's row; -1: zeros
    "rows",       # table rows
    "dim",        # table dim
    "w_off",      # element offset of the table in the packed weights
    "out_off",    # column offset in the [B, total_dim] output
    "check",      # 1: ids are not proven in [0, rows): bounds-check them (IndexError, as eager)
    "nsteps",
    "ws_b",       # workspace elements of this column = ws_b * B + ws_n * len(values) + ws_c
    "ws_n",       #   (coefficients of a SymEngine upper bound, see recforge.recom.backend.embedding_plan)
    "ws_c",
)
F = {name: i for i, name in enumerate(META_FIELDS)}
MAX_STEPS = 6
STEP_WIDTH = 6
STEP_BASE = len(META_FIELDS)
META_WIDTH = STEP_BASE + MAX_STEPS * STEP_WIDTH

LOOKUP_GATHER, LOOKUP_SUM, LOOKUP_MEAN = 0, 1, 2
# Step ops and their parameters (p0..p4):
#   SELECT     p0 input index of a flag tensor, p1 its column (-1: 1-D), p2..p3 kept flag interval [lo, hi],
#              p4 fill value: x if lo <= flag <= hi else p4
#   BUCKETIZE  p0 offset into the boundary buffer, p1 count K, p2 right (0/1), p3 1: float boundaries (fbuf,
#              compared as double), 0: int64 boundaries (ibuf); result in [0, K]
#   MOD        p0 n > 0: floor-mod
#   SIGRID     p0 salt, p1 M >= 1: sigrid_hash(x, salt, M) in [0, M)
#   CLAMP      p0 lo, p1 hi (int64 min / max for none)
#   ADD        p0 c (wrapping int64 add)
#   REPLACE    p0 lo, p1 hi, p2 0: keep [lo, hi] / 1: keep outside it, p3 fill value
#   REMOVE     p0 lo, p1 hi, p2 as REPLACE: an element not kept is dropped (a gather row becomes zeros)
OP_NOP, OP_SELECT, OP_BUCKETIZE, OP_MOD, OP_SIGRID, OP_CLAMP, OP_ADD, OP_REPLACE, OP_REMOVE = range(9)
OP_NAMES = ("nop", "select", "bucketize", "mod", "sigrid", "clamp", "add", "replace", "remove")
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def cpp_macros() -> dict[str, int]:
    """The same constants as C++ macros (name -> value) for csrc/embedding_cpu.cpp, passed as -D flags."""
    macros = {"META_WIDTH": META_WIDTH, "STEP_BASE": STEP_BASE, "MAX_STEPS": MAX_STEPS, "STEP_WIDTH": STEP_WIDTH}
    macros.update({f"M_{name.upper()}": i for i, name in enumerate(META_FIELDS)})
    macros.update({f"OP_{name.upper()}": i for i, name in enumerate(OP_NAMES)})
    return macros
