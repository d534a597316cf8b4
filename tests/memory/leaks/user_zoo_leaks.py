"""The user zoo's leaks: each case runs the leak finder on a leak as users write it.

Each case marks the line the finder must name with ``# LEAK-<case>`` (here, or in the model code
of :mod:`tests.memory.leaks.user_zoo_models`) and returns the report, the holder it must name and
the kind (None: any kind). Every case grows by a few KB per step and runs in well under a second.

Usage::

    report, holder, kind = LEAKS["hook_per_step"]()
"""

from __future__ import annotations

import collections
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import devicekit as dk
from tests.memory.leaks.user_zoo_models import (
    OUTPUTS,
    CachedDataset,
    CachingNet,
    Meter,
    Node,
    TimeNet,
    X,
    small,
    train,
)

# -- leaks ------------------------------------------------------------------------------------

Case = tuple[dk.LeakReport, str, str | None]


def leak_hook_per_step() -> Case:
    model = small()

    def step() -> None:
        feats: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda m, i, o: feats.append(o))  # LEAK-hook-per-step
        train(model)

    return dk.find_leaks(step), "model.1._forward_hooks", "hook_per_step"


def leak_class_attribute() -> Case:
    model = CachingNet()
    CachingNet.cache.clear()
    try:
        return dk.find_leaks(lambda: train(model)), "CachingNet.cache", "class_attribute"
    finally:
        CachingNet.cache.clear()


def leak_deferred_closure() -> Case:
    model = small()
    pending_logs: list[Callable[[], None]] = []

    def step() -> None:
        out = model(X)
        out.pow(2).mean().backward()
        pending_logs.append(lambda out=out: print(out.mean()))  # LEAK-deferred-closure

    return dk.find_leaks(step), "pending_logs", "deferred_closure"


def leak_lru_cache() -> Case:
    model = TimeNet()

    def step(index: int) -> None:
        model(X, index).pow(2).mean().backward()

    return dk.find_leaks(step), "TimeNet.time_embedding", "lru_cache"


def leak_param_groups() -> Case:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        extra = torch.zeros(256, requires_grad=True)
        opt.add_param_group({"params": [extra]})  # LEAK-param-groups
        train(model, opt)

    return dk.find_leaks(step), "opt.param_groups", "param_groups"


def leak_defaultdict_history() -> Case:
    model = small()
    history: collections.defaultdict[str, list[torch.Tensor]] = collections.defaultdict(list)

    def step() -> None:
        history["loss"].append(train(model))  # LEAK-defaultdict-history

    return dk.find_leaks(step), "history['loss']", None


def leak_total_plus_loss() -> Case:
    model = small()
    state: dict[str, Any] = {"total": 0}

    def step() -> None:
        loss = model(X).pow(2).mean()
        state["total"] = state["total"] + loss  # LEAK-total-plus-loss

    return dk.find_leaks(step), "state['total']", "autograd_graph"


def leak_gradient_clones() -> Case:
    model = small()
    grads: list[list[torch.Tensor]] = []

    def step() -> None:
        train_no_zero = model(X).pow(2).mean()
        train_no_zero.backward()
        grads.append([p.grad.clone() for p in model.parameters()])  # LEAK-gradient-clones
        model.zero_grad()

    return dk.find_leaks(step), "grads", "growing_container"


def leak_metrics_object() -> Case:
    model = small()
    meter = Meter()

    def step() -> None:
        meter.update(train(model))

    return dk.find_leaks(step), "meter.values", None


errors: list[Exception] = []


def leak_exception_frames() -> Case:
    model = small()
    errors.clear()

    def step() -> None:
        activation = model(X)
        try:
            raise ValueError(f"bad batch {activation.shape}")
        except ValueError as error:
            errors.append(error)  # LEAK-exception-frames

    try:
        return dk.find_leaks(step), "errors", "exception_frames"
    finally:
        errors.clear()


