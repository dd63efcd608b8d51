"""The README's loop under torchrun with a DDP model and a ResumableLoader (run by
test_torchrun.py, not collected). Every rank writes its final weights' digest to
``<out>/rank<r>.txt``. With ``--hang-at N`` the ranks stop in the middle of step N (after
backward, before the optimizer step), write ``<out>/hanging<rank>`` (their pid), and wait to be killed."""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pitstop
from pitstop.policy import EveryN


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--hang-at", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(72, 8, generator=gen), torch.randn(72, 1, generator=gen)
    )
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    loader = pitstop.ResumableLoader(dataset, batch_size=4, shuffle=True, seed=3)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader,
             "rng": pitstop.RNGState(), "progress": {"step": 0}}  # fmt: skip
    with pitstop.CheckpointManager(
        args.ckpt,
        keep_last=3,
        policy=EveryN(3),
        options=pitstop.SaveOptions.from_env(dist_timeout_secs=30),
    ) as ckpt:
        resumed = ckpt.restore(state)
        while state["progress"]["step"] < args.steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                if state["progress"]["step"] + 1 == args.hang_at:
                    with open(os.path.join(args.out, f"hanging{rank}"), "w") as f:
                        f.write(str(os.getpid()))
                    while True:
                        time.sleep(1)
                opt.step()
                sched.step()
                state["progress"]["step"] += 1
                ckpt.step(state["progress"]["step"], state, loss=loss.item())
                if state["progress"]["step"] >= args.steps:
                    break
        ckpt.wait()
        if ckpt.latest_step() != state["progress"]["step"]:
            ckpt.save(state["progress"]["step"], state)
    weights = b"".join(t.detach().numpy().tobytes() for t in model.module.state_dict().values())
    with open(os.path.join(args.out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{resumed} {hashlib.sha256(weights).hexdigest()}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
