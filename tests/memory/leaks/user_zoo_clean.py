"""The user zoo's clean look-alikes: code that looks like a leak and is not; each returns its report.

Usage::

    report = CLEAN["deque_with_maxlen"]()
    assert report.ok
"""

from __future__ import annotations

import collections
import functools

import torch

import devicekit as dk
from tests.memory.leaks.user_zoo_models import X, small, train

# -- clean look-alikes ------------------------------------------------------------------------

def clean_bounded_dict_cache() -> dk.LeakReport:
    cache: dict[int, torch.Tensor] = {}

    def step(index: int) -> None:
        cache.setdefault(index % 3, torch.randn(32, 32))

    return dk.find_leaks(step, steps=8)


def clean_ema_in_place() -> dk.LeakReport:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}

    def step() -> None:
        train(model, opt)
        with torch.no_grad():
            for name, p in model.named_parameters():
                ema[name].mul_(0.9).add_(p, alpha=0.1)

    return dk.find_leaks(step)


def clean_big_temporaries_freed() -> dk.LeakReport:
    def step() -> None:
        big = torch.randn(256, 256)
        assert (big @ big).sum().item() != 1.5

    return dk.find_leaks(step)


def clean_deque_with_maxlen() -> dk.LeakReport:
    model = small()
    recent: collections.deque[torch.Tensor] = collections.deque(maxlen=2)

    def step() -> None:
        recent.append(train(model).detach())

    return dk.find_leaks(step, steps=7)


def clean_hook_registered_once() -> dk.LeakReport:
    model = small()
    feats: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, i, o: feats.append(o.detach()))

    def step() -> None:
        train(model)
        feats.clear()

    return dk.find_leaks(step)


def clean_hook_removed_every_step() -> dk.LeakReport:
    model = small()

    def step() -> None:
        feats: list[torch.Tensor] = []
        handle = model[1].register_forward_hook(lambda m, i, o: feats.append(o))
        train(model)
        handle.remove()

    return dk.find_leaks(step)


@functools.lru_cache(maxsize=4)
def positions(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def clean_lru_cache_same_key() -> dk.LeakReport:
    model = small()

    def step(index: int) -> None:
        (model(X) + positions(4 + index % 2)[:4]).sum().backward()

    return dk.find_leaks(step)


def clean_adam_state_and_float_losses() -> dk.LeakReport:
    model = small()
    opt = torch.optim.Adam(model.parameters())
    losses: list[float] = []
    with dk.LeakDetector() as ld:
        for _ in range(6):
            losses.append(train(model, opt).item())
            ld.step()
    return ld.report()


def clean_param_group_added_once() -> dk.LeakReport:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.add_param_group({"params": [torch.zeros(4, requires_grad=True)]})

    def step() -> None:
        train(model, opt)

    return dk.find_leaks(step)


def clean_exception_handled_not_kept() -> dk.LeakReport:
    model = small()
    skipped = {"count": 0}

    def step() -> None:
        activation = model(X)
        try:
            raise ValueError(f"bad batch {activation.shape}")
        except ValueError:
            skipped["count"] += 1

    return dk.find_leaks(step)


CLEAN = {name[len("clean_"):]: fn for name, fn in list(globals().items()) if name.startswith("clean_")}
