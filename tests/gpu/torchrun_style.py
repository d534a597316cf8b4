"""A training script written for torchrun, with nothing of devicekit in it.

``devicekit run --gpus 1 -- python tests/gpu/torchrun_style.py`` must run it unchanged:
LOCAL_RANK, nccl and a DistributedSampler, as the PyTorch DDP tutorial writes them. Prints
``RESULT world=<n> device=<cuda:i> uuid=<uuid> loss=<first>-><last>`` from rank 0.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x @ torch.randn(32, 1, generator=g)).squeeze(1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=128, sampler=sampler)
    model = DistributedDataParallel(nn.Linear(32, 1).to(device), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = nn.functional.mse_loss(model(xb).squeeze(1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    if dist.get_rank() == 0:
        first, last = losses[0].item(), losses[-1].item()
        uuid = torch.cuda.get_device_properties(device).uuid
        print(f"RESULT world={dist.get_world_size()} device={device} uuid={uuid} "
              f"loss={first:.4f}->{last:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
