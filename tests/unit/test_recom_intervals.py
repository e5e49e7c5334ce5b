"""Integer interval sets: the domain of the index-range analysis, checked against brute force."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from recforge.recom.columns.intervals import INT64_MAX, INT64_MIN, IntervalSet

U = range(-8, 9)  # a small universe for brute-force checks


def spans():
    pair = st.tuples(st.integers(-8, 8), st.integers(-8, 8)).map(lambda p: (min(p), max(p)))
    return st.lists(pair, max_size=4).map(lambda ps: IntervalSet.of(*ps))


def members(s: IntervalSet) -> set[int]:
    return {v for v in U if v in s}


@settings(max_examples=200, deadline=None)
@given(spans(), spans())
def test_set_algebra_matches_brute_force(a, b):
    assert members(a.intersect(b)) == members(a) & members(b)
    assert members(a.union(b)) == members(a) | members(b)
    assert members(a.complement()) == set(U) - members(a)
    assert a.contains(b) == (members(b) <= members(a))  # a subset test within the small universe
    assert a.complement().complement() == a


@settings(max_examples=100, deadline=None)
@given(spans(), st.integers(-8, 8), st.integers(-8, 8))
def test_clamp_and_shift(a, lo, hi):
    lo, hi = min(lo, hi), max(lo, hi)
    assert members(a.clamp(lo, hi)) == {min(max(v, lo), hi) for v in members(a)}
    assert {v for v in range(-16, 17) if v in a.shift(3)} == {v + 3 for v in members(a)}


def test_containment_is_and_not_or():
    """RECom's release tests `x >= l || x <= r`, which calls [0, 200) inside [0, 100)."""
    keep = IntervalSet.of((0, 99))
    assert not keep.contains(IntervalSet.of((0, 199)))
    assert not keep.contains(IntervalSet.of((-5, 50)))
    assert keep.contains(IntervalSet.of((3, 99)))


def test_comparisons_and_ends():
    assert IntervalSet.compare("ge", 0) == IntervalSet.of((0, INT64_MAX))
    assert IntervalSet.compare("ne", 5).complement() == IntervalSet.point(5)
    assert IntervalSet.compare("lt", INT64_MIN).is_empty
    assert IntervalSet.full().complement().is_empty and IntervalSet.empty().complement() == IntervalSet.full()
    assert IntervalSet.of((INT64_MAX - 1, INT64_MAX)).shift(5) == IntervalSet.full()  # wraps: anything
    assert str(IntervalSet.of((0, 3), (5, INT64_MAX))) == "[0, 3] u [5, +inf]"
