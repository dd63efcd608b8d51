"""A tiny GPT-2 trained with ``transformers.Trainer``, checkpointed with pitstop.

    python examples/hf_gpt2.py --dir ckpts           # trains; rerun it after a kill: it resumes
    pitstop ls ckpts
    pitstop crashtest -- python examples/hf_gpt2.py --dir {dir}

Nothing is downloaded: the model is built from a config and the data are synthetic token
sequences (each counts from a random token by a random stride, so there is something to
learn) drawn from ``--seed``. AdamW with a linear warm-up schedule, dropout on, a logged loss
every 2 steps and an evaluation every ``--eval-every`` steps, all as the Trainer does them;
the lines pitstop adds are marked ``# pitstop``. The run ends with a committed checkpoint of
its last step in ``--dir`` (the Trainer's own output directory is ``DIR/trainer``; it stays
empty with ``save_strategy="no"``).

``--broken`` makes a common mistake: a quick loss check on one batch at the start of each
process, with the model still in train mode. Its dropout draws from the global generator
after the resume restored it, so a killed and resumed run ends with other weights than an
uninterrupted one; crashtest reports the difference and that the generators were drawn
outside the saved state.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from pitstop.integrations import hf  # pitstop

VOCAB, SEQ = 256, 32


class CountingSequences(Dataset[dict[str, torch.Tensor]]):
    """``size`` sequences ``s, s+d, s+2d, ... (mod VOCAB)`` with random s and d."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        stride = torch.randint(1, 8, (size, 1), generator=g)
        self.tokens = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Progress(TrainerCallback):
    """One line where training starts (step 0, or the step a resume continues from)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"training from step {state.global_step} of {state.max_steps}", flush=True)


class LossCheck(TrainerCallback):
    """--broken: the loss of one batch at the first step of each process, in train mode."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch, self.done = batch, False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.done:
            self.done = True
            with torch.no_grad():  # but dropout is on: it draws from the global generator
                loss = kwargs["model"](**self.batch).loss
            print(f"loss check at step {state.global_step}: {loss.item():.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="pitstop checkpoint root of the run")  # pitstop
    p.add_argument("--steps", type=int, default=24, help="optimizer steps in all")
    p.add_argument(  # pitstop
        "--every", type=int, default=4, help="checkpoint every N steps (0: pitstop's policy)"
    )
    p.add_argument("--eval-every", type=int, default=6, help="evaluate every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=64, help="training sequences (8 per batch)")
    p.add_argument("--broken", action="store_true", help="a loss check that draws after a resume")
    args = p.parse_args()
    torch.set_num_threads(1)  # the same kernels in every run
    set_seed(args.seed)

    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    train_set = CountingSequences(args.samples, seed=args.seed)
    eval_set = CountingSequences(16, seed=args.seed + 1)
    training_args = TrainingArguments(
        output_dir=os.path.join(args.dir, "trainer"),
        max_steps=args.steps, per_device_train_batch_size=8, per_device_eval_batch_size=16,
        learning_rate=1e-3, weight_decay=0.01, optim="adamw_torch",
        lr_scheduler_type="linear", warmup_steps=max(1, args.steps // 6),
        eval_strategy="steps", eval_steps=args.eval_every, logging_steps=2,
        save_strategy="no",  # pitstop: pitstop writes the checkpoints
        seed=args.seed, dataloader_num_workers=0, use_cpu=True,
        report_to=[], disable_tqdm=True,
    )  # fmt: skip
    ckpt = hf.PitstopCallback(args.dir, every=args.every or None, keep_last=3)  # pitstop
    callbacks: list[TrainerCallback] = [ckpt, Progress()]
    if args.broken:
        batch = {"input_ids": eval_set.tokens[:4], "labels": eval_set.tokens[:4]}
        callbacks.append(LossCheck(batch))
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
        callbacks=callbacks,
    )  # fmt: skip
    output = hf.train(trainer)  # pitstop: instead of trainer.train(); resumes from --dir
    print(f"done at step {output.global_step}, train_loss {output.training_loss!r}", flush=True)


if __name__ == "__main__":
    main()
