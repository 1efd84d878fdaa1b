"""Train the tiny GPT under emulated FP8 with the fp8scope monitor, optionally with planted failures.

This is the engine behind ``examples/train_tiny_gpt.py`` and the benchmarks:

* :func:`build_parser` / :func:`parse_args` - the CLI options (shared with the example);
* :func:`build` - model, data, FP8 conversion, injector, optimizer from parsed args,
  no argv needed (tests and benchmarks call it with keyword overrides);
* :func:`train_steps` - the loop, with or without a monitor, returning timings;
* :func:`main` - the CLI entry point.

The loop avoids host syncs on CUDA (loss, grad norm and lr go to the monitor as
tensors/floats); it reads ``loss.item()`` only when it prints, plus one cheap
non-finite check so a run that went NaN stops a few steps later instead of
burning its whole budget.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .corpus import Batches, CharTokenizer, make_data
from .inject import Injector, parse_spec
from .tiny_gpt import GPTConfig, TinyGPT

FP8_CHOICES = ("delayed", "current", "off")


# --- arguments -------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """All options of the demo; the example script reuses this parser unchanged."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a tiny char-level GPT under emulated FP8 and record it with fp8scope.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--run-dir", default="runs/tiny-gpt", help="where the monitor writes the run")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--lr-cycles", type=int, default=1,
                   help="cosine cycles after the warm-up, each restarting at the peak lr (warm restarts)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps, max 50)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max total grad norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (0 = torch's default). On a shared, busy machine "
                        "--threads 1 can be many times faster: idle-spinning OpenMP threads fight")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of the non-FP8 math (bfloat16 = autocast, fp32 master weights)")
    p.add_argument("--fp8", choices=FP8_CHOICES, default="delayed",
                   help="scaling recipe; off = plain model, the monitor then logs what-if FP8 stats")
    p.add_argument("--amax-history-len", type=int, default=16)
    p.add_argument("--margin", type=float, default=0)
    p.add_argument("--fp8-skip", action="append", default=None, metavar="LAYER",
                   help="keep this Linear in high precision (repeatable; default: lm_head)")
    p.add_argument("--every", type=int, default=10, help="monitor: full statistics every N steps")
    p.add_argument("--whatif-recipes", default="", metavar="R1,R2",
                   help="monitor: also measure these recipes on full-stats steps (current, mxfp8, block128, nvfp4, "
                        "bf16; 'all': every one), for `fp8scope whatif` and the dashboard's Recipes view")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC", type=_inject_arg,
                   help="plant an instability: outlier:LAYER:STEP[:FACTOR[:DURATION]], nan:LAYER:STEP, "
                        "gradscale:LAYER:STEP[:FACTOR], lr:STEP[:FACTOR] (repeatable)")
    p.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    p.add_argument("--after-nan", type=int, default=5,
                   help="steps to keep training after the loss first becomes non-finite")
    p.add_argument("--corpus-chars", type=int, default=200_000, help="size of the generated corpus")
    p.add_argument("--quiet", action="store_true", help="no progress bar or loss lines")
    p.add_argument("--no-monitor", action="store_true", help="train without fp8scope.Monitor (benchmarks)")
    p.add_argument("--overwrite", action="store_true", help="delete --run-dir before starting")
    p.add_argument("--shadow-every", type=int, default=0, metavar="K",
                   help="fp8scope.Shadow: re-run every K-th step with FP8 off and compare per layer (0 = off)")
    p.add_argument("--fork-every", type=int, default=0, metavar="K",
                   help="fp8scope.Shadow: every K steps fork a BF16 replica for --fork-steps steps (0 = off)")
    p.add_argument("--fork-steps", type=int, default=20, metavar="N", help="steps a BF16 fork runs")
    return p


def _inject_arg(text: str) -> str:
    """argparse type: validate the spec early so a typo fails before the model is built."""
    try:
        parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def default_args(**overrides: Any) -> argparse.Namespace:
    """The CLI defaults as a Namespace, with keyword overrides (``n_layers=2``, ``fp8="off"``)."""
    args = parse_args([])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise TypeError(f"unknown option {k!r}")
        setattr(args, k, v)
    return args


# --- construction ----------------------------------------------------------------------------


def make_recipe(args: argparse.Namespace):
    """The fp8scope.emulate recipe for ``--fp8`` (None for ``off``)."""
    if args.fp8 == "off":
        return None
    from fp8scope.emulate import CurrentScaling, DelayedScaling

    if args.fp8 == "delayed":
        margin = int(args.margin) if float(args.margin).is_integer() else args.margin
        return DelayedScaling(margin=margin, amax_history_len=args.amax_history_len)
    if args.fp8 == "current":
        return CurrentScaling()
    raise ValueError(f"--fp8 must be one of {FP8_CHOICES}, got {args.fp8!r}")


