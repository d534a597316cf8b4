"""The OOM explainer: parsed figures, plain-language diagnosis, memory really released."""

from __future__ import annotations

import io
import sys
import weakref

import pytest
import torch

import devicekit as dk
from devicekit.memory.oom_message import is_oom, parse_oom
from devicekit.memory.usage import DeviceMemory
from tests.conftest import h100

NEW_FORMAT = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB of "
    "which 6.56 MiB is free. Process 4242 has 30.00 GiB memory in use. Including non-PyTorch memory, "
    "this process has 49.14 GiB memory in use. Of the allocated memory 38.60 GiB is allocated by "
    "PyTorch, and 10.00 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
OLD_FORMAT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 15.78 GiB total capacity; 12.50 GiB "
    "already allocated; 1.20 GiB free; 13.00 GiB reserved in total by PyTorch)"
)
CPU_MESSAGE = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)
GiB, MiB = 2**30, 2**20


def test_parse_new_cuda_message() -> None:
    facts = parse_oom(NEW_FORMAT)
    assert facts.backend == "cuda"
    assert facts.requested == 20 * MiB
    assert facts.device == 0
    assert facts.total == int(79.15 * GiB)
    assert facts.free == int(6.56 * MiB)
    assert facts.allocated == int(38.6 * GiB)
    assert facts.reserved_unused == 10 * GiB
    assert facts.processes == ((4242, 30 * GiB),)


def test_parse_old_cuda_message_and_cpu_message() -> None:
    old = parse_oom(OLD_FORMAT)
    assert (old.requested, old.device, old.free) == (2 * GiB, 1, int(1.2 * GiB))
    assert old.reserved_unused == int(13 * GiB) - int(12.5 * GiB)
    cpu = parse_oom(CPU_MESSAGE)
    assert (cpu.backend, cpu.requested) == ("cpu", 1125899906842624)


def test_is_oom_accepts_only_memory_errors() -> None:
    assert is_oom(torch.OutOfMemoryError(NEW_FORMAT))
    assert is_oom(RuntimeError(CPU_MESSAGE))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("out of memory"))


def fake_usage() -> list[DeviceMemory]:
    return [DeviceMemory("cuda:0", "NVIDIA H100 80GB HBM3", allocated=38 * GiB, reserved=48 * GiB,
                         peak=40 * GiB, reserved_unused=10 * GiB, free=6 * MiB, total=80 * GiB)]


def failing_forward(refs: list[weakref.ref[torch.Tensor]]) -> None:
    activations = torch.ones(256, 1024)  # 1 MiB held by this frame when the OOM strikes
    refs.append(weakref.ref(activations))
    raise torch.OutOfMemoryError(NEW_FORMAT)


def test_guard_explains_a_simulated_cuda_oom_and_frees_the_frames(simulate) -> None:
    simulate([h100(used="30GiB", processes=[{"pid": 4242, "user": "alice", "memory": "30GiB",
                                             "command": "python other.py"}])])
    out = io.StringIO()
    refs: list[weakref.ref[torch.Tensor]] = []
    guard = dk.oom_guard(reraise=False, file=out, usage=fake_usage())
    with guard:
        failing_forward(refs)
    text = out.getvalue()
    assert "out of memory on cuda:0" in text
    assert "asked for:    20 MiB" in text
    assert "free:         6.6 MiB of 79.1 GiB" in text
    assert "10 GiB reserved but unused" in text
    assert "pid 4242 (alice) python other.py: 30 GiB" in text
    fixes = guard.diagnosis.fixes
    assert "other processes hold 30 GiB" in fixes[0]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in fixes[1]
    assert any("dk.find_batch_size" in fix for fix in fixes)
    assert refs[0]() is None  # the failed frame's tensor is gone


def test_frames_are_freed_while_the_reraised_error_is_still_alive(simulate) -> None:
    """The memory must be free when the guard hands cached blocks back (empty_cache), not later
    when the caller drops the exception: the explainer reads the failed frames' f_locals,
    which before Python 3.13 caches a dict on each frame that frame.clear() leaves alone."""
    simulate([h100()])
    refs: list[weakref.ref[torch.Tensor]] = []
    with pytest.raises(torch.OutOfMemoryError) as err, \
            dk.oom_guard(file=io.StringIO(), usage=fake_usage()):
        failing_forward(refs)
    assert err.value.devicekit_diagnosis is not None  # the error (and its traceback) lives on
    assert refs[0]() is None  # ...but the failed frame's tensor is already gone