def leak_anomaly_mode_outputs() -> Case:
    model = small()
    kept: list[torch.Tensor] = []

    def step() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.set_detect_anomaly(True):
                loss = model(X).pow(2).mean()
        kept.append(loss)  # LEAK-anomaly-mode-outputs

    return dk.find_leaks(step), "kept", "growing_container"


def leak_dataset_cache() -> Case:
    model = small()
    loader = torch.utils.data.DataLoader(CachedDataset(), batch_size=8, shuffle=False)
    batches = iter(loader)

    def step() -> None:
        batch = next(batches)
        model(batch).pow(2).mean().backward()

    return dk.find_leaks(step), "loader.dataset.cache", "growing_container"


def leak_buffer_per_step() -> Case:
    model = small()

    def step(index: int) -> None:
        model.register_buffer(f"seen_{index}", torch.randn(64))  # LEAK-buffer-per-step
        train(model)

    return dk.find_leaks(step), "model._buffers", "buffer_per_step"


def leak_retained_hidden_state() -> Case:
    cell = nn.Linear(16, 16)
    state = {"h": torch.zeros(8, 16)}

    def step() -> None:
        state["h"] = torch.tanh(cell(X) + state["h"])  # LEAK-retained-hidden-state
        state["h"].sum().backward(retain_graph=True)

    return dk.find_leaks(step), "state['h']", "autograd_graph"


def leak_global_dict_by_step() -> Case:
    model = small()
    OUTPUTS.clear()

    def step(index: int) -> None:
        OUTPUTS[index] = model(X).detach()  # LEAK-global-dict-by-step

    try:
        return dk.find_leaks(step), "OUTPUTS", "growing_container"
    finally:
        OUTPUTS.clear()


def leak_growing_cat() -> Case:
    state = {"buffer": torch.zeros(0, 16)}

    def step() -> None:
        state["buffer"] = torch.cat([state["buffer"], X])  # LEAK-growing-cat

    return dk.find_leaks(step), "state['buffer']", "growing_tensor"


def leak_set_of_outputs() -> Case:
    model = small()
    seen: set[torch.Tensor] = set()

    def step() -> None:
        seen.add(model(X).detach())  # LEAK-set-of-outputs

    return dk.find_leaks(step), "seen", "growing_container"


def leak_unbounded_deque() -> Case:
    model = small()
    recent: collections.deque[torch.Tensor] = collections.deque()

    def step() -> None:
        recent.append(model(X).detach())  # LEAK-unbounded-deque

    return dk.find_leaks(step), "recent", "growing_container"


def leak_eval_without_no_grad() -> Case:
    model = small()
    predictions: list[torch.Tensor] = []
    with dk.LeakDetector() as ld:
        for _ in range(6):
            predictions.append(model(X))  # LEAK-eval-without-no-grad
            ld.step()
    return ld.report(), "predictions", "growing_container"


def leak_reference_cycle() -> Case:
    def step() -> None:
        node = Node()  # LEAK-reference-cycle
        assert node.payload.numel() == 256

    return dk.find_leaks(step), "Node.payload", "reference_cycle"


def leak_mutable_default() -> Case:
    model = small()

    def log_output(out: torch.Tensor, _seen: list[torch.Tensor] = []) -> None:  # noqa: B006
        _seen.append(out)  # LEAK-mutable-default

    def step() -> None:
        log_output(model(X).detach())

    return dk.find_leaks(step), "log_output.__defaults__[0]", "growing_container"


def leak_hook_in_hand_written_loop() -> Case:
    model = small()
    with dk.LeakDetector() as ld:
        for _ in range(6):
            captured: list[torch.Tensor] = []
            hook = functools.partial(lambda store, m, i, o: store.append(o), captured)
            model[0].register_forward_hook(hook)  # LEAK-hook-in-hand-written-loop
            train(model)
            ld.step()
    return ld.report(), "model.0._forward_hooks", "hook_per_step"


LEAKS = {name[len("leak_"):]: fn for name, fn in list(globals().items()) if name.startswith("leak_")}
