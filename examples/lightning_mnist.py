"""An MNIST-shaped LightningModule on a synthetic data set, checkpointed with pitstop.

The lines pitstop adds are marked ``# pitstop``. The data is made up from a fixed seed (no
download): 28x28 images whose class is where a bright blob sits. Rerunning the same command
with the same ``--dir`` resumes from the newest checkpoint ("last"); every run ends with a
committed checkpoint of its final step in DIR.

    python examples/lightning_mnist.py --dir ckpts --steps 80 --every 10
    pitstop crashtest -- python examples/lightning_mnist.py --dir {dir}

``--broken`` makes a common mistake: the validation loader shuffles without a generator of
its own (``shuffle=True``), so every validation draws from the global generator. After a
resume, the validation that followed the restored checkpoint is not run again (Lightning
skips it), the dropout masks after it shift, and the final weights differ from those of an
uninterrupted run; crashtest reports the difference.
"""

from __future__ import annotations

import argparse
import os
import warnings

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

import pitstop  # pitstop
from pitstop.integrations.lightning import PitstopCallback, PitstopCheckpointIO  # pitstop


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


class LitMNIST(L.LightningModule):
    def __init__(self, seed: int, batch_size: int, broken: bool, lr: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(8 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)
        self.train_set = SyntheticMNIST(2000, seed=seed)
        self.val_set = SyntheticMNIST(256, seed=seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        data, target = batch
        return F.nll_loss(self(data), target)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        data, target = batch
        self.log("val_loss", F.nll_loss(self(data), target))

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.Adadelta(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}  # stepped once per epoch

    def train_dataloader(self) -> pitstop.ResumableLoader:
        return pitstop.ResumableLoader(  # pitstop: resumes mid-epoch at the next batch
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True,
            seed=self.hparams.seed,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, int]]:
        if self.hparams.broken:  # draws from the global generator at every validation
            return DataLoader(self.val_set, batch_size=256, shuffle=True)
        # its own generator: validation leaves the training's random streams alone
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(self.val_set, batch_size=256, generator=generator)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Lightning MNIST (synthetic) with pitstop")
    parser.add_argument("--dir", required=True, help="the pitstop root (and ModelCheckpoint's)")
    parser.add_argument("--steps", type=int, default=80, help="max_steps")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every K train steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--broken", action="store_true", help="validation loader draws globally")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*(does not have many workers|LeafSpec|shuffling).*")
    torch.set_num_threads(1)  # the same kernels in every run
    L.seed_everything(args.seed, verbose=False)

    io = PitstopCheckpointIO(args.dir)  # pitstop: one root for the whole run
    trainer = L.Trainer(
        max_steps=args.steps, val_check_interval=args.every, check_val_every_n_epoch=None,
        accelerator="cpu", devices=1, deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        plugins=[io],  # pitstop
        callbacks=[
            PitstopCallback(),  # pitstop: RNG streams, crash-test hook
            ModelCheckpoint(
                dirpath=args.dir, every_n_train_steps=args.every, save_top_k=1, save_last=True
            ),
        ],
    )  # fmt: skip
    model = LitMNIST(args.seed, args.batch_size, args.broken)
    trainer.fit(model, ckpt_path="last")  # resumes from DIR/last.ckpt when there is one
    if io.manager.latest_step() != trainer.global_step:  # pitstop: the final state as well
        trainer.save_checkpoint(os.path.join(args.dir, "final.ckpt"))
    io.close()  # pitstop: durable when it returns
    print(f"done: step {trainer.global_step}, checkpoints {io.manager.steps()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
