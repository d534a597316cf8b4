"""``devicekit estimate`` says where its time went when it takes long."""

from __future__ import annotations

import torch

import devicekit as dk
from devicekit.cli.estimate import where_time_went


def test_the_largest_stage_comes_first_with_why_it_is_slow() -> None:
    line = where_time_went({"importing torch and devicekit": 3.0, "building the model": 0.01,
                            "fake-tensor step": 9.5})
    assert line.startswith("fake-tensor step 9.5 s, importing torch and devicekit 3.0 s (")
    assert "building the model" not in line             # under 0.05 s: left out
    assert "per time step" in line


def test_an_estimate_says_where_its_seconds_went() -> None:
    est = dk.estimate_memory(torch.nn.Linear(8, 4), torch.zeros(2, 8), device="cpu")
    assert list(est.timings) == ["fake-tensor step"]
    assert est.to_dict()["timings"] == est.timings
