import json
import re
import threading
import time
from itertools import pairwise

import pytest
import torch

import devicekit as dk
from devicekit.errors import InvalidValueError, NoDeviceAvailable, VisibleDevicesError
from devicekit.selection.choose import select_gpus
from devicekit.selection.waiting import WaitDisplay
from devicekit.sharing.leases import Lease, read_leases
from tests.conftest import h100

ALICE = {"pid": 4242, "user": "alice", "memory": "70GiB", "command": "python train.py"}


@pytest.fixture
def four(simulate):
    """GPU 0: 10 GiB free (alice), 1: 80 free, 2: 70 free but 90 % busy, 3: 78.8 GiB free."""
    simulate([h100(used="70GiB", util=5, processes=[ALICE]), h100(), h100(used="10GiB", util=90),
              h100(used="1.2GiB", util=30)])
    return dk.gpus()


def test_chooses_most_free_and_says_why_not_others(four):
    with select_gpus(2, min_free_memory="20GiB", max_utilization=50) as sel:
        assert [g.index for g in sel.gpus] == [1, 3]
        assert sel.rejected == [
            "GPU 0: 10 GiB free < 20 GiB asked",
            "GPU 2: utilization 90% > 50% asked",
        ]
        assert sel.cuda_visible_devices == f"{four[1].uuid},{four[3].uuid}"
        assert {r.gpu_uuid for r in read_leases()} == {four[1].uuid, four[3].uuid}
        assert read_leases()[0].memory == 20 * 2**30
        assert sel.devices == [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert read_leases() == [] and sel.lease.released


def test_orders(four):
    def pick(order, n=4):
        return [g.index for g in select_gpus(n, order=order, lease=False).gpus]

    assert pick("free-memory") == [1, 3, 2, 0]
    assert pick("utilization") == [1, 0, 3, 2]
    assert pick("index") == [0, 1, 2, 3]
    assert sorted(pick("random")) == [0, 1, 2, 3]
    assert len({tuple(pick("random")) for _ in range(30)}) > 1


def test_exclude_by_index_uuid_and_short_uuid(four):
    sel = select_gpus("all", exclude=[1, four[3].uuid, four[2].short_uuid], lease=False)
    assert [g.index for g in sel.gpus] == [0]
    assert "GPU 1: excluded" in sel.rejected
    assert select_gpus(1, exclude="1,3", lease=False).gpus[0].index == 2
    with pytest.raises(InvalidValueError, match="exclude entry '9' matches no GPU"):
        select_gpus(exclude=[9])


def test_account_as_free_counts_own_processes(four):
    sel = select_gpus(1, min_free_memory="79GiB", exclude=[1], account_as_free="alice", lease=False)
    assert sel.gpus[0].index == 0
    with pytest.raises(NoDeviceAvailable):
        select_gpus(1, min_free_memory="79GiB", exclude=[1], lease=False)


def test_leased_gpu_is_skipped_with_holder_named(four):
    with Lease.acquire([four[1].uuid], command="python train.py"):
        sel = select_gpus(1, lease=False)
        assert sel.gpus[0].index == 3
        line = next(r for r in sel.rejected if r.startswith("GPU 1:"))
        assert "leased by" in line and "python train.py" in line and "since" in line


def test_selection_leases_so_next_one_gets_another_gpu(four):
    first = select_gpus(1)
    second = select_gpus(1)
    assert first.gpus[0].index == 1 and second.gpus[0].index == 3
    first.release()
    assert select_gpus(1, lease=False).gpus[0].index == 1
    second.release()


def test_share_budgets_memory(simulate):
    simulate([h100()])
    a = select_gpus(1, min_free_memory="30GiB", share=True)
    b = select_gpus(1, min_free_memory="30GiB", share=True)
    assert a.gpus[0].uuid == b.gpus[0].uuid and len(read_leases()) == 2
    with pytest.raises(NoDeviceAvailable, match="20 GiB free after shared leases < 30 GiB asked"):
        select_gpus(1, min_free_memory="30GiB", share=True)
    with pytest.raises(NoDeviceAvailable, match="shared by 2 lease"):
        select_gpus(1)
    a.release()
    b.release()
    with select_gpus(1):
        with pytest.raises(NoDeviceAvailable, match="leased by"):
            select_gpus(1, min_free_memory="1GiB", share=True)


def test_only_visible_gpus_are_candidates(four, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{four[3].uuid},{four[2].uuid}")
    sel = select_gpus(1, order="index", lease=False)
    assert sel.gpus[0].index == 2
    assert sel.devices == [torch.device("cuda", 1)]  # ordinal in this process's view
    assert any(r.startswith("GPU 1: hidden by CUDA_VISIBLE_DEVICES=") for r in sel.rejected)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", sel.cuda_visible_devices)
    assert sel.devices == [torch.device("cuda", 0)]  # after the caller narrows the view


def test_devices_error_when_chosen_gpu_hidden_later(four, monkeypatch):
    sel = select_gpus(1, lease=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(VisibleDevicesError, match="not visible in this process"):
        _ = sel.devices


def test_too_few_lists_reasons_in_one_line(four):
    with pytest.raises(NoDeviceAvailable) as err:
        select_gpus(3, min_free_memory="75GiB")
    text = str(err.value)
    assert "\n" not in text and text.startswith("need 3 GPU(s), 2 eligible")
    assert err.value.reasons == ["GPU 0: 10 GiB free < 75 GiB asked",
                                 "GPU 2: 70 GiB free < 75 GiB asked"]
    assert read_leases() == []  # nothing half-leased


def test_no_gpus_at_all(simulate):
    simulate([])
    with pytest.raises(NoDeviceAvailable, match="no GPUs found"):
        select_gpus()
    sel = select_gpus(fallback="cpu")
    assert sel.devices == [torch.device("cpu")] and sel.cpu_fallback
    assert sel.cuda_visible_devices == "" and "falling back to cpu" in sel.rejected[-1]


def test_fallback_cpu_says_why(four):
    sel = select_gpus(1, min_free_memory="100GiB", fallback="cpu")
    assert sel.devices == [torch.device("cpu")] and sel.lease is None
    assert "GPU 1: 80 GiB total < 100 GiB asked" in sel.rejected


def test_mig_and_compute_modes_rejected(simulate):
    simulate([h100(mig=True), h100(compute_mode="prohibited"),
              h100(compute_mode="exclusive_process", processes=[{"pid": 7, "user": "bob"}]), h100()])
    sel = select_gpus(1, lease=False)
    assert sel.gpus[0].index == 3
    assert "MIG mode" in sel.rejected[0] and "prohibited" in sel.rejected[1]
    assert "exclusive_process and pid 7" in sel.rejected[2]


def test_wait_until_a_gpu_frees(simulate, tmp_path):
    path = simulate([h100(used="79GiB")])

    def free_later():
        time.sleep(0.3)
        path.write_text(json.dumps({"gpus": [h100()]}))  # the file is re-read per snapshot

    thread = threading.Thread(target=free_later)
    thread.start()
    try:
        with select_gpus(1, min_free_memory="40GiB", wait=10, poll_interval=0.02) as sel:
            assert sel.gpus[0].memory_free == 80 * 2**30
    finally:
        thread.join(timeout=10)


def test_wait_times_out(four):
    start = time.monotonic()
    with Lease.acquire([g.uuid for g in four]), \
            pytest.raises(NoDeviceAvailable, match="after waiting 0.2 s") as info:
        select_gpus(1, wait=0.2, poll_interval=0.02, progress=True)
    assert time.monotonic() - start < 5
    assert info.value.waiting_helps and "leased by" in str(info.value)


@pytest.mark.parametrize("ask,needle", [
    (dict(count=5), "need 5 GPU(s) but this machine has only 4; waiting cannot help"),
    (dict(count=1, min_free_memory="100GiB"),
     "only 0 of the 4 GPU(s) here could ever qualify: GPU 0: 80 GiB total < 100 GiB asked"),
    (dict(count=2, exclude=[0, 1, 2]), "GPU 2: excluded; waiting cannot help"),
])
def test_waiting_for_what_can_never_come_fails_at_once(four, ask, needle):
    # select_gpus(5, wait=600) on 4 GPUs used to sit out the full 600 s in silence
    start = time.monotonic()
    with pytest.raises(NoDeviceAvailable, match=re.escape(needle)) as info:
        select_gpus(wait=600, poll_interval=0.05, **ask)
    assert time.monotonic() - start < 2 and not info.value.waiting_helps
    assert "wait" not in info.value.cli_message().split("waiting cannot help")[1]


def test_waiting_without_any_gpu_fails_at_once(simulate):
    simulate([])
    start = time.monotonic()
    with pytest.raises(NoDeviceAvailable, match="no GPUs found.*waiting cannot help"):
        select_gpus(2, wait=600)
    assert time.monotonic() - start < 2


def test_waiting_still_queues_behind_busy_gpus_that_free_up(four):
    lease = Lease.acquire([g.uuid for g in four])
    threading.Timer(0.3, lease.release).start()
    start = time.monotonic()
    with select_gpus(4, wait=30, poll_interval=0.05) as sel:
        assert len(sel.gpus) == 4
    assert 0.25 < time.monotonic() - start < 10


def test_shortfall_hint_speaks_the_interface_language(four):
    with Lease.acquire([four[1].uuid]), pytest.raises(NoDeviceAvailable) as info:
        select_gpus(4)
    err = info.value
    assert "wait=SECONDS" in str(err) and "--wait" not in str(err)
    assert "--wait SECONDS" in err.cli_message() and "wait=" not in err.cli_message()


def test_wait_display_text_and_silence(four, capsys):
    from devicekit.selection.candidates import Candidate

    c = [Candidate(four[0], 0, ("10 GiB free < 20 GiB asked",)), Candidate(four[1], 1, ())]
    text = WaitDisplay(2, 60).text(c, 42.4)
    assert text == "waiting for 2 GPU(s): 1 eligible, 42 s left (GPU 0: 10 GiB free < 20 GiB asked)"
    quiet = WaitDisplay(2, 60, enabled=False)
    quiet.update(c, 10)
    quiet.close()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kwargs,named", [
    ({"count": 0}, "count 0"),
    ({"count": -2}, "count -2"),
    ({"count": 1.5}, "count 1.5"),
    ({"count": True}, "count True"),
    ({"count": "two"}, "count 'two'"),
    ({"min_free_memory": "10XB"}, "'10XB'"),
    ({"max_utilization": "lots"}, "'lots'"),
    ({"order": "fastest!"}, "order 'fastest!'"),
    ({"wait": -1}, "wait -1"),
    ({"fallback": "gpu"}, "fallback 'gpu'"),
    ({"exclude": [-1]}, "exclude entry -1"),
    ({"share": True}, "share=True needs min_free_memory"),
    ({"poll_interval": 0}, "poll_interval 0"),
])
def test_bad_input_one_line_naming_value(four, kwargs, named):
    with pytest.raises(InvalidValueError) as err:
        select_gpus(**kwargs)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_to_env_and_formats(four):
    sel = select_gpus(2, order="index", lease=False)
    assert sel.to_env() == {"CUDA_VISIBLE_DEVICES": f"{four[0].uuid},{four[1].uuid}"}
    assert sel.to_env("index") == {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    with pytest.raises(InvalidValueError, match="format 'pci'"):
        sel.to_env("pci")
    assert "GPU 0, GPU 1" in repr(sel)


RACER = """
import json, sys, time
from pathlib import Path
from devicekit.errors import NoDeviceAvailable
from devicekit.selection.choose import select_gpus

go, done, wait = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
limit = time.monotonic() + 30
while not go.exists() and time.monotonic() < limit:  # the barrier: all start together
    time.sleep(0.001)
try:
    sel = select_gpus(1, wait=wait or None, poll_interval=0.02)
except NoDeviceAvailable as err:
    print(json.dumps({"error": str(err)}), flush=True)
    sys.exit(0)
start = time.monotonic()
if wait:
    time.sleep(0.1)  # hold the GPU a little, then hand it on
    print(json.dumps({"gpu": sel.gpus[0].uuid, "start": start, "end": time.monotonic()}), flush=True)
    sel.release()
else:
    print(json.dumps({"gpu": sel.gpus[0].uuid}), flush=True)
    while not done.exists() and time.monotonic() < limit:  # hold until every racer reported
        time.sleep(0.01)
"""


def race(spawn, tmp_path, wait):
    from tests.children import wait_line

    go, done = tmp_path / "go", tmp_path / "done"
    racers = [spawn(RACER, str(go), str(done), str(wait)) for _ in range(16)]
    for proc in racers:
        assert wait_line(proc, timeout=30) == "ready"
    go.touch()
    results = [json.loads(wait_line(proc, timeout=30)) for proc in racers]
    return racers, results, done


@pytest.mark.slow
def test_sixteen_processes_eight_gpus_no_gpu_twice(simulate, spawn, tmp_path):
    simulate([h100() for _ in range(8)])
    racers, results, done = race(spawn, tmp_path, wait=0)
    try:
        got = [r["gpu"] for r in results if "gpu" in r]
        failed = [r["error"] for r in results if "error" in r]
        assert len(got) == 8 and len(set(got)) == 8, results
        assert len(failed) == 8 and all(e.startswith("need 1 GPU(s), 0 eligible") for e in failed)
        live = read_leases()
        assert sorted(r.gpu_uuid for r in live) == sorted(got)
        assert {r.pid for r in live} <= {p.pid for p in racers}
    finally:
        done.touch()
    for proc in racers:
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
def test_sixteen_processes_queue_with_wait(simulate, spawn, tmp_path):
    simulate([h100() for _ in range(8)])
    _, results, _ = race(spawn, tmp_path, wait=25)
    assert all("gpu" in r for r in results), results
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        by_gpu.setdefault(r["gpu"], []).append((r["start"], r["end"]))
    for spans in by_gpu.values():  # nobody held a GPU while another held it
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans))
    assert sum(len(s) for s in by_gpu.values()) == 16


def test_share_budget_counts_memory_used_by_the_holders_children(simulate, spawn):
    """A share lease held by `devicekit run` whose child already uses its budget: not counted twice."""
    import os

    from tests.children import wait_line

    code = """
import subprocess, sys, time
from devicekit.sharing.leases import Lease
lease = Lease.acquire([sys.argv[1]], memory=30 * 2**30, share=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
try:
    time.sleep(60)
finally:
    child.kill()
"""
    path = simulate([h100()])
    uuid = dk.gpus()[0].uuid
    proc = spawn(code, uuid)
    child = int(wait_line(proc))
    try:
        # the child uses 30 GiB of the GPU: 50 GiB free, and the holder's 30 GiB budget is spent
        path.write_text(json.dumps({"gpus": [h100(used="30GiB", processes=[
            {"pid": child, "user": "bob", "memory": "30GiB"}])]}))
        with select_gpus(1, min_free_memory="45GiB", share=True):
            pass
    finally:
        proc.kill()
        proc.wait(timeout=10)
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