def test_other_processes_come_from_the_gpu_cuda_visible_devices_names(simulate, monkeypatch) -> None:
    from devicekit.hardware.visible import DeviceOrderWarning
    from devicekit.memory.oom_explain import explain

    simulate([{"name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "compute_capability": "8.0",
               "processes": [{"pid": 1111, "user": "bob", "memory": "1GiB"}]},
              h100(used="30GiB", compute_capability="9.0",
                   processes=[{"pid": 4242, "user": "alice", "memory": "30GiB"}])])
    # CUDA's default order is fastest first: cuda:0 under "0" is the H100, physical GPU 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.warns(DeviceOrderWarning):
        diagnosis = explain(torch.OutOfMemoryError(NEW_FORMAT), usage=fake_usage())
    assert [(p.pid, p.user) for p in diagnosis.other_processes] == [(4242, "alice")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "bogus")  # a bad value never breaks the diagnosis:
    others = explain(torch.OutOfMemoryError(NEW_FORMAT), usage=fake_usage()).other_processes
    assert [(p.pid, p.user) for p in others] == [(4242, None)]  # only what the message says


def test_guard_reraises_by_default_and_attaches_the_diagnosis(simulate) -> None:
    simulate([h100()])
    out = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError) as err, dk.oom_guard(file=out, usage=fake_usage()):
        raise torch.OutOfMemoryError(NEW_FORMAT)
    assert err.value.devicekit_diagnosis.requested == 20 * MiB
    assert "what to do" in out.getvalue()


def host_ram(free: int, total: int = 64 * GiB) -> list[DeviceMemory]:
    """A CPU usage row, so that what counts as "short" does not depend on the test machine."""
    return [DeviceMemory("cpu", "host memory", allocated=None, reserved=None, peak=None,
                         reserved_unused=None, free=free, total=total)]


def cpu_message(asked: int) -> str:
    return CPU_MESSAGE.replace("1125899906842624 bytes", f"{asked} bytes")


def test_cpu_oom_names_the_biggest_tensor_by_variable() -> None:
    out = io.StringIO()
    refs: list[weakref.ref[torch.Tensor]] = []

    def cpu_forward() -> None:
        activations = torch.ones(1024, 1024)  # 4 MiB, the biggest tensor in the failing frame
        refs.append(weakref.ref(activations))
        raise RuntimeError(cpu_message(8 * MiB))

    with dk.oom_guard(reraise=False, file=out, usage=host_ram(free=2 * MiB)):
        cpu_forward()
    lines = out.getvalue().splitlines()
    biggest = lines[lines.index("  biggest tensors:") + 1]
    assert "4 MiB  activations (local, float32 [1024, 1024]) [cpu_forward (test_oom.py:" in biggest
    assert refs[0]() is None


def test_one_cpu_allocation_larger_than_host_ram_gets_one_plain_answer() -> None:
    """The issue's case: torch.empty(2**44) (64 TiB of float32) with RAM to spare is no shortage
    of RAM, and no `del` or optimizer change can help: one answer, with the realistic fixes."""
    model = torch.nn.Linear(4, 4)  # tiny weights, gradients and Adam state: nothing worth advice
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    x = torch.ones(512)  # 2 KiB
    try:
        torch.empty(2**44)
    except Exception as exc:  # torch 2.x on the CPU: RuntimeError from DefaultCPUAllocator
        assert type(exc) is RuntimeError and is_oom(exc), repr(exc)
    else:
        pytest.skip("this host's allocator granted 64 TiB (memory overcommit)")
    out = io.StringIO()
    guard = dk.oom_guard(reraise=False, file=out)
    guard(torch.empty)(2**44)  # the decorator form
    diagnosis = guard.diagnosis
    assert diagnosis is not None and diagnosis.backend == "cpu" and diagnosis.requested == 2**46
    assert diagnosis.total is not None and diagnosis.total < 2**46
    assert len(diagnosis.fixes) == 1
    answer = diagnosis.fixes[0]
    assert answer.startswith("one allocation of 64 TiB is larger than all of host RAM (")
    for fix in ("smaller batch or shape", "dk.find_batch_size", "shard", "lower precision"):
        assert fix in answer
    text = out.getvalue()
    assert "asked for:    64 TiB" in text
    for noise in ("host RAM is", "`x`", "optimizer state", "biggest tensors"):
        assert noise not in text
    del x


def test_bare_decorator_reraises_after_explaining(capsys: pytest.CaptureFixture[str]) -> None:
    @dk.oom_guard
    def fails() -> None:
        raise MemoryError()

    with pytest.raises(MemoryError):
        fails()
    assert "out of memory on cpu" in capsys.readouterr().err


def test_other_errors_pass_through_silently() -> None:
    out = io.StringIO()
    with pytest.raises(ValueError), dk.oom_guard(file=out):
        raise ValueError("not memory")
    assert out.getvalue() == ""


def test_fragmentation_advice_when_expandable_segments_is_already_on(simulate, monkeypatch) -> None:
    simulate([h100()])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    guard = dk.oom_guard(reraise=False, file=io.StringIO(), usage=fake_usage())
    with guard:
        raise torch.OutOfMemoryError(NEW_FORMAT)
    fragmentation = [fix for fix in guard.diagnosis.fixes if "fragmentation" in fix]
    assert fragmentation and "already on" in fragmentation[0]