@dataclass
class Setup:
    """Everything a training loop needs; produced by :func:`build`."""

    args: argparse.Namespace
    cfg: GPTConfig
    model: TinyGPT
    tokenizer: CharTokenizer
    batches: Batches
    val_batches: Batches
    optimizer: torch.optim.Optimizer
    injector: Injector
    recipe: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def lr_at(self, step: int) -> float:
        """Scheduled lr at ``step`` times any active ``lr:`` injection."""
        a = self.args
        return lr_schedule(step, a.lr, a.steps, warmup_steps(a), cycles=a.lr_cycles) * self.injector.lr_scale(step)

    def meta(self) -> dict[str, Any]:
        """Run metadata for the monitor: config, recipe, and what was planted (for the report)."""
        a = self.args
        return {
            "model": "tiny-gpt",
            "config": asdict(self.cfg),
            "n_params": sum(p.numel() for p in self.model.parameters()),
            "fp8": a.fp8,
            "amax_history_len": a.amax_history_len if a.fp8 == "delayed" else None,
            "margin": a.margin,
            "fp8_skip": list(a.fp8_skip or ["lm_head"]) if a.fp8 != "off" else [],
            "dtype": a.dtype,
            "device": str(self.device),
            "seed": a.seed,
            "steps": a.steps,
            "batch_size": a.batch_size,
            "lr": a.lr,
            "inject": self.injector.specs,
            "planted_by": "fp8scope.demo",  # the report shows "inject" as plants only with this mark
        }

    def autocast(self):
        """bf16 autocast context for ``--dtype bfloat16``; a no-op for float32."""
        if self.args.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def warmup_steps(args: argparse.Namespace) -> int:
    return args.warmup if args.warmup is not None else min(50, max(1, args.steps // 10))


def lr_schedule(step: int, peak: float, total: int, warmup: int, floor: float = 0.1, cycles: int = 1) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``floor * peak`` at ``total``; with ``cycles`` > 1
    the decay runs that many times, each restarting at ``peak`` (``transformers``' cosine with hard
    restarts, to a floor)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cycles > 1 and progress < 1.0:
        progress = (cycles * progress) % 1.0
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def build(args: argparse.Namespace | None = None, **overrides: Any) -> Setup:
    """Model, data, FP8 conversion, injection hooks and optimizer, from args (or defaults + overrides).

    Order matters: convert to FP8 *before* attaching the injector (conversion
    replaces the Linear modules, hooks on the old ones would vanish) and build
    the optimizer last, over the parameters of the converted model.
    """
    if args is None:
        args = default_args(**overrides)
    elif overrides:
        args = argparse.Namespace(**{**vars(args), **overrides})
    device = torch.device(args.device)
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tok, train_ids, val_ids = make_data(args.corpus_chars, seed=args.seed)
    cfg = GPTConfig(vocab=tok.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                    n_heads=args.n_heads, seq_len=args.seq_len)
    model = TinyGPT(cfg, seed=args.seed).to(device)

    recipe = make_recipe(args)
    if recipe is not None:
        from fp8scope.emulate import convert_to_fp8

        convert_to_fp8(model, recipe=recipe, skip=list(args.fp8_skip or ["lm_head"]))

    injector = Injector(args.inject).attach(model)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    return Setup(
        args=args, cfg=cfg, model=model, tokenizer=tok,
        batches=Batches(train_ids, args.batch_size, args.seq_len, seed=args.seed, device=device),
        val_batches=Batches(val_ids, args.batch_size, args.seq_len, seed=args.seed + 1, device=device),
        optimizer=optimizer, injector=injector, recipe=recipe, device=device,
    )


# --- training --------------------------------------------------------------------------------


def demo_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], setup: Setup | None = None):
    """The demo's loss closure (what ``fp8scope.Shadow`` re-runs): next-char cross-entropy."""
    x, y = batch
    with (setup.autocast() if setup is not None else contextlib.nullcontext()):
        logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def open_shadow(setup: Setup, monitor: Any):
    """``fp8scope.Shadow`` for ``--shadow-every`` / ``--fork-every`` (None when both are 0)."""
    a = setup.args
    if not (a.shadow_every or a.fork_every):
        return None
    from fp8scope.shadow import Shadow

    return Shadow(monitor, setup.model, lambda m, b: demo_loss(m, b, setup), setup.optimizer,
                  compare_every=a.shadow_every, fork_every=a.fork_every, fork_steps=a.fork_steps,
                  max_grad_norm=a.clip)


