"""devicekit: PyTorch device management.

Placement (pick free GPUs, lease them, move batches, checkpoints), parallelism (launch many
processes, DDP, model split, pipelines) and memory (usage, leaks, OOM, batch size).

Usage::

    import devicekit as dk

    sel = dk.select_gpus(2, min_free_memory="20GiB")   # leased until released
    batch = dk.to_device(batch, sel.devices[0])
    report = dk.find_leaks(train_step)

This module only re-exports. Names are resolved lazily (PEP 562) so that ``import devicekit``
and the ``devicekit status``/``select`` commands never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Any process that imports devicekit waits at exit, before the interpreter's teardown, for
# torch's gloo worker threads to free their last works: otherwise one of them can abort the
# process after its work is done (devicekit.teardown says why). Standard library only.
from devicekit.teardown import settle_at_exit as _settle_at_exit  # noqa: E402
from devicekit.version import __version__  # noqa: F401  (devicekit.__version__)

_settle_at_exit()

# public name -> "module:attribute" (attribute omitted: the module itself)
_EXPORTS: dict[str, str] = {
    # errors
    "DeviceKitError": "devicekit.errors:DeviceKitError",
    "InvalidValueError": "devicekit.errors:InvalidValueError",
    "InvalidSizeError": "devicekit.errors:InvalidSizeError",
    "InvalidDeviceError": "devicekit.errors:InvalidDeviceError",
    "VisibleDevicesError": "devicekit.errors:VisibleDevicesError",
    "SimulationFileError": "devicekit.errors:SimulationFileError",
    "BackendError": "devicekit.errors:BackendError",
    "NVMLUnavailableError": "devicekit.errors:NVMLUnavailableError",
    "NoDeviceAvailable": "devicekit.errors:NoDeviceAvailable",
    "LeaseError": "devicekit.errors:LeaseError",
    "CheckpointError": "devicekit.errors:CheckpointError",
    "UnsafeCheckpointError": "devicekit.errors:UnsafeCheckpointError",
    "PlacementError": "devicekit.errors:PlacementError",
    "SplitError": "devicekit.errors:SplitError",
    "DistributedError": "devicekit.errors:DistributedError",
    "LaunchError": "devicekit.errors:LaunchError",
    "CommandNotFoundError": "devicekit.errors:CommandNotFoundError",
    "RankFailedError": "devicekit.errors:RankFailedError",
    "RankHangError": "devicekit.errors:RankHangError",
    "BatchSizeError": "devicekit.errors:BatchSizeError",
    "GradientMismatchError": "devicekit.errors:GradientMismatchError",
    "MissingDependencyError": "devicekit.errors:MissingDependencyError",
    "ServeError": "devicekit.errors:ServeError",
    "LeakWarning": "devicekit.errors:LeakWarning",
    # units
    "parse_size": "devicekit.units:parse_size",
    "format_size": "devicekit.units:format_size",
    # hardware: what exists
    "GPU": "devicekit.hardware.gpu:GPU",
    "GPUProcess": "devicekit.hardware.gpu:GPUProcess",
    "MigDevice": "devicekit.hardware.gpu:MigDevice",
    "gpus": "devicekit.hardware.inventory:gpus",
    "Host": "devicekit.hardware.host:Host",
    "host": "devicekit.hardware.host:host",
    "show_utilization": "devicekit.memory.utilization:show_utilization",
    # choosing devices
    "select_gpus": "devicekit.selection.choose:select_gpus",
    "Selection": "devicekit.selection.result:Selection",
    "Lease": "devicekit.sharing.leases:Lease",
    "LeaseRecord": "devicekit.sharing.leases:LeaseRecord",
    "read_leases": "devicekit.sharing.leases:read_leases",
    "visible_devices": "devicekit.hardware.visible:visible_devices",
    "try_gpu": "devicekit.placement.devices:try_gpu",
    "try_all_gpus": "devicekit.placement.devices:try_all_gpus",
    "as_device": "devicekit.placement.devices:as_device",
    # placement
    "to_device": "devicekit.placement.transfer:to_device",
    "pin_memory": "devicekit.placement.transfer:pin_memory",
    "device_of": "devicekit.placement.transfer:device_of",
    "Prefetcher": "devicekit.placement.prefetch:Prefetcher",
    "save_checkpoint": "devicekit.placement.checkpoint:save_checkpoint",
    "load_checkpoint": "devicekit.placement.checkpoint:load_checkpoint",
    "latest_checkpoint": "devicekit.placement.resume:latest_checkpoint",
    "resume": "devicekit.placement.resume:resume",
    "preempted": "devicekit.placement.preemption:preempted",
    "on_preempt": "devicekit.placement.preemption:on_preempt",
    "half": "devicekit.placement.precision:half",
    "mixed_precision": "devicekit.placement.precision:mixed_precision",
    "performance_mode": "devicekit.placement.modes:performance_mode",
    "deterministic_mode": "devicekit.placement.modes:deterministic_mode",
    "RunningMean": "devicekit.placement.metric_log:RunningMean",
    "MetricLog": "devicekit.placement.metric_log:MetricLog",
    "sync_guard": "devicekit.placement.sync_guard:sync_guard",
    # memory
    "memory": "devicekit.memory",
    "find_leaks": "devicekit.memory.leaks:find_leaks",
    "LeakDetector": "devicekit.memory.leaks:LeakDetector",
    "LeakReport": "devicekit.memory.leaks:LeakReport",
    "Leak": "devicekit.memory.leaks:Leak",
    "oom_guard": "devicekit.memory.oom:oom_guard",
    "install_oom_handler": "devicekit.memory.oom:install_oom_handler",
    "find_batch_size": "devicekit.memory.batch_size:find_batch_size",
    "release": "devicekit.memory.release:release",
    "empty_cache": "devicekit.memory.release:empty_cache",
    "MemoryTimeline": "devicekit.memory.timeline:MemoryTimeline",
    "estimate_memory": "devicekit.memory.estimate:estimate_memory",
    "MemoryEstimate": "devicekit.memory.estimate:MemoryEstimate",
    "advise": "devicekit.strategy.advise:advise",
    "Advice": "devicekit.strategy.advise:Advice",
    # parallel
    "launch": "devicekit.jobs.launch:launch",
    "dist": "devicekit.parallel.dist",
    "ddp": "devicekit.parallel.ddp:ddp",
    "BalancedDataParallel": "devicekit.parallel.balanced_dp:BalancedDataParallel",
    "check_equivalence": "devicekit.strategy.equivalence:check_equivalence",
    "EquivalenceReport": "devicekit.strategy.equivalence:EquivalenceReport",
    "unwrap_model": "devicekit.parallel.ddp:unwrap_model",
    "distributed_sampler": "devicekit.parallel.ddp:distributed_sampler",
    "distributed_loader": "devicekit.parallel.ddp:distributed_loader",
    "epochs": "devicekit.parallel.ddp:epochs",
    "join": "devicekit.parallel.ddp:join",
    "save_ddp_checkpoint": "devicekit.parallel.ddp:save_ddp_checkpoint",
    "load_ddp_checkpoint": "devicekit.parallel.ddp:load_ddp_checkpoint",
    "split": "devicekit.modelparallel.split:split",
    "Pipeline": "devicekit.modelparallel.pipeline:Pipeline",
    "Call": "devicekit.modelparallel.call_args:Call",
    "plan_devices": "devicekit.modelparallel.plan:plan_devices",
    "SplitModel": "devicekit.modelparallel.split:SplitModel",
    "ModuleSplit": "devicekit.modelparallel.module_split:ModuleSplit",
    "Plan": "devicekit.modelparallel.partition:Plan",
    "pipeline_stage": "devicekit.modelparallel.stages:pipeline_stage",
    "shard": "devicekit.parallel.shard:shard",
    "DeferredBatchNorm": "devicekit.modelparallel.batchnorm:DeferredBatchNorm",
    # device speed
    "bench": "devicekit.measure.bench_runner:bench",
    "BenchReport": "devicekit.measure.report:BenchReport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'devicekit' has no attribute {name!r}")
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attribute) if attribute else module
    globals()[name] = value  # cache: the next lookup is a plain attribute access
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


# ruff: noqa: F401  (the imports below are the re-exports; __all__ is built from _EXPORTS)
if TYPE_CHECKING:  # every name of _EXPORTS, for type checkers and IDEs (tests/test_house.py)
    from devicekit import memory
    from devicekit.errors import *  # noqa: F403
    from devicekit.hardware.gpu import GPU, GPUProcess, MigDevice
    from devicekit.hardware.host import Host, host
    from devicekit.hardware.inventory import gpus
    from devicekit.hardware.visible import visible_devices
    from devicekit.jobs.launch import launch
    from devicekit.measure.bench_runner import bench
    from devicekit.measure.report import BenchReport
    from devicekit.memory.batch_size import find_batch_size
    from devicekit.memory.estimate import MemoryEstimate, estimate_memory
    from devicekit.memory.leaks import Leak, LeakDetector, LeakReport, find_leaks
    from devicekit.memory.oom import install_oom_handler, oom_guard
    from devicekit.memory.release import empty_cache, release
    from devicekit.memory.timeline import MemoryTimeline
    from devicekit.memory.utilization import show_utilization
    from devicekit.modelparallel.batchnorm import DeferredBatchNorm
    from devicekit.modelparallel.call_args import Call
    from devicekit.modelparallel.module_split import ModuleSplit
    from devicekit.modelparallel.partition import Plan
    from devicekit.modelparallel.pipeline import Pipeline
    from devicekit.modelparallel.plan import plan_devices
    from devicekit.modelparallel.split import SplitModel, split
    from devicekit.modelparallel.stages import pipeline_stage
    from devicekit.parallel import dist
    from devicekit.parallel.balanced_dp import BalancedDataParallel
    from devicekit.parallel.ddp import (
        ddp,
        distributed_loader,
        distributed_sampler,
        epochs,
        join,
        load_ddp_checkpoint,
        save_ddp_checkpoint,
        unwrap_model,
    )
    from devicekit.parallel.shard import shard
    from devicekit.placement.checkpoint import load_checkpoint, save_checkpoint
    from devicekit.placement.devices import as_device, try_all_gpus, try_gpu
    from devicekit.placement.metric_log import MetricLog, RunningMean
    from devicekit.placement.modes import deterministic_mode, performance_mode
    from devicekit.placement.precision import half, mixed_precision
    from devicekit.placement.preemption import on_preempt, preempted
    from devicekit.placement.prefetch import Prefetcher
    from devicekit.placement.resume import latest_checkpoint, resume
    from devicekit.placement.sync_guard import sync_guard
    from devicekit.placement.transfer import device_of, pin_memory, to_device
    from devicekit.selection.choose import select_gpus
    from devicekit.selection.result import Selection
    from devicekit.sharing.leases import Lease, LeaseRecord, read_leases
    from devicekit.strategy.advise import Advice, advise
    from devicekit.strategy.equivalence import EquivalenceReport, check_equivalence
    from devicekit.units import format_size, parse_size
