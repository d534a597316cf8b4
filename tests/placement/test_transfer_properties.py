"""Property tests: to_device keeps structure, types, aliasing and non-tensor leaves.

Targets are "cpu" (tensors already there: nothing may be copied) and "meta" (a real device
change on a CPU-only machine).
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import devicekit as dk
from tests.placement.structures import CONTAINER_KINDS, Movable, check_moved, make_container

POOL_SIZE = 4

# A spec is a tree of ("tensor", i) | ("movable", i) | ("leaf", value) | (kind, [children]);
# tensors are drawn from a small shared pool so the same tensor shows up in several places.
leaf_specs = st.one_of(
    st.tuples(st.just("tensor"), st.integers(0, POOL_SIZE - 1)),
    st.tuples(st.just("movable"), st.integers(0, POOL_SIZE - 1)),
    st.tuples(st.just("leaf"), st.one_of(st.none(), st.integers(), st.floats(allow_nan=False),
                                         st.text(max_size=5), st.booleans())),
)
specs = st.recursive(
    leaf_specs,
    lambda children: st.tuples(st.sampled_from(CONTAINER_KINDS), st.lists(children, max_size=4)),
    max_leaves=20,
)


def build(spec: tuple[str, Any], pool: list[torch.Tensor]) -> Any:
    kind, payload = spec
    if kind == "tensor":
        return pool[payload]
    if kind == "movable":
        return Movable(pool[payload])
    if kind == "leaf":
        return payload
    return make_container(kind, [build(child, pool) for child in payload])


def make_pool() -> list[torch.Tensor]:
    return [torch.arange(i + 1, dtype=torch.float32) for i in range(POOL_SIZE)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, target=st.sampled_from(["cpu", "meta"]))
def test_to_device_keeps_structure_types_aliasing_and_leaves(spec: Any, target: str) -> None:
    pool = make_pool()
    batch = build(spec, pool)
    out = dk.to_device(batch, target)
    check_moved(batch, out, torch.device(target), {})
    assert all(t.device.type == "cpu" for t in pool)  # the input is left as it was


@settings(max_examples=60, deadline=None)
@given(spec=specs)
def test_moved_tensors_count_matches_distinct_inputs(spec: Any) -> None:
    pool = make_pool()
    batch = build(spec, pool)
    out = dk.to_device(batch, "meta")
    pairs: dict[int, Any] = {}
    check_moved(batch, out, torch.device("meta"), pairs)
    moved = {id(t) for t in pairs.values()}
    assert len(moved) == len(pairs)  # one copy per distinct input tensor, never more


@settings(max_examples=60, deadline=None)
@given(spec=specs, skip=st.sampled_from(["k0", "k1"]))
def test_skip_keys_leave_values_where_they_are(spec: Any, skip: str) -> None:
    pool = make_pool()
    batch = {skip: pool[0], "other": build(spec, pool), "nested": {skip: [pool[1]]}}
    out = dk.to_device(batch, "meta", skip_keys=[skip])
    assert out[skip] is pool[0]
    assert out["nested"][skip] is batch["nested"][skip]
    assert out["nested"][skip][0].device.type == "cpu"
