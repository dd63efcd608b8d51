"""Integrations: what a Lightning (or Hugging Face Trainer) user gains by letting pitstop write.

Usage::

    python benchmarks/integrations.py            # 16 x Linear(2048, 2048) + Adam (~805 MB), 3 rounds
    python benchmarks/integrations.py --quick    # 4 layers (~200 MB), a tiny GPT-2 (under a minute)
    python benchmarks/integrations.py --reps 5 --dir /data/tmp --no-hf

Default: ~268 MB of fp32 parameters (805 MB with Adam's moments) and a GPT-2 of 6 x 512
(~110 MB of parameters); ``--quick``: ~67 MB (201 MB) and 2 x 256. Written under the
current directory (``--dir`` to choose; use a real disk, not /dev/shm).

Lightning section. A LightningModule of ``--layers`` x Linear(width, width) is fitted for
one step with Adam, and ``trainer._checkpoint_connector.dump_checkpoint()`` gives the
checkpoint dict Lightning would save (weights, Adam moments, loops, hyperparameters). The
same dict (only ``global_step`` differs between saves: PitstopCheckpointIO names a step by
it) is saved through three CheckpointIO plugins, each used as the Trainer uses it:

* ``TorchCheckpointIO()``, Lightning's default: torch.save into memory, then the file;
  it never fsyncs, so its "durable" time adds an ``os.fsync`` of the file and of its
  directory (its stall does not: the loop does not wait for that with Lightning). The
  file is written through an fsspec transaction: a ``tempfile.mkstemp`` file in $TMPDIR,
  reopened with O_TRUNC, then moved to the path (a copy if $TMPDIR is another file
  system). On ext4 (``auto_da_alloc``) closing a truncated file starts its write-back,
  so most of the disk time lands inside ``save_checkpoint`` and the fsync adds little;
* ``AsyncCheckpointIO(TorchCheckpointIO())``: clones every tensor in the training
  thread, torch.save in a thread; durable = ``teardown()`` (waits for the thread) + the
  same fsyncs;
* ``PitstopCheckpointIO(root)``: copies the tensors into a host buffer and returns;
  persist, commit (fsynced) and the pointer file follow in the background; durable =
  ``teardown()``, which waits for the commit and the pointer.

Stall = the time ``save_checkpoint(checkpoint, path)`` takes to return (what the training
loop waits); durable = from the same start until the checkpoint is on disk. Each plugin
makes one untimed warm-up save (pitstop allocates its host buffer there; the figure is
reported), then ``--reps`` rounds run every plugin once, in a fresh seeded order per
round. Before every save, untimed, ``os.sync()`` writes back what earlier saves left
dirty; the page cache is dropped only with ``--drop-caches`` (it needs root, the machine
is shared, and a save reads nothing from disk), and the output says which; old
files are deleted outside the timings (pitstop's previous step is retired by its
retention, also outside the timings). The report gives medians and
``TorchCheckpointIO's median / this plugin's median`` (x faster, higher is better), and
the median of the per-round ratios in the JSON. After the timings each plugin's last
checkpoint is loaded once (``TorchCheckpointIO.load_checkpoint``, and
``PitstopCheckpointIO.load_checkpoint`` for pitstop's pointer) and compared with the
dict: tensors bit for bit, every other value with ``==``.

Hugging Face section (``--no-hf`` skips it; skipped when transformers is missing). A
GPT-2 built from a config (nothing downloaded) is trained one step with the Trainer
(AdamW, linear schedule). Timed, alternating: ``trainer._save_checkpoint`` (the Trainer's
own save: safetensors weights, torch.save of optimizer, scheduler and RNG, trainer
state; durable adds an fsync of every file written) against ``async_save`` of the state
``hf.PitstopCallback`` saves (model, optimizer, scheduler, RNG, Trainer progress, data
position; built by the callback, saved by its manager). For pitstop three figures: the
return of ``async_save``; "copied", after the next ``optimizer.step()`` returns (its
pre-hook waits for the parameters and optimizer state that ``async_save`` lets finish
copying while forward and backward run: the worst case, a step with no compute before
it; no gradients, so the step changes nothing); and durable, ``handle.wait()``. The
table's stall for pitstop is "copied", the conservative one.

stdout: the tables, then one JSON line with every median, ratio and the machine notes.
Progress goes to stderr. Memory: about 6 x the checkpoint at the default size (state,
clones, pitstop's host buffer, torch.save's in-memory copies); disk: 2 checkpoints per
plugin at most.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from _common import drop_caches, fsync_dir, fsync_tree, json_line, log, median

perf = time.perf_counter
MB = 1e6


# --------------------------------------------------------------------------- helpers


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure (each storage once)."""
    out: dict[tuple[int, int], torch.Tensor] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            out.setdefault((o.data_ptr(), o.numel() * o.element_size()), o)
        elif isinstance(o, Mapping):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return list(out.values())


