"""Sharded (DCP) checkpoint directories another user wrote: no hang, no read outside, no
process-wide change, even from a refused load; real checkpoints still load bit-exactly."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pkgutil
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import devicekit as dk
from devicekit.errors import CheckpointError, UnsafeCheckpointError
from devicekit.placement.safe_dcp import read_metadata
from tests.security.conftest import OTHER_UID, needs_root, src_env
from tests.security.test_checkpoint_attacks import TiedLM

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DATA = "__0_0.distcp"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "ck"
    dcp.save({"model": _model().state_dict(), "step": 7}, checkpoint_id=str(directory))
    assert sorted(p.name for p in directory.iterdir()) == [".metadata", DATA]
    return directory


def _rewrite(directory: Path, change: Callable[[Any], None]) -> None:
    """Tamper with the real metadata object and write it back, as an attacker would."""
    metadata = read_metadata(directory / ".metadata")
    change(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def _refused(directory: Path, error: type[Exception] = CheckpointError, **kwargs: Any) -> str:
    with pytest.raises(error) as info:
        dk.load_checkpoint(directory, **kwargs)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, dk.DeviceKitError)
    return message


# ---- data files that are not regular files inside the directory --------------------------

LOAD_IN_CHILD = """
import sys, time, warnings
warnings.simplefilter("ignore")
import devicekit as dk
from torch import nn
start = time.monotonic()
try:
    if sys.argv[2] == "into":
        dk.load_checkpoint(sys.argv[1], into={"model": nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)), "step": 0})
    elif sys.argv[2] == "stream":  # past the lstat check: the open itself must not block
        import devicekit.placement.dcp_files as files
        files.check_regular = lambda *args, **kwargs: 0
        fs = files.CheckedFileSystem(sys.argv[1])
        with fs.create_stream(fs.root / "__0_0.distcp", "rb"):
            pass
    else:
        dk.load_checkpoint(sys.argv[1])
    print("LOADED")
except dk.DeviceKitError as exc:
    print(type(exc).__name__, exc)
