"""pytorch/examples' MNIST script, checkpointed with pitstop, on a synthetic data set.

The structure is that of https://github.com/pytorch/examples/blob/main/mnist/main.py (Net,
train, test, Adadelta, StepLR, a train and a test loader, a log line per interval); the
lines pitstop adds are marked ``# pitstop``. The data is made up (no download): 28x28 images
whose class is where a bright blob sits, so the net does learn.

    python examples/mnist.py --dir ckpts            # trains; rerun it after a kill: it resumes
    pitstop crashtest -- python examples/mnist.py --dir {dir} --epochs 2

pitstop's default policy chooses when to checkpoint from what it measures (``--every N``:
every N steps instead). The last step is left to ``ckpt.save_final``, after the last
``test()`` and ``scheduler.step()``: the final checkpoint is the same whichever steps the
policy took.

``--broken`` makes a common mistake: the test loader has the settings of the original
script on a GPU (``num_workers=1, persistent_workers=True``) and no generator of its own. Its
first pass in each process draws a base seed for its worker from the global generator, which
the checkpoint does not know about: a run resumed after the first epoch draws where the
uninterrupted one did not, and its random streams shift (a resume in the first epoch does
not show it). crashtest resumes in a later epoch too, reports the difference and names the
cause.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset

import pitstop  # pitstop


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(2304, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


class SyntheticMNIST(Dataset[tuple[torch.Tensor, int]]):
    """``size`` noisy 1x28x28 images; the class is which of 10 places holds a bright blob."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (size,), generator=g)
        self.images = 0.3 * torch.randn(size, 1, 28, 28, generator=g)
        for i, label in enumerate(self.labels.tolist()):
            r, c = 3 + 8 * (label // 4), 3 + 7 * (label % 4)
            self.images[i, 0, r : r + 5, c : c + 5] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return (self.images[i] - 0.1307) / 0.3081, int(self.labels[i])


def train(args, model, train_loader, optimizer, epoch, state, ckpt) -> None:  # type: ignore[no-untyped-def]
    model.train()
    start = train_loader.position  # pitstop: the batch a resumed epoch starts at
    for batch_idx, (data, target) in enumerate(train_loader, start=start):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        state["progress"]["step"] += 1  # pitstop
        last = epoch == args.epochs and batch_idx == len(train_loader) - 1  # pitstop
        ckpt.step(state["progress"]["step"], state, loss=loss.item(), last=last)  # pitstop
        if batch_idx % args.log_interval == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} "
                f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}",
                flush=True,
            )


def test(model, test_loader) -> None:  # type: ignore[no-untyped-def]
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += int(output.argmax(dim=1).eq(target).sum())
    n = len(test_loader.dataset)
    print(
        f"Test set: Average loss: {test_loss / n:.4f}, Accuracy: {correct}/{n} ({100.0 * correct / n:.0f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (synthetic data)")
    parser.add_argument("--dir", required=True, help="checkpoint directory")  # pitstop
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--test-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument(  # pitstop
        "--every", type=int, default=0, help="checkpoint every N steps (0: pitstop's policy)"
    )
    parser.add_argument("--workers", type=int, default=0, help="train loader workers")
    parser.add_argument(
        "--broken", action="store_true", help="persistent test loader without a generator"
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the same kernels in every run

    train_set = SyntheticMNIST(args.train_size, seed=args.seed)
    test_set = SyntheticMNIST(args.test_size, seed=args.seed + 1)
    train_loader = pitstop.ResumableLoader(  # pitstop: instead of DataLoader
        train_set, batch_size=args.batch_size, shuffle=True, seed=args.seed,
        num_workers=args.workers,
    )  # fmt: skip
    if args.broken:  # the original GPU settings: its first pass draws from the global generator
        test_loader = DataLoader(
            test_set, batch_size=args.test_batch_size, num_workers=1, persistent_workers=True
        )
    else:  # its own generator: evaluation leaves the training's random streams alone
        test_loader = DataLoader(
            test_set, batch_size=args.test_batch_size, shuffle=True,
            generator=torch.Generator().manual_seed(args.seed),
        )  # fmt: skip

    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    state = {  # pitstop: everything a resume needs
        "model": model, "optimizer": optimizer, "scheduler": scheduler, "data": train_loader,
        "rng": pitstop.RNGState(), "progress": {"step": 0},
    }  # fmt: skip
    policy = pitstop.policy.EveryN(args.every) if args.every else None  # pitstop
    with pitstop.CheckpointManager(args.dir, keep_last=2, policy=policy) as ckpt:  # pitstop
        ckpt.restore(state)  # pitstop: newest valid checkpoint, if any
        while train_loader.epoch < args.epochs:  # pitstop: was `for epoch in range(...)`
            epoch = train_loader.epoch + 1
            train(args, model, train_loader, optimizer, epoch, state, ckpt)
            ckpt.pause()  # pitstop: evaluation is not training time
            test(model, test_loader)
            scheduler.step()
        ckpt.save_final(state["progress"]["step"], state)  # pitstop: the state after all that


if __name__ == "__main__":
    main()