def nbytes_of(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def differences(expected: Any, got: Any, path: str = "", limit: int = 5) -> list[str]:
    """Where ``got`` differs from ``expected`` (tensors bit for bit), at most ``limit`` paths."""
    out: list[str] = []

    def walk(e: Any, g: Any, p: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(e, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and bitwise_equal(e, g)):
                out.append(f"{p or '/'}: tensor differs")
        elif isinstance(e, Mapping):
            if not isinstance(g, Mapping) or set(e) != set(g):
                extra = sorted(map(str, set(g) - set(e))) if isinstance(g, Mapping) else []
                missing = sorted(map(str, set(e) - set(g))) if isinstance(g, Mapping) else []
                out.append(f"{p or '/'}: keys differ (missing {missing}, extra {extra})")
                return
            for k in e:
                walk(e[k], g[k], f"{p}/{k}")
        elif isinstance(e, (list, tuple)):
            if not isinstance(g, (list, tuple)) or len(e) != len(g):
                out.append(f"{p or '/'}: sequence differs")
                return
            for i, (x, y) in enumerate(zip(e, g)):
                walk(x, y, f"{p}/{i}")
        elif isinstance(e, float) and isinstance(g, float) and math.isnan(e) and math.isnan(g):
            return
        else:
            try:
                same = bool(e == g)
            except Exception:
                same = False
            if not same:
                out.append(f"{p or '/'}: {e!r} != {g!r}")

    walk(expected, got, path)
    return out


def fmt(x: float, spec: str = ".3f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


@dataclass
class Competitor:
    """One way of saving: ``save(step)`` returns the stall; ``durable(step)`` completes it."""

    key: str
    label: str
    save: Callable[[int], None]
    durable: Callable[[int], None]
    cleanup: Callable[[int], None]  # untimed: remove what ``step`` left (after the next save)
    verify: Callable[[int], list[str]]
    info_of: Callable[[int], dict[str, float]] | None = None
    before: Callable[[int], None] | None = None  # untimed, before every save of ``step``
    samples: dict[str, list[float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def add(self, **metrics: float) -> None:
        for k, v in metrics.items():
            self.samples.setdefault(k, []).append(float(v))

    def med(self, metric: str) -> float:
        return median(self.samples.get(metric, []))


class PageCache:
    """Before every save: write back what earlier saves left dirty (``sync``) and, with
    ``drop`` (--drop-caches), drop the page cache where permitted (root)."""

    def __init__(self, drop: bool) -> None:
        self.drop = drop
        self.dropped: list[bool] = []

    def settle(self) -> None:
        if self.drop:
            self.dropped.append(drop_caches())  # syncs first
        else:
            os.sync()

    def describe(self) -> str:
        if not self.drop:
            return "not dropped (needs root; --drop-caches to try), synced before every save"
        if self.dropped and all(self.dropped):
            return "synced and dropped before every save (--drop-caches)"
        return "not dropped (/proc/sys/vm/drop_caches not writable), synced before every save"


def one_save(c: Competitor, step: int, cache: PageCache) -> dict[str, float]:
    if c.before is not None:
        c.before(step)
    cache.settle()  # untimed
    t0 = perf()
    c.save(step)
    t1 = perf()
    c.durable(step)
    t2 = perf()
    out = {"stall": t1 - t0, "durable": t2 - t0}
    if c.info_of is not None:
        out.update(c.info_of(step))
    return out


def run_rounds(
    comps: list[Competitor], reps: int, first_step: int, seed: int, cache: PageCache
) -> list[list[str]]:
    """Warm-up (untimed, its figures kept in ``info``), then ``reps`` rounds in a fresh order."""
    for c in comps:
        log(f"  warm-up: {c.label}")
        m = one_save(c, first_step, cache)
        c.info["first_save"] = m
    rng = random.Random(seed)
    orders: list[list[str]] = []
    for r in range(reps):
        order = comps[:]
        rng.shuffle(order)
        orders.append([c.key for c in order])
        step = first_step + 1 + r
        for c in order:
            m = one_save(c, step, cache)
            c.add(**m)
            log(
                f"  round {r + 1}/{reps} {c.label}: stall {m['stall']:.3f} s, "
                f"durable {m['durable']:.3f} s"
            )
            c.cleanup(step - 1)
    return orders


def ratios(comps: list[Competitor], base_key: str, metrics: tuple[str, ...]) -> dict[str, Any]:
    """base median / median (x faster), and the median of per-round base / this."""
    base = next(c for c in comps if c.key == base_key)
    out: dict[str, Any] = {}
    for c in comps:
        for m in metrics:
            if m not in c.samples:
                continue
            b = base.samples.get(m) or base.samples["stall"]  # stall_return: vs the stall
            bm = median(b)
            out[f"{c.key}_{m}_x"] = bm / c.med(m) if c.med(m) > 0 else math.nan
            paired = [x / y for x, y in zip(b, c.samples[m]) if y > 0]
            out[f"{c.key}_{m}_x_paired"] = median(paired)
    return out


# --------------------------------------------------------------------------- Lightning


def lightning_checkpoint(layers: int, width: int) -> dict[str, Any]:
    """The dict Lightning saves for a module of ``layers`` x Linear + Adam after one step."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self, layers: int, width: int) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    pl.seed_everything(0, verbose=False)
    model = Net(layers, width)
    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = DataLoader(TensorDataset(torch.randn(8, width)), batch_size=8)
    with contextlib.redirect_stdout(sys.stderr):  # stdout: the tables and the JSON line
        trainer.fit(model, data)
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def lightning_section(args: argparse.Namespace, root: str, cache: PageCache) -> dict[str, Any]:
    import lightning
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from pitstop.integrations.lightning import PitstopCheckpointIO

    log(f"Lightning: fitting {args.layers} x Linear({args.width}, {args.width}) + Adam, 1 step")
    base = lightning_checkpoint(args.layers, args.width)
    nb = nbytes_of(base)
    params = nbytes_of(base["state_dict"])
    log(f"  checkpoint dict: {nb / MB:.0f} MB of tensors ({params / MB:.0f} MB parameters)")

    def ckpt(step: int) -> dict[str, Any]:
        return {**base, "global_step": step}

    comps: list[Competitor] = []

    # Lightning's own IO, synchronous and thread-based: the same file, fsynced when durable
    tio = TorchCheckpointIO()

    def lightning_io(key: str, label: str, io: Any, wait: Callable[[], None]) -> Competitor:
        where = os.path.join(root, key)

        def path(step: int) -> str:
            return _ckpt_file(root, key, step)

        def durable(step: int) -> None:
            wait()  # AsyncCheckpointIO: its save thread (the next save starts a new one)
            fsync_file(path(step))
            fsync_dir(where)

        return Competitor(
            key,
            label,
            save=lambda s: io.save_checkpoint(ckpt(s), path(s)),
            durable=durable,
            cleanup=lambda s: io.remove_checkpoint(path(s)),
            verify=lambda s: differences(ckpt(s), tio.load_checkpoint(path(s))),
        )

    aio = AsyncCheckpointIO(TorchCheckpointIO())
    comps.append(lightning_io("torch", "TorchCheckpointIO (+ fsync)", tio, lambda: None))
    comps.append(lightning_io("async", "AsyncCheckpointIO(Torch) (+ fsync)", aio, aio.teardown))

    # PitstopCheckpointIO --------------------------------------------------
    pdir = os.path.join(root, "pitstop")
    pio = PitstopCheckpointIO(pdir)

    def ppath(step: int) -> str:
        return os.path.join(pdir, f"epoch=0-step={step}.ckpt")

    handles: dict[int, Any] = {}

    def p_save(step: int) -> None:
        pio.save_checkpoint(ckpt(step), ppath(step))
        h = pio._handles.get(step)  # private: for the breakdown only
        if h is not None:
            handles[step] = (h, h.staged)

    def p_cleanup(step: int) -> None:
        # As ModelCheckpoint(save_top_k=1) does after a new save: the pointer goes; pitstop's
        # retention retires the step at teardown and deletes it on its purge thread. Waited
        # for here, outside the timings, so that the deletion does not overlap the next save.
        pio.remove_checkpoint(ppath(step))
        pio.teardown()
        purger = getattr(pio.manager.hooks.catalog, "_purger", None)
        if purger is not None:
            purger.submit(lambda: None).result()

    def p_info(step: int) -> dict[str, float]:
        h, staged = handles.get(step, (None, False))
        if h is None:
            return {}
        s = h.stats
        return {
            "engine_stall": s.stall_secs,
            "alloc": s.alloc_secs,
            "persist": s.persist_secs,
            "committed": s.total_secs,
            "write_gbps": s.write_gbps,
            "direct_io": float(s.direct_io),
            "staged_at_return": float(staged),
        }

    comps.append(
        Competitor(
            "pitstop",
            "PitstopCheckpointIO",
            save=p_save,
            durable=lambda s: pio.teardown(),
            cleanup=p_cleanup,
            verify=lambda s: differences(ckpt(s), pio.load_checkpoint(ppath(s))),
            info_of=p_info,
        )
    )

    try:
        orders = run_rounds(comps, args.reps, 0, args.seed, cache)
        last = args.reps
        log("  verifying the last checkpoint of each plugin")
        verified: dict[str, Any] = {}
        for c in comps:
            t0 = perf()
            diffs = c.verify(last)
            verified[c.key] = {"ok": not diffs, "differences": diffs, "secs": perf() - t0}
            log(f"  {c.label}: {diffs if diffs else 'equal'}")
        sizes = {
            "torch_file_bytes": os.path.getsize(_ckpt_file(root, "torch", last)),
            "async_file_bytes": os.path.getsize(_ckpt_file(root, "async", last)),
            "pitstop_dir_bytes": _du(pdir),
        }
    finally:
        with contextlib.suppress(Exception):
            aio.teardown()
        pio.close()

    r = ratios(comps, "torch", ("stall", "durable"))
    out_table(
        f"Lightning CheckpointIO: {args.layers} x Linear({args.width}, {args.width}) + Adam, "
        f"dict of {nb / MB:.0f} MB tensors ({params / MB:.0f} MB parameters), "
        f"{args.reps} rounds, medians",
        comps,
        r,
        verified,
        "TorchCheckpointIO",
    )
    tc, pc = comps[0], comps[2]
    fsync_extra = median([d - s for s, d in zip(tc.samples["stall"], tc.samples["durable"])])
    print(
        f"TorchCheckpointIO: the fsync after save_checkpoint added {fmt(fsync_extra)} s (median); "
        f"fsspec writes a mkstemp file in {tempfile.gettempdir()} ({_filesystem(tempfile.gettempdir())}) "
        "and moves it into place"
    )
    print(
        f"pitstop: stall in the engine {fmt(pc.med('engine_stall'))} s, persist after staging "
        f"{fmt(pc.med('persist'))} s at {fmt(pc.med('write_gbps'), '.2f')} GB/s (O_DIRECT "
        f"{'yes' if pc.med('direct_io') == 1 else 'no'}), committed {fmt(pc.med('committed'))} s "
        f"after the call; all bytes copied when save_checkpoint returned: "
        f"{'yes' if pc.med('staged_at_return') == 1 else 'no'}"
    )
    print(
        "first (warm-up) save, stall / durable s: "
        + ", ".join(
            f"{c.label} {fmt(c.info['first_save']['stall'])} / "
            f"{fmt(c.info['first_save']['durable'])}"
            for c in comps
        )
        + " (pitstop's first save allocates its host buffer)"
    )
    config = {
        "layers": args.layers,
        "width": args.width,
        "tensor_bytes": nb,
        "parameter_bytes": params,
        "lightning": lightning.__version__,
        **sizes,
    }
    return _section(config, comps, r, orders, verified)


def _section(
    config: dict[str, Any], comps: list[Competitor], r: Any, orders: Any, verified: Any
) -> dict[str, Any]:
    """One section of the final JSON line: the set-up and every competitor's figures."""
    return {
        "config": config,
        "medians": {c.key: {k: c.med(k) for k in c.samples} for c in comps},
        "ratios": r,
        "first_save": {c.key: c.info["first_save"] for c in comps},
        "samples": {c.key: c.samples for c in comps},
        "orders": orders,
        "verified": verified,
    }


def _ckpt_file(root: str, key: str, step: int) -> str:
    return os.path.join(root, key, f"epoch=0-step={step}.ckpt")


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(d, f))
    return total


def out_table(
    title: str, comps: list[Competitor], r: dict[str, Any], verified: dict[str, Any], base: str
) -> None:
    print()
    print(title)
    print(f"(x = {base} median / this median: higher is better)")
    head = (
        f"{'':38s} {'stall s':>9s} {'durable s':>10s} {'stall x':>8s} {'durable x':>10s}  read back"
    )
    print(head)
    print("-" * len(head))
    for c in comps:
        v = verified.get(c.key, {})
        ok = "equal" if v.get("ok") else ("DIFFERS" if v else "-")
        print(
            f"{c.label:38s} {fmt(c.med('stall')):>9s} {fmt(c.med('durable')):>10s} "
            f"{fmt(r.get(f'{c.key}_stall_x', math.nan), '.2f'):>8s} "
            f"{fmt(r.get(f'{c.key}_durable_x', math.nan), '.2f'):>10s}  {ok}"
        )


# --------------------------------------------------------------------------- Hugging Face


def hf_section(args: argparse.Namespace, root: str, cache: PageCache) -> dict[str, Any]:
    import transformers
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from pitstop.integrations import hf

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    class Tokens(Dataset[dict[str, torch.Tensor]]):
        def __init__(self, n: int, seq: int, vocab: int) -> None:
            self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    log(
        f"HF: GPT-2 n_layer={args.hf_layers} n_embd={args.hf_width} vocab={args.hf_vocab}, "
        "one Trainer step"
    )
    transformers.set_seed(0)
    config = GPT2Config(
        vocab_size=args.hf_vocab,
        n_positions=64,
        n_embd=args.hf_width,
        n_layer=args.hf_layers,
        n_head=max(1, args.hf_width // 64),
    )
    model = GPT2LMHeadModel(config)
    out_dir = os.path.join(root, "hf_trainer")
    targs = TrainingArguments(
        output_dir=out_dir,
        max_steps=1,
        per_device_train_batch_size=4,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(8, 32, args.hf_vocab))
    with contextlib.redirect_stdout(sys.stderr):  # it prints its metrics
        trainer.train()
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else None
    inner = inner or trainer.optimizer
    for p in model.parameters():
        p.grad = None  # so that the optimizer.step() below changes nothing
    state_nb = nbytes_of(model.state_dict()) + nbytes_of(inner.state_dict())
    params_nb = nbytes_of(model.state_dict())
    log(f"  model {params_nb / MB:.0f} MB, model + optimizer {state_nb / MB:.0f} MB")

    def tdir(step: int) -> str:  # the Trainer names it by its global_step (1): the same each time
        return os.path.join(out_dir, f"checkpoint-{trainer.state.global_step}")

    def t_save(step: int) -> None:
        trainer._save_checkpoint(trainer.model, trial=None)

    def t_before(step: int) -> None:
        shutil.rmtree(tdir(step), ignore_errors=True)

    def t_verify(step: int) -> list[str]:
        from safetensors.torch import load_file

        d = tdir(step)
        weights = load_file(os.path.join(d, "model.safetensors"))
        sd = model.state_dict()
        diffs = differences({k: sd[k] for k in weights}, weights, "/model.safetensors")
        opt = torch.load(os.path.join(d, "optimizer.pt"), weights_only=True)
        return diffs + differences(inner.state_dict(), opt, "/optimizer.pt")

    trainer_c = Competitor(
        "trainer",
        "Trainer._save_checkpoint (+ fsync)",
        save=t_save,
        durable=lambda s: fsync_tree(tdir(s)),
        cleanup=lambda s: None,  # the next save's ``before`` removes it
        verify=t_verify,
        before=t_before,
    )

    cb = hf.PitstopCallback(os.path.join(root, "hf_pitstop"), keep_last=1)
    cb.open(trainer)
    assert cb.manager is not None
    mgr = cb.manager
    state = cb._build_state(trainer, trainer.get_train_dataloader())  # what it saves
    pending: dict[int, Any] = {}
    returned: dict[int, float] = {}
    copy_wait: dict[int, float] = {}

    def p_save(step: int) -> None:
        t0 = perf()
        pending[step] = mgr.async_save(step, state)
        t1 = perf()
        inner.step()  # the next step's pre-hook waits for the deferred copies
        returned[step], copy_wait[step] = t1 - t0, perf() - t1

    def p_durable(step: int) -> None:
        pending[step].wait()

    def p_info(step: int) -> dict[str, float]:
        h = pending.pop(step)
        return {
            "return": returned.pop(step),
            "engine_stall": h.stats.stall_secs,
            "copy_wait": copy_wait.pop(step),
            "committed": h.stats.total_secs,
            "persist": h.stats.persist_secs,
        }

    def p_verify(step: int) -> list[str]:
        got = mgr.load(step)
        return differences(model.state_dict(), got["model"], "/model") + differences(
            inner.state_dict(), got["optimizer"], "/optimizer"
        )

    def p_clean(step: int) -> None:
        purger = getattr(mgr.hooks.catalog, "_purger", None)  # keep_last=1 retired it at the commit
        if purger is not None:
            purger.submit(lambda: None).result()

    pitstop_c = Competitor(
        "pitstop",
        "PitstopCallback's async_save",
        save=p_save,
        durable=p_durable,
        cleanup=p_clean,
        verify=p_verify,
        info_of=p_info,
    )
    comps = [trainer_c, pitstop_c]
    try:
        orders = run_rounds(comps, args.reps, 1000, args.seed + 1, cache)
        log("  verifying the last checkpoint of each")
        verified: dict[str, Any] = {}
        for c in comps:
            diffs = c.verify(1000 + args.reps)
            verified[c.key] = {"ok": not diffs, "differences": diffs}
            log(f"  {c.label}: {diffs if diffs else 'equal'}")
    finally:
        cb.close()

    # pitstop's stall as save_checkpoint measures it includes the copy wait (see p_save);
    # split it into what async_save returned after and the rest.
    ret = pitstop_c.samples.get("return", [])
    pitstop_c.samples["stall_return"] = ret
    r = ratios(comps, "trainer", ("stall", "stall_return", "durable"))
    out_table(
        f"Hugging Face Trainer: GPT-2 (n_layer {args.hf_layers}, n_embd {args.hf_width}, vocab "
        f"{args.hf_vocab}) + AdamW, {state_nb / MB:.0f} MB model + optimizer "
        f"({params_nb / MB:.0f} MB parameters), {args.reps} rounds, medians",
        comps,
        r,
        verified,
        "Trainer._save_checkpoint",
    )
    print(
        f"pitstop stall = async_save return {fmt(pitstop_c.med('return'))} s "
        f"(x {fmt(r.get('pitstop_stall_return_x', math.nan), '.1f')} vs the Trainer) + the "
        f"next optimizer.step() waiting for the deferred copy {fmt(pitstop_c.med('copy_wait'))} s "
        "(the worst case: in training, forward and backward hide it)"
    )
    config = {
        "n_layer": args.hf_layers,
        "n_embd": args.hf_width,
        "vocab": args.hf_vocab,
        "model_optimizer_bytes": state_nb,
        "parameter_bytes": params_nb,
        "transformers": transformers.__version__,
    }
    return _section(config, comps, r, orders, verified)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 16; --quick 4)")
    p.add_argument("--width", type=int, default=2048, help="features per layer (default 2048)")
    p.add_argument("--reps", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--quick", action="store_true", help="~64 MB of parameters, a tiny GPT-2")
    p.add_argument(
        "--dir",
        default=None,
        help="parent of the scratch directory (default: the current directory; not /dev/shm)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face Trainer section")
    p.add_argument(
        "--hf-layers", type=int, default=None, help="GPT-2 n_layer (default 6; --quick 2)"
    )
    p.add_argument(
        "--hf-width", type=int, default=None, help="GPT-2 n_embd (default 512; --quick 256)"
    )
    p.add_argument(
        "--hf-vocab", type=int, default=None, help="GPT-2 vocabulary (default 16384; --quick 4096)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the round orders")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="also drop the page cache before every save (needs root; it is synced either way)",
    )
    args = p.parse_args(argv)
    args.layers = args.layers or (4 if args.quick else 16)
    args.hf_layers = args.hf_layers or (2 if args.quick else 6)
    args.hf_width = args.hf_width or (256 if args.quick else 512)
    args.hf_vocab = args.hf_vocab or (4096 if args.quick else 16384)
    if min(args.layers, args.width, args.reps, args.hf_layers, args.hf_width, args.hf_vocab) < 1:
        p.error("sizes and --reps must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = perf()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")  # Lightning's and transformers' advice on workers etc.
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pitstop"):
        logging.getLogger(name).setLevel(logging.ERROR)
    parent = os.path.abspath(args.dir or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="pitstop-bench-integrations-", dir=parent)
    fs = _filesystem(root)
    cache = PageCache(args.drop_caches)
    result: dict[str, Any] = {}
    try:
        result["lightning"] = lightning_section(args, root, cache)
        if args.no_hf:
            result["hf"] = {"skipped": "--no-hf"}
        else:
            try:
                import transformers  # noqa: F401
            except ImportError as e:
                result["hf"] = {"skipped": f"transformers missing: {e}"}
            else:
                result["hf"] = hf_section(args, root, cache)
        if "skipped" in result["hf"]:
            print(f"\nHugging Face section skipped: {result['hf']['skipped']}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cache_note = cache.describe()
    machine = {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_end": list(os.getloadavg()),
        "dir": root,
        "filesystem": fs,
        "page_cache": cache_note,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "run_secs": perf() - t_start,
    }
    print()
    print(
        f"machine: {machine['cpus']} cpus ({machine['cpus_usable']} usable, shared), wrote under "
        f"{parent} ({fs}); page cache {cache_note}; run {machine['run_secs']:.0f} s"
    )
    summary: dict[str, Any] = {}
    for sec, keys in (("lightning", ("torch", "async", "pitstop")), ("hf", ("trainer", "pitstop"))):
        med = result[sec].get("medians", {})
        for k in keys:
            if k in med:
                summary[f"{sec}_{k}_stall_secs"] = med[k].get("stall", math.nan)
                summary[f"{sec}_{k}_durable_secs"] = med[k].get("durable", math.nan)
        for k, v in result[sec].get("ratios", {}).items():
            if not k.endswith("_paired") and not k.startswith(("torch_", "trainer_")):
                summary[f"{sec}_{k}"] = v
    print(json_line({"summary": summary, "machine": machine, "quick": args.quick, **result}))
    return 0


def _filesystem(path: str) -> str:
    """The mount (device, type) holding ``path``, from /proc/mounts."""
    best = ("", "?", "?")
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(
                    best[0]
                ):
                    best = (mnt, dev, typ)
    except OSError:
        pass
    return f"{best[1]} {best[2]} on {best[0]}"


if __name__ == "__main__":
    sys.exit(main())