print(f"SECONDS {time.monotonic() - start:.2f}")
"""


@pytest.mark.parametrize("how", ["whole", "into", "stream"])
def test_data_file_that_is_a_fifo_is_refused_without_hanging(ckpt, how):
    (ckpt / DATA).unlink()
    os.mkfifo(ckpt / DATA)
    try:  # a regression must fail here, not hang the suite: the load runs in a child
        done = subprocess.run([sys.executable, "-c", LOAD_IN_CHILD, str(ckpt), how],
                              env=src_env(), capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a checkpoint whose data file is a FIFO hung")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stderr[-2000:]
    assert lines[0].startswith("CheckpointError ") and DATA in lines[0], done.stdout
    assert "FIFO" in lines[0] or "not a regular file" in lines[0]
    # no timing assertion (a loaded machine is slow, not hung): the child's timeout is the check


def test_data_file_symlinked_outside_the_directory_is_not_read(ckpt, tmp_path):
    outside = tmp_path / "elsewhere.bin"  # a valid data file: following the link would load it
    shutil.copy(ckpt / DATA, outside)
    (ckpt / DATA).unlink()
    (ckpt / DATA).symlink_to(outside)
    for kwargs in ({}, {"into": {"model": _model(), "step": 0}}):
        message = _refused(ckpt, UnsafeCheckpointError, **kwargs)
        assert DATA in message and "symbolic link" in message


def test_any_symlink_is_refused_even_inside_the_directory(ckpt):
    os.replace(ckpt / DATA, ckpt / "real.distcp")
    (ckpt / DATA).symlink_to("real.distcp")
    assert "symbolic link" in _refused(ckpt, UnsafeCheckpointError)


def test_metadata_symlink_is_refused(ckpt, tmp_path):
    os.replace(ckpt / ".metadata", tmp_path / "metadata")
    (ckpt / ".metadata").symlink_to(tmp_path / "metadata")
    message = _refused(ckpt, UnsafeCheckpointError)
    assert ".metadata" in message and "symbolic link" in message


def test_data_file_that_is_a_socket_is_refused(ckpt, monkeypatch):
    (ckpt / DATA).unlink()
    monkeypatch.chdir(ckpt)  # a short relative name: socket paths are limited to 108 bytes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(DATA)
        message = _refused(ckpt)
    assert DATA in message and "socket" in message


@needs_root
def test_data_file_that_is_a_device_is_refused(ckpt):
    (ckpt / DATA).unlink()
    os.mknod(ckpt / DATA, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
    message = _refused(ckpt)
    assert DATA in message and "character device" in message


def test_truncated_data_file_is_refused_before_reading(ckpt):
    data = (ckpt / DATA).read_bytes()
    (ckpt / DATA).write_bytes(data[: len(data) // 2])
    message = _refused(ckpt)
    assert DATA in message and "truncated" in message


@needs_root
def test_second_user_cannot_make_us_read_our_own_file(shared_dir):
    """nobody links the data file of a checkpoint it owns to a file only root can read."""
    secret_dir = Path(tempfile.mkdtemp(prefix="devicekit-secret-"))
    directory = shared_dir / "ck"
    try:
        dcp.save({"model": _model().state_dict(), "step": 7}, checkpoint_id=str(directory))
        secret = secret_dir / "secret.bin"  # loadable bytes: a followed link would succeed
        shutil.copy(directory / DATA, secret)
        os.chmod(secret_dir, 0o700)
        for path in (directory, *directory.iterdir()):
            os.chown(path, OTHER_UID, OTHER_UID)
        attack = ("import os, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
                  "d = sys.argv[1]; os.unlink(d + '/__0_0.distcp'); "
                  "os.symlink(sys.argv[2], d + '/__0_0.distcp')")
        done = subprocess.run([sys.executable, "-c", attack, str(directory), str(secret)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        message = _refused(directory, UnsafeCheckpointError)
        assert DATA in message and "symbolic link" in message
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)


# ---- storage entries checked against the metadata ------------------------------------------

def _entries(metadata: Any, fqn: str) -> list[Any]:
    return [info for index, info in metadata.storage_data.items() if index.fqn == fqn]


def test_item_longer_than_its_chunk_is_refused(ckpt):
    _rewrite(ckpt, lambda md: setattr(_entries(md, "model.0.weight")[0], "length", 10**12))
    message = _refused(ckpt, UnsafeCheckpointError)
    assert "'model.0.weight'" in message and "more than its metadata allows" in message


def test_non_tensor_item_over_the_cap_is_refused(ckpt):
    _rewrite(ckpt, lambda md: setattr(_entries(md, "step")[0], "length", 2 * 1024**3))
    assert "'step'" in _refused(ckpt, UnsafeCheckpointError)


def test_overlapping_items_are_refused(ckpt):
    def overlap(md: Any) -> None:
        first, second = _entries(md, "model.0.weight")[0], _entries(md, "model.0.bias")[0]
        second.offset = first.offset

    _rewrite(ckpt, overlap)
    assert "same bytes" in _refused(ckpt, UnsafeCheckpointError)


def test_tensor_larger_than_its_stored_bytes_is_refused(ckpt):
    """Loaded whole, a 4 TB tensor in the metadata would be allocated before any read."""
    _rewrite(ckpt, lambda md: setattr(md.state_dict_metadata["model.0.weight"], "size",
                                      torch.Size([10**6, 10**6])))
    message = _refused(ckpt)
    assert "'model.0.weight'" in message and "corrupt" in message


def test_chunk_outside_its_tensor_is_refused(ckpt):
    def grow(md: Any) -> None:
        md.state_dict_metadata["model.0.bias"].chunks[0].sizes = torch.Size([99])

    _rewrite(ckpt, grow)
    assert "outside its size" in _refused(ckpt)


def test_stream_transforms_are_refused(ckpt):
    _rewrite(ckpt, lambda md: setattr(_entries(md, "model.0.bias")[0],
                                      "transform_descriptors", ["zstd"]))
    assert "stream transforms" in _refused(ckpt)


# ---- the metadata unpickler ---------------------------------------------------------------

def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _body(obj: Any) -> bytes:
    """``obj`` pickled (protocol 2) without its header and STOP, to splice after a GLOBAL."""
    return pickle.dumps(obj, protocol=2)[2:-1]


def _saved_layout_loads_back() -> torch.layout:
    buffer = io.BytesIO()
    torch.save(torch.strided, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_layout_cache_poisoning_is_refused_and_changes_nothing(ckpt):
    """BUILD on torch.serialization._get_layout would swap its process-wide cache."""
    from torch.serialization import _get_layout

    before = dict(vars(_get_layout))
    cache = getattr(_get_layout, "cache", None)
    poison = {"cache": {"torch.strided": torch.sparse_coo}}
    (ckpt / ".metadata").write_bytes(b"\x80\x02" + _global("torch.serialization", "_get_layout")
                                     + _body(poison) + b"b.")
    try:
        message = _refused(ckpt, UnsafeCheckpointError)
        assert ".metadata" in message and "_get_layout" in message
        assert getattr(_get_layout, "cache", None) is cache and dict(vars(_get_layout)) == before
        assert _saved_layout_loads_back() is torch.strided
    finally:  # a regression must not poison the rest of the suite
        vars(_get_layout).clear()
        vars(_get_layout).update(before)


@pytest.mark.parametrize("target", ["class", "enum member", "dtype"])
def test_build_on_shared_objects_is_refused(ckpt, target):
    from torch.distributed.checkpoint import metadata as md

    member = md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    opening = {
        "class": _global(md.__name__, "Metadata"),
        "enum member": _global(md.__name__, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R",
        "dtype": _global("torch", "float32"),
    }[target]
    state = (None, {"pwned": 1}) if target == "class" else {"_value_": 5, "pwned": 1}
    (ckpt / ".metadata").write_bytes(b"\x80\x02" + opening + _body(state) + b"b.")
    saved = dict(vars(member))
    try:
        assert "BUILD on a shared object" in _refused(ckpt, UnsafeCheckpointError)
        assert not hasattr(md.Metadata, "pwned") and not hasattr(member, "pwned")
        assert member.value == 0
    finally:  # a regression must not poison the rest of the suite
        vars(member).clear()
        vars(member).update(saved)
        if "pwned" in vars(md.Metadata):
            delattr(md.Metadata, "pwned")


def _reexports() -> list[tuple[str, str]]:
    found = [("torch.distributed.checkpoint.metadata", "Enum")]
    for module, name in (("torch.distributed.checkpoint._pg_transport", "TreeSpec"),
                         ("torch.distributed.checkpoint.utils", "Shard")):
        try:
            if name in vars(importlib.import_module(module)):
                found.append((module, name))
        except ImportError:
            pass
    return found


@pytest.mark.parametrize(("module", "name"), _reexports())
def test_classes_dcp_only_imports_are_refused(ckpt, module, name):
    (ckpt / ".metadata").write_bytes(b"\x80\x02" + _global(module, name) + b")\x81.")
    message = _refused(ckpt, UnsafeCheckpointError)
    assert f"{module}.{name}" in message and "not a checkpoint data type" in message


def test_metadata_never_imports_a_module(ckpt):
    import torch.distributed.checkpoint as package

    absent = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
              if f"{package.__name__}.{m.name}" not in sys.modules]
    if not absent:
        pytest.skip("every DCP module is already imported")
    (ckpt / ".metadata").write_bytes(b"\x80\x02" + _global(absent[0], "Anything") + b".")
    assert absent[0] in _refused(ckpt, UnsafeCheckpointError)
    assert absent[0] not in sys.modules


@pytest.mark.parametrize(("payload", "refusal"), [
    (b"(" + _global("torch.distributed.checkpoint.metadata", "Metadata")[1:] + b"o.", "OBJ"),
    (b"\x80\x02" + _global("torch.distributed.checkpoint.metadata", "StorageMeta")
     + b"X\x01\x00\x00\x00a\x85R.", "calls"),
    (b"\x80\x02" + _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
     + b")\x81.", "NEWOBJ"),
    (b"\x80\x02" + _global("torch", "float32") + b"K\x01a.", "appends"),
], ids=["OBJ", "REDUCE-dataclass", "NEWOBJ-enum", "APPEND-dtype"])
def test_opcodes_that_act_outside_the_allow_list_are_refused(ckpt, payload, refusal):
    (ckpt / ".metadata").write_bytes(payload)
    assert refusal in _refused(ckpt, UnsafeCheckpointError)


# ---- real checkpoints still load bit-exactly -----------------------------------------------

def _adam_step(model: nn.Module, seed: int) -> torch.optim.Optimizer:
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 50, (2, 5))
    hidden = model.block(model.embed(tokens))
    nn.functional.cross_entropy(model.head(hidden).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    return optimizer


def test_tied_transformer_with_adam_state_round_trips_bit_exactly(tmp_path):
    torch.manual_seed(1)
    model = TiedLM()
    optimizer = _adam_step(model, seed=2)
    directory = tmp_path / "ck"
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 11},
             checkpoint_id=str(directory))

    torch.manual_seed(3)
    fresh = TiedLM()
    fresh_optimizer = _adam_step(fresh, seed=4)  # same structure, different numbers
    into = {"model": fresh, "optim": fresh_optimizer.state_dict(), "step": 0}
    dk.load_checkpoint(directory, into=into)
    fresh_optimizer.load_state_dict(into["optim"])

    assert into["step"] == 11 and fresh.head.weight is fresh.embed.weight
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    assert saved["state"].keys() == loaded["state"].keys()
    for key, entry in saved["state"].items():
        for field, value in entry.items():
            assert torch.equal(value, loaded["state"][key][field]), (key, field)

    whole = dk.load_checkpoint(directory)
    assert whole["step"] == 11
    for name, tensor in model.state_dict().items():
        assert torch.equal(whole["model"][name], tensor), name