def train_step(setup: Setup, step: int, monitor: Any = None, shadow: Any = None,
               marks: list | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step: forward, loss, backward, clip, AdamW, zero_grad, ``monitor.step``.

    With a ``shadow`` (fp8scope.Shadow) its ``after_step`` runs after backward and before
    the optimizer step (the compare pass needs the weights the FP8 step used). ``marks``, if
    given, receives ``time.perf_counter()`` at the start and after the forward (with the loss),
    the backward, the optimizer and ``monitor.step`` (benchmarks/overhead.py ``--phases``).

    Returns (loss, grad_norm, lr); loss and grad_norm are 0-d tensors (no host sync).
    """
    model, opt = setup.model, setup.optimizer
    setup.injector.step = step
    lr = setup.lr_at(step)
    for group in opt.param_groups:
        group["lr"] = lr
    mark = marks.append if marks is not None else _no_mark
    mark(time.perf_counter())
    x, y = setup.injector.corrupt_batch(*setup.batches.next(), vocab=setup.cfg.vocab)
    if shadow is not None:
        loss = shadow.loss_fn(model, (x, y))
        mark(time.perf_counter())
        loss.backward()
        shadow.after_step((x, y))
    else:
        with setup.autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        mark(time.perf_counter())
        loss.backward()
    mark(time.perf_counter())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), setup.args.clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark(time.perf_counter())
    if monitor is not None:
        monitor.step(loss=loss.detach(), grad_norm=grad_norm, lr=lr)
    mark(time.perf_counter())
    return loss.detach(), grad_norm, lr


def _no_mark(_t: float) -> None:
    pass


@dataclass
class TrainResult:
    """What a call to :func:`train_steps` did; ``losses`` are host floats, read once at the end."""

    steps: int
    seconds: float
    losses: list[float]
    grad_norms: list[float]
    first_nonfinite_step: int | None = None
    stopped_early: bool = False

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("inf")


def train_steps(setup: Setup, n_steps: int, monitor: Any = None, start: int = 0,
                log: Any = None, after_nan: int | None = None, on_step: Any = None,
                shadow: Any = None) -> TrainResult:
    """Run steps ``start .. start+n_steps-1``; stop ``after_nan`` steps after a non-finite loss.

    ``log(step, loss_float)`` is called every ``args.log_every`` steps (the only
    place a loss is read on the host during the loop besides the non-finite check);
    ``on_step()`` after every step (progress bar).
    Benchmarks call this twice, with and without a monitor, to time the overhead.
    """
    after_nan = setup.args.after_nan if after_nan is None else after_nan
    log_every = max(1, setup.args.log_every)
    # The non-finite check syncs; on CPU that is free, on CUDA only do it when we print.
    check_every = 1 if setup.device.type == "cpu" else log_every
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    first_bad: int | None = None
    stopped = False
    pending_bad = torch.zeros((), dtype=torch.bool, device=setup.device)
    pending_from = start
    t0 = time.perf_counter()
    done = 0
    for step in range(start, start + n_steps):
        loss, gn, _ = train_step(setup, step, monitor, shadow)
        losses.append(loss)
        norms.append(gn)
        done += 1
        if on_step is not None:
            on_step()
        pending_bad |= ~torch.isfinite(loss)
        last = step == start + n_steps - 1
        if log is not None and (step % log_every == 0 or last):
            log(step, loss.item())
        if first_bad is None and ((step - start + 1) % check_every == 0 or last):
            if bool(pending_bad):
                # find the exact step among those since the last check
                window = torch.stack(losses[pending_from - start:])
                first_bad = pending_from + int((~torch.isfinite(window)).nonzero()[0, 0])
                if log is not None:
                    log(first_bad, float(losses[first_bad - start]))
            pending_from = step + 1
        if first_bad is not None and step - first_bad >= after_nan:
            stopped = not last
            break
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
    seconds = time.perf_counter() - t0
    return TrainResult(
        steps=done, seconds=seconds,
        losses=torch.stack(losses).float().cpu().tolist() if losses else [],
        grad_norms=torch.stack(norms).float().cpu().tolist() if norms else [],
        first_nonfinite_step=first_bad, stopped_early=stopped,
    )


@torch.no_grad()
def evaluate(setup: Setup, n_batches: int = 4) -> float:
    """Mean validation loss over a few batches (no injection state changes: hooks see the last step)."""
    was_training = setup.model.training
    setup.model.eval()
    total = 0.0
    for _ in range(n_batches):
        x, y = setup.val_batches.next()
        with setup.autocast():
            logits = setup.model(x)
        total += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)).item()
    setup.model.train(was_training)
    return total / n_batches


@torch.no_grad()
def sample(setup: Setup, prompt: str = "The ", n_chars: int = 80) -> str:
    """Greedy continuation, to show the model learned something (printed at the end of main)."""
    tok, model = setup.tokenizer, setup.model
    ids = tok.encode(prompt).to(setup.device)[None]
    for _ in range(n_chars):
        logits = model(ids[:, -setup.cfg.seq_len:])[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return tok.decode(ids[0].cpu())


def open_monitor(setup: Setup, run_dir: str | Path):
    """``fp8scope.Monitor`` for this setup (recipe and metadata filled in).

    With ``--fp8 off`` the monitor still gets a recipe: the one ``--fp8 delayed``
    would have used, so its what-if statistics answer "what would FP8 have done here".
    """
    import fp8scope

    if not hasattr(fp8scope, "Monitor"):
        raise RuntimeError("fp8scope.Monitor is not available in this install; use --no-monitor")
    recipe = setup.recipe
    if recipe is None:  # --fp8 off: what-if stats against the delayed recipe the flags describe
        recipe = make_recipe(argparse.Namespace(**{**vars(setup.args), "fp8": "delayed"}))
    from fp8scope.emulate.recipe_table import RECIPES

    names = getattr(setup.args, "whatif_recipes", "") or ""
    recipes = RECIPES if names == "all" else tuple(r for r in names.split(",") if r)
    return fp8scope.Monitor(setup.model, str(run_dir), every=setup.args.every,
                            recipe=recipe, meta=setup.meta(), whatif_recipes=recipes)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: ``python -m fp8scope.demo.train --inject outlier:blocks.2.mlp.down:150``."""
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    if args.overwrite and run_dir.exists():
        shutil.rmtree(run_dir)
    setup = build(args)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    n_params = sum(p.numel() for p in setup.model.parameters())
    say(f"tiny-gpt: {n_params / 1e6:.2f}M params, vocab {setup.cfg.vocab}, fp8={args.fp8}"
        + (f" (history {args.amax_history_len}, margin {args.margin})" if args.fp8 == "delayed" else "")
        + f", device={setup.device}, dtype={args.dtype}")
    for spec in setup.injector.specs:
        say(f"planted: {spec}")

    monitor_cm = contextlib.nullcontext(None) if args.no_monitor else open_monitor(setup, run_dir)
    with monitor_cm as mon, _progress(args.quiet, args.steps) as (advance, log):
        shadow = open_shadow(setup, mon)
        try:
            result = train_steps(setup, args.steps, monitor=mon, log=log, on_step=advance, shadow=shadow)
        finally:
            if shadow is not None:
                shadow.close()  # before the monitor closes: a running fork logs its verdict
    if shadow is not None:
        for f in shadow.forks:
            say(f"shadow fork {f.fork_id} (steps {f.start_step}..{f.start_step + len(f.loss_bf16) - 1}): "
                f"{f.verdict}: {f.reason}")
        if shadow.last_compare is not None:
            top = shadow.last_compare.most_divergent(1)
            if top:
                say(f"shadow compare at step {shadow.last_compare.step}: largest FP8 error in {top[0]['layer']}")

    say(f"{result.steps} steps in {result.seconds:.1f} s ({result.steps_per_s:.1f} steps/s)"
        + ("" if args.no_monitor else f", run written to {run_dir}"))
    if result.first_nonfinite_step is not None:
        say(f"loss became non-finite at step {result.first_nonfinite_step}; "
            f"stopped {result.steps - 1 - result.first_nonfinite_step} steps later"
            + ("" if args.no_monitor else f". Ask fp8scope why: fp8scope report {run_dir}"))
    else:
        say(f"final train loss {result.losses[-1]:.3f}, val loss {evaluate(setup):.3f}")
        say(f"sample: {sample(setup)!r}")
    return 0


@contextlib.contextmanager
def _progress(quiet: bool, total: int):
    """Yields (advance(), log(step, loss)): a rich progress bar, or no-ops when quiet."""
    if quiet:
        yield (lambda: None), (lambda step, loss: None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), transient=False) as progress:
        task = progress.add_task("train", total=total, status="")

        def advance() -> None:
            progress.advance(task)

        def log(step: int, loss: float) -> None:
            progress.console.print(f"step {step:5d}  loss {loss:.4f}")
            progress.update(task, status=f"loss {loss:.3f}")

        yield advance, log


if __name__ == "__main__":
    sys.exit(main())
