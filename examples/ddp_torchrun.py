"""Data-parallel training under torchrun, checkpointed with pitstop (gloo on CPU, NCCL on GPU).

    torchrun --nproc_per_node=2 examples/ddp_torchrun.py --dir ckpts
    pitstop crashtest -- torchrun --nproc_per_node=2 examples/ddp_torchrun.py --dir {dir}
    torchrun --nproc_per_node=2 examples/ddp_torchrun.py --dir ckpts --memory   # + memory level

Every rank builds the same manager on the same directory; the calls are collective (same
steps on every rank). The ranks split the writing of the replicated model and optimizer,
each saves its own data position and random streams, and one manifest commits the step
when every rank's bytes are durable. A rerun after a crash resumes every rank where it was.
The lines pitstop adds are marked ``# pitstop``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pitstop  # pitstop


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, help="checkpoint directory (shared by the ranks)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory",
        action="store_true",
        help="a memory snapshot every step too (pitstop.Memory() before the disk)",
    )
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed + 1)
    x, w = torch.randn(512, 16, generator=g), torch.randn(16, 1, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x @ w + 0.1 * torch.randn(512, 1, generator=g))
    model = DDP(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)).to(device),
        device_ids=[device] if cuda else None,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    loader = pitstop.ResumableLoader(
        dataset, batch_size=16, shuffle=True, seed=args.seed
    )  # pitstop
    state = {  # pitstop
        "model": model, "optimizer": opt, "scheduler": sched, "data": loader,
        "rng": pitstop.RNGState(), "progress": {"step": 0},
    }  # fmt: skip
    policy = pitstop.policy.EveryN(args.every)
    root = args.dir  # pitstop: or memory first (every step), the disk every `every` steps
    if args.memory:
        root = [pitstop.Memory(), pitstop.Local(args.dir, redundancy="single", keep_last=2)]
    with pitstop.CheckpointManager(root, keep_last=2, policy=policy) as ckpt:  # pitstop
        ckpt.restore(state)  # pitstop: every rank, the same step
        while state["progress"]["step"] < args.steps:
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                state["progress"]["step"] += 1
                last = state["progress"]["step"] >= args.steps  # pitstop: left to save_final
                ckpt.step(state["progress"]["step"], state, loss=loss.item(), last=last)  # pitstop
                if last:
                    break
        ckpt.save_final(state["progress"]["step"], state)  # pitstop: the final state
    if dist.get_rank() == 0:
        print(f"done: step {state['progress']['step']}, loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