def test_cuda_request_larger_than_the_whole_gpu_gets_one_plain_answer(simulate) -> None:
    """Another process, fragmentation, batch-size halving: none of it lets 120 GiB fit on an
    80 GiB GPU; the answer says what was asked, the device's total and what can help."""
    simulate([h100(used="30GiB", processes=[{"pid": 4242, "user": "alice", "memory": "30GiB"}])])
    message = NEW_FORMAT.replace("Tried to allocate 20.00 MiB", "Tried to allocate 120.00 GiB")
    out = io.StringIO()
    guard = dk.oom_guard(reraise=False, file=out, usage=fake_usage())
    with guard:
        raise torch.OutOfMemoryError(message)
    assert guard.diagnosis.fixes == [
        "one allocation of 120 GiB is larger than the whole of cuda:0 (79.1 GiB): freeing memory "
        "cannot make it fit. Make that tensor smaller (a smaller batch or shape; dk.find_batch_size "
        "finds the largest batch that fits), split or shard it across devices (dk.split), or store "
        "it in lower precision (bfloat16 takes half of float32)"]
    assert "pid 4242" not in out.getvalue()  # listed when they matter, not here


def test_a_fraction_limit_smaller_than_the_request_is_the_fix(simulate) -> None:
    simulate([h100()])
    message = ("CUDA out of memory. Tried to allocate 30.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
               "of which 60.00 GiB is free. 20.00 GiB allowed; Of the allocated memory 1.00 GiB is "
               "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")
    guard = dk.oom_guard(reraise=False, file=io.StringIO(), usage=fake_usage())
    with guard:
        raise torch.OutOfMemoryError(message)
    assert guard.diagnosis.fixes[0].startswith("a memory fraction limit of 20 GiB is set")


def test_fixes_are_ranked_by_the_memory_they_could_recover() -> None:
    """A sizeable variable and sizeable optimizer state both matter here: both are advised, the
    one that recovers more first; a 2 KiB tensor, which cannot close a 4 MiB gap, is not."""
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 1024)).sum().backward()
    optimizer.step()  # 8 MiB of Adam state
    out = io.StringIO()
    guard = dk.oom_guard(reraise=False, file=out, top=20, usage=host_ram(free=2 * MiB))

    def step() -> None:
        activations = torch.ones(512, 1024)  # 2 MiB: half of the 4 MiB shortfall
        small = torch.ones(512)  # 2 KiB
        assert activations.numel() > small.numel()  # both alive when the allocation fails
        raise RuntimeError(cpu_message(6 * MiB))

    with guard:
        step()
    fixes = guard.diagnosis.fixes
    assert fixes[0].startswith("optimizer state holds 8 MiB, more than the weights")
    assert fixes[1].startswith("`activations` holds 2 MiB: `del` it")
    assert fixes[2].startswith("host RAM is 4 MiB short: lower the batch size")
    assert len(fixes) == 3 and "`small`" not in "".join(fixes)
    del model, optimizer


def test_install_oom_handler_chains_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda t, e, tb: seen.append(type(e).__name__))
    out = io.StringIO()
    uninstall = dk.install_oom_handler(file=out)
    assert dk.install_oom_handler() is uninstall
    try:
        raise RuntimeError(CPU_MESSAGE)
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    uninstall()
    assert seen == ["RuntimeError"]
    assert "out of memory on cpu" in out.getvalue()
    assert sys.excepthook.__name__ == "<lambda>"


def test_observer_capture_is_used_only_for_the_failure_it_saw() -> None:
    from devicekit.memory.oom_explain import explain

    short = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB"
    seen = {"device": 0, "requested": 20 * MiB, "limit": 80 * GiB, "free": 3 * MiB,
            "allocated": 70 * GiB, "reserved": 75 * GiB, "time": 0.0}
    diagnosis = explain(torch.OutOfMemoryError(short), usage=[], gpus=[], observed=seen)
    assert diagnosis.free == 3 * MiB and diagnosis.reserved_unused == 5 * GiB
    assert "at the moment of failure" in diagnosis.source
    # an earlier capture (a batch-size trial of 4 GiB) must not explain a later cuBLAS failure
    stale = {**seen, "requested": 4 * GiB}
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    for exc in (cublas, torch.OutOfMemoryError(short)):
        diagnosis = explain(exc, usage=[], gpus=[], observed=stale)
        assert diagnosis.free is None and diagnosis.requested != 4 * GiB
        assert "at the moment of failure" not in diagnosis.source


def test_bad_top_is_refused_before_the_failure_not_during_it() -> None:
    with pytest.raises(dk.InvalidValueError, match="top=-2"):
        dk.oom_guard(top=-2)


def test_a_failing_diagnosis_never_replaces_the_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit.memory import oom

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("NVML went away")

    monkeypatch.setattr(oom, "explain", broken)
    out = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError):
        with dk.oom_guard(file=out):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
    assert "could not explain" in out.getvalue() and "NVML went away" in out.getvalue()
