"""Symbolic shapes with SymEngine: every node's shape, checked against real runs; proofs and bounds."""
from __future__ import annotations

import symengine as se
import torch
from torch.fx.interpreter import Interpreter

from recforge.recom.family import make_features
from recforge.recom.frontend.capture import capture
from recforge.recom.frontend.symshape import SymbolicShapes
from test_recom_columns_fixtures import small_model
from test_recom_fixtures import build_inference, raw_batch, small_dataset


class _Record(Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.seen = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.seen[n.name] = out
        return out


def _shapes_agree(ep, ss, args):
    rec = _Record(ep.graph_module)
    flat = [ep.state_dict.get(s.target, (ep.constants or {}).get(s.target)) if s.kind.name != "USER_INPUT" else None
            for s in ep.graph_signature.input_specs]
    user = iter(torch.utils._pytree.tree_leaves(args))
    flat = [next(user) if v is None else v for v in flat]
    with torch.no_grad():
        rec.run(*flat)
    binding = {}
    for n in ep.graph.nodes:  # bind input sizes and fresh (data-dependent) symbols from the run
        v = rec.seen.get(n.name)
        s = ss.shape.get(n)
        if isinstance(v, torch.Tensor) and isinstance(s, tuple):
            for d, real in zip(s, v.shape, strict=True):
                d = ss.canon(d)
                if isinstance(d, se.Symbol) and d not in binding:
                    binding[d] = real
    checked = 0
    for n in ep.graph.nodes:
        v, s = rec.seen.get(n.name), ss.shape.get(n)
        if isinstance(v, torch.Tensor) and isinstance(s, tuple):
            got = tuple(int(ss.canon(d).subs(binding)) for d in s)
            assert got == tuple(v.shape), (n.name, s, tuple(v.shape))
            checked += 1
    return checked, binding


def test_every_shape_matches_a_real_run():
    m = small_model()
    cap = capture(m, (make_features(m, 8, seed=0),))
    ss = SymbolicShapes(cap.program)
    assert ss.from_export == []  # every op in this model has a rule
    for rows in (3, 19):
        checked, binding = _shapes_agree(cap.program, ss, (make_features(m, rows, seed=rows),))
        assert checked > 100 and binding[ss.batch] == rows


def test_dlrm_shapes_and_batch_symbol():
    ds = small_dataset()
    cap = capture(build_inference("dlrm_dcn", dataset=ds).lowered(), raw_batch(ds, 8, seed=0))
    ss = SymbolicShapes(cap.program)
    checked, _ = _shapes_agree(cap.program, ss, raw_batch(ds, 5, seed=1))
    assert checked > 30 and str(ss.batch) == "B"


def test_one_id_per_bag_and_upper_bounds():
    m = small_model()
    cap = capture(m, (make_features(m, 8, seed=0),))
    ss = SymbolicShapes(cap.program)
    bags = [n for n in cap.program.graph.nodes if "embedding_bag" in str(n.target)]
    proofs = {n.args[0].name: ss.one_id_per_bag(n) for n in bags}
    assert sum(p is not None for p in proofs.values()) == 3  # the three bucketized EmbeddingBag([B, 1]) columns
    assert all(("bucketized" in k) == (p is not None) for k, p in proofs.items())
    # boolean indexing keeps at most as many elements as its mask: u <= n_values; unique <= its input
    for sym in ss.upper:
        assert ss.upper_bound(sym).free_symbols <= {s for s in ss.upper_bound(sym).free_symbols
                                                     if str(s) == "B" or str(s).startswith("n_")}
    assert any(str(ss.upper_bound(s)).startswith("B + n_") or "+ B" in str(ss.upper_bound(s)) for s in ss.upper)
