"""Two gloo processes: a split model inside DDP, and a pipeline over torch.distributed.pipelining."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.modelparallel import modelpar_jobs

pytestmark = pytest.mark.slow

WORLD = 2
TIMEOUT_S = 90


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("modelpar-gloo")
    context = mp.start_processes(modelpar_jobs.run, args=(WORLD, str(out)),
                                 nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"2-process gloo job did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    found = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, result in enumerate(found):
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return found


def test_split_model_inside_ddp_matches_single_process(results: list[dict]) -> None:
    for result in results:
        check = result["ddp_of_split"]
        assert sum(check["counts"]) == 5 and len(check["counts"]) == 2
        assert check["max_diff"] < 1e-5


def test_pipeline_stages_over_gloo_match_single_process(results: list[dict]) -> None:
    counts = {tuple(r["pipeline_stage"]["counts"]) for r in results}
    assert len(counts) == 1  # every rank cut the model the same way
    assert sorted(r["pipeline_stage"]["index"] for r in results) == [0, 1]
    for result in results:
        assert result["pipeline_stage"]["max_diff"] < 1e-5


def test_a_refusal_on_rank_0_reaches_every_rank(results: list[dict]) -> None:
    for result in results:
        assert "cannot cut 1 layer(s) into 2 parts" in (result["refusal"]["raised"] or "")
