"""``fp8scope.Monitor``: attach to a model, capture FP8 stats every step, log them to a run folder.

The monitor owns the pieces of the data path and wires them in one direction:
adapters' hooks (``capture.adapters``) -> on-device stats (``capture.stats``) ->
one batch per step (``capture.collector``) -> writer thread (``writer_thread``) ->
store (``store.writer``). It never reads anything back.

Guarantees to the training loop:

- No host sync per tensor: stats stay on the device until ``step()``, which makes one
  transfer for the whole step (non-blocking on CUDA).
- Durability, the same on every device: step ``t`` is on disk (survives SIGKILL) at the
  latest when ``step(t + 1)`` or ``close()`` returns. The step's copy to the host and its
  append overlap with the next step's compute (waiting sooner would be a host sync every
  step on a GPU).
- Fail open: any error inside the monitor warns once and switches capture or logging
  off; the user's training continues.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from torch import nn

from fp8scope.capture.collector import StepCollector, TensorKey
from fp8scope.capture.adapters import ExpertsSource, adapter_for
from fp8scope.errors import UsageError
from fp8scope.schema import DEFAULT_ROLES, ROLES
from fp8scope.writer_thread import BackgroundWriter

_UNSET: Any = object()
# steps that captured something after which a monitored layer that captured nothing is said to be idle: a
# training step runs every layer it uses (gradient accumulation's micro-batches are one step)
IDLE_AFTER = 2


def _name_filter(spec: str | Iterable[str] | None):
    """A predicate on qualified module names: a regex (searched) or a list of exact names."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            rx = re.compile(spec)
        except re.error as exc:
            raise UsageError(f"bad layer regex {spec!r}: {exc}") from None
        return lambda name: rx.search(name) is not None
    names = set(spec)
    return lambda name: name in names


def _detect_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None:
        return int(rank), int(world_size or max(int(rank) + 1, 1))
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return int(os.environ.get("RANK", 0)), int(world_size or os.environ.get("WORLD_SIZE", 1))


class Monitor:
    """Monitor FP8 numerics of ``model`` and log them to ``run_dir``.

    Args:
        model: the model (its linear layers are found automatically: our emulated
            ``Fp8Linear``, torchao ``Float8Linear``, Transformer Engine layers, and with
            what-if stats any other linear-like layer of ``fp8scope.linear_like``:
            ``nn.Linear``, ``transformers``' ``Conv1D``, tensor-parallel wrappers). Modules
            holding a weight matrix that none of these claims are named in one warning.
        run_dir: the run folder (created if missing; a restarted job appends a segment).
        layers: regex (searched in qualified names) or list of names to monitor; default all.
        skip: regex or list of names to leave out.
        tensors: roles to capture, from ``activation``, ``weight``, ``gradient``, ``output``.
        every: full stats every ``every`` steps, cheap stats (amax and the scales in use, no
            pass over the tensor where the recipe already computed the amax) on the others.
            ``every=1`` is full stats every step.
        full_on_anomaly: after a cheap step that ``fp8scope.detect.triage`` flags (a non-finite
            amax, or an amax far beyond what the scale could represent), take full stats on this
            many following steps (counts, underflow, quantization error of the aftermath): of
            every layer after a non-finite amax, of the clipped tensors' layers after a clip; 0
            turns it off.
        steps: ``(first, stop)`` global steps to capture; others log only scalars.
        step: global step number of the first step this monitor ends (for restarts from a
            checkpoint); default 0. Over a run folder that logged earlier steps, the what-if
            tensors continue from the delayed-scaling state the log says they had at ``step``
            (``fp8scope.resume``), as a resumed TE module continues from its checkpoint's.
        recipe: the FP8 recipe plain (non-FP8) layers are measured against (what-if);
            default ``DelayedScaling()`` with Transformer Engine's defaults.
        rank, world_size: override what ``torch.distributed`` / ``RANK`` say.
        reduce: multi-rank runs (docs/distributed.md): ``"none"`` logs one series per rank,
            ``"aggregate"`` one series for all ranks (rows with ``rank = -1``, written by rank 0),
            ``"both"`` the two. Aggregation exchanges one small host tensor per step in the
            writer thread (needs ``torch.distributed`` initialised and a Monitor on every rank).
        cross_rank_check: compare each tensor's scale across ranks that should agree and log a
            critical ``cross_rank_scale_mismatch`` event when they differ. ``None``: on whenever
            ranks exchange (``reduce != "none"``); ``True`` or a
            :class:`fp8scope.distributed.CrossRankCheck` (groups, roles, rtol): on; ``False``: off.
        meta: free-form JSON-able dict stored in the manifest (config, git hash, ...).
        capture_no_grad: also capture forwards run under ``torch.no_grad`` (eval); default off
            so evaluation passes don't mix into training statistics.
        enabled: ``False`` builds a no-op monitor (same API, nothing captured or written).
        detect: online anomaly detection in the writer thread (docs/detection.md): ``True``
            (default thresholds), ``False``, or a :class:`fp8scope.detect.DetectConfig`. Events go to
            the run's ``events`` table and to the ``fp8scope.detect`` logger.
        on_event: optional ``callback(event_dict)`` called (writer thread) for each event.
        whatif_recipes: other recipes to measure every captured tensor under on full-stats steps
            (``"current"``, ``"mxfp8"``, ``"block128"``, ``"nvfp4"``, ``"bf16"``;
            ``fp8scope.emulate.recipe_table``): underflow, overflow, saturation and error per
            recipe, in the run's ``recipes`` table, ranked by ``fp8scope whatif RUN``.
    """

    def __init__(
        self,
        model: nn.Module,
        run_dir: str | os.PathLike,
        *,
        layers: str | Iterable[str] | None = None,
        skip: str | Iterable[str] | None = None,
        tensors: Iterable[str] = DEFAULT_ROLES,
        every: int = 50,
        full_on_anomaly: int = 2,
        steps: tuple[int | None, int | None] | None = None,
        step: int = _UNSET,
        recipe: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        meta: dict | None = None,
        capture_no_grad: bool = False,
        enabled: bool = True,
        detect: Any = True,
        on_event: Any = None,
        reduce: str = "none",
        cross_rank_check: Any = None,
        whatif_recipes: Iterable[str] = (),
    ):
        roles = tuple(tensors)
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise UsageError(f"unknown tensor role(s) {bad}; expected some of {list(ROLES)}")
        if int(every) < 1:
            raise UsageError(f"every must be >= 1, got {every}")
        from fp8scope.distributed import REDUCE_MODES, CrossRankCheck

        if reduce not in REDUCE_MODES:
            raise UsageError(f"reduce must be one of {list(REDUCE_MODES)}, got {reduce!r}")
        self.reduce = reduce
        self.cross_rank_check = (
            None if cross_rank_check is None and reduce == "none"
            else CrossRankCheck.from_value(cross_rank_check)
        )
        if recipe is None:
            from fp8scope.emulate import DelayedScaling

            recipe = DelayedScaling()
        self.model = model
        self.run_dir = Path(run_dir)
        self.recipe = recipe
        self.enabled = enabled
        self.rank, self.world_size = _detect_rank(rank, world_size)
        self._step = 0 if step is _UNSET else int(step)
        self._closed = False
        self._warned: set[str] = set()
        self.collector = StepCollector(roles, every, steps, capture_no_grad)
        try:
            from fp8scope.emulate.recipe_table import check_recipes

            self.collector.whatif_recipes = check_recipes(whatif_recipes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.full_on_anomaly = max(0, int(full_on_anomaly))
        self.collector.fail = self._capture_failed  # adapters report their own errors here
        self.collector.warn = self._warn  # ... and what they cannot read, once per key
        self._detach: list = []
        self.layers: list[str] = []
        self.sources: dict[str, int] = {}  # adapter name -> number of layers it monitors
        self.model_recipe: Any = None
        self.coverage: dict = {}  # run.json's meta.coverage (fp8scope.coverage)
        self._cover: Any = None  # the fp8scope.coverage.Coverage behind it
        self._experts: dict[str, Any] = {}  # layer -> experts module, until it is found running traced with
        # GEMMs its adapter reads in eager forwards only (_left_traced)
        self._traced_said = 0  # how many of collector.traced_layers were said (_left_traced)
        # layers that captured nothing yet, and those said to be idle (_track_layers)
        self._layer_source: dict[str, str] = {}  # layer -> its adapter's name (meta.sources)
        self._unseen: dict[str, Any] = {}
        self._idle: set[str] = set()
        self._keys_seen = 0  # collector.keys read so far
        self._steps_captured = 0  # steps that captured something, until the idle layers are said
        self._manifest_lock = threading.Lock()  # run.json: the writer thread and the training thread update it
        self._writer: BackgroundWriter | None = None
        self.detector: Any = None  # fp8scope.detect.OnlineDetector when detect is on
        self._store_failed: str | None = None
        self._resumed_from: list = []  # the rank's earlier stream files, when this monitor continues a run
        self._detect = detect
        if not enabled:
            self.collector.enabled = False
            return
        self._attach(_name_filter(layers), _name_filter(skip))
        try:
            self._open_store(explicit_step=step is not _UNSET, meta=meta)
        except OSError as exc:  # read-only, full or vanished storage: fail open, like the writer thread
            self._store_failed = f"{type(exc).__name__}: {exc}"
            self._writer = None
            self.collector.enabled = False
            self._warn("store", f"logging stopped ({self._store_failed}); training continues")
        self._start_detector(detect, on_event)
        self.collector.begin_step(self._step)

    # ---- setup ---------------------------------------------------------------------
    def _attach(self, include, exclude) -> None:
        from fp8scope.coverage import Coverage

        cover = Coverage()  # what is monitored, and the modules holding GEMM weights that are not
        for name, module in self.model.named_modules():
            # a model wrapped by torch.compile names its layers "_orig_mod.<name>": the layer is the
            # same, so is its name (a run stays comparable with an eager one)
            name = ".".join(part for part in name.split(".") if part != "_orig_mod")
            if not name:
                continue
            if include is not None and not include(name):
                continue
            if exclude is not None and exclude(name):
                continue
            adapter = adapter_for(module)
            if adapter is None:
                cover.consider(name, module, inside=any(name.startswith(f"{m}.") for m in self.layers + cover.names()))
                continue
            self._detach.append(adapter.attach(name, module, self.collector, self.recipe))
            if adapter is ExpertsSource:
                self._experts[name] = module
            else:  # experts say themselves what they could not read
                self._unseen[name] = module
            self._layer_source[name] = adapter.name
            self.layers.append(name)
            cover.layer(name, module)
            if self.model_recipe is None and hasattr(getattr(module, "recipe", None), "to_dict"):
                self.model_recipe = module.recipe  # our emulated layers carry theirs
        if include is not None and not self.layers:
            raise UsageError("no monitored layer matched the `layers` selection")
        self._cover, self.coverage = cover, cover.to_dict()
        self.sources = self._monitored_sources()
        left = cover.warning(len(self.layers))
        if left:
            self._warn("skipped", left)
        elif not self.layers:
            self._warn("skipped", "no linear layer found in the model: nothing is monitored (see "
                       "fp8scope.register_linear_like for layer classes of your own)")
        self._retrace_compiled()
        from fp8scope import graph_taps

        if self.layers and graph_taps.GRAD_KEPT_AS is None:
            self._warn("grad-taps", "this torch cannot mark an op as an effect: if the model is torch.compile'd "
                       "into several graphs (a graph break, or blocks compiled one by one), its backward may fail; "
                       "a newer torch does not have this problem")
        from fp8scope.compiled import prepare

        prepare({p.device.type for p in self.model.parameters()})  # now, not in a training step

    def _retrace_compiled(self) -> None:
        """By default dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``): a graph
        traced without the monitor's hooks (this model compiled and run before the monitor attached,
        or another instance of its class, e.g. an unmonitored baseline) would be reused for the
        monitored model, which would then log nothing. So the monitor turns those guards on (a
        cheap check per compiled call) and, when code was compiled before, resets dynamo once."""
        if not self.layers:
            return
        try:
            import torch._dynamo.config

            from fp8scope.compiled import reset_dynamo, user_frames_compiled

            torch._dynamo.config.skip_nnmodule_hook_guards = False
            if user_frames_compiled():
                reset_dynamo()
                self._warn("compile", "torch.compile'd code existed before the monitor attached; dynamo was reset "
                           "so that compiled models trace the monitor's hooks (they recompile once)")
        except Exception as exc:  # fail open: eager models are unaffected
            self._warn("compile", f"could not reset torch.compile's caches ({type(exc).__name__}: {exc})")

    def _open_store(self, explicit_step: bool, meta: dict | None) -> None:
        from fp8scope.store.layout import list_streams
        from fp8scope.store.manifest import new_manifest, read_manifest, update_manifest, write_manifest
        from fp8scope.store.writer import RunWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        existing = [s for s in list_streams(self.run_dir) if s.rank == self.rank]
        if existing and not explicit_step:
            self._warn(
                "restart",
                f"{self.run_dir} already holds logged steps for rank {self.rank}; this segment starts at step "
                f"{self._step} and will replace any step it logs again. Pass Monitor(step=N) to continue "
                "from the checkpoint's global step.",
            )
        if existing and explicit_step and self._step > 0:
            self._resumed_from = existing
            self._resume_whatif(existing)
        # "recipe": what the model trains with (emulated layers); the what-if recipe that plain
        # layers are measured against is kept apart so nobody mistakes one for the other.
        recipe = self.model_recipe.to_dict() if self.model_recipe is not None else None
        meta = {
            **(meta or {}),
            "whatif_recipe": self.recipe.to_dict() if hasattr(self.recipe, "to_dict") else None,
            "whatif_recipes": list(self.collector.whatif_recipes),
            "sources": self.sources,
            "coverage": self.coverage,
        }
        if self.world_size > 1 or self.reduce != "none":
            check = self.cross_rank_check
            meta["distributed"] = {"reduce": self.reduce, "cross_rank_check": check.to_dict() if check else None}
        if self.rank == 0:
            if (self.run_dir / "run.json").exists():
                try:
                    read_manifest(self.run_dir)
                    update_manifest(self.run_dir, world_size=self.world_size)
                except Exception:  # a broken manifest from a crash: write a fresh one, keep the streams
                    write_manifest(self.run_dir, new_manifest(recipe=recipe, world_size=self.world_size, meta=meta))
            else:
                write_manifest(self.run_dir, new_manifest(recipe=recipe, world_size=self.world_size, meta=meta))
        run_writer = RunWriter(self.run_dir, self.rank)
        self.segment = run_writer.segment
        from fp8scope.distributed.writer import make_writer

        self._writer = make_writer(
            run_writer, self.rank, self.collector.keys, self._manifest_tensors if self.rank == 0 else None,
            reduce=self.reduce, check=self.cross_rank_check, world_size=self.world_size, warn=self._warn,
            suspicious=self._suspicious_rule(),
        )

    def _resume_whatif(self, streams: list) -> None:
        """A run continued from step N: its what-if tensors start from the delayed-scaling state the
        run's log says they had, as a resumed TE module starts from the state its checkpoint kept
        (``fp8scope.resume``), not from scale 1."""
        from fp8scope.emulate import DelayedScaling

        if not isinstance(self.recipe, DelayedScaling):
            return  # current scaling keeps nothing between steps
        try:
            from fp8scope.resume import whatif_states

            self.collector.resumed = whatif_states(streams, self.rank, self._step, self.recipe)
        except Exception as exc:  # fail open: the tensors start afresh, as before
            self._warn("resume", f"what-if tensors start from scale 1: their state at step {self._step} could not "
                       f"be read from the run ({type(exc).__name__}: {exc})")

    def _suspicious_rule(self):
        """detect's rule for cheap steps worth full stats next, with this monitor's thresholds."""
        if not self.full_on_anomaly:
            return None
        from functools import partial

        from fp8scope.detect.config import DetectConfig
        from fp8scope.detect.triage import closer_look

        cfg = self._detect if isinstance(self._detect, DetectConfig) else DetectConfig()
        return partial(closer_look, cfg)

    def _manifest_tensors(self, keys: list[TensorKey]) -> None:
        """Writer thread: record the monitored tensors in run.json (merged with earlier segments)."""
        from fp8scope.store.manifest import read_manifest, update_manifest

        manifest = read_manifest(self.run_dir)
        current = {(t["layer"], t["tensor"]): t for t in manifest.get("tensors", [])}
        for k in keys:
            current[(k.layer, k.role)] = {
                "layer": k.layer, "tensor": k.role, "shape": list(k.shape), "fp8_format": k.fmt, "source": k.source,
                "recipe": k.recipe,
            }
        # a framework's recipe (Transformer Engine's, read by its adapter at the first forward), where no
        # emulated layer named one when the monitor attached
        seen = self.collector.recipe_seen
        extra = {"recipe": seen} if seen is not None and not manifest.get("recipe") else {}
        with self._manifest_lock:
            update_manifest(self.run_dir, tensors=list(current.values()), **extra)

    def _left_traced(self) -> None:
        """Training thread: MoE experts whose module ran under torch.compile with GEMMs their adapter
        reads in eager forwards only (the loop): they are not captured, said once, and
        run.json's coverage counts them as left (the report and ``info`` say so)."""
        traced = self.collector.traced_layers
        self._traced_said = len(traced)
        new = sorted(n for n in traced if n in self._experts)
        if not new:
            return
        for name in new:
            self._cover.leave_traced(name, self._experts.pop(name))
        self.coverage = self._cover.to_dict()
        self._warn(f"traced:{new[0]}", self._cover.traced_warning(new))
        self._write_coverage()

    def _track_layers(self, captured: bool) -> None:
        """Training thread, at a step's end while a layer has captured nothing, or a tensor was seen for
        the first time: a monitored layer that captured nothing in the first ``IDLE_AFTER`` steps that
        captured anything is idle (unused, or the code around it uses its weight directly), said once and
        counted as not monitored; one that runs later (a layer only some batches use) counts again."""
        keys = self.collector.keys
        back = []
        for key in keys[self._keys_seen:]:
            layer = self._owner(key.layer)
            self._unseen.pop(layer, None)
            if layer in self._idle:
                self._idle.discard(layer)
                self._cover.ran(layer)
                back.append(layer)
        self._keys_seen = len(keys)
        if keys and captured and self._unseen:
            self._steps_captured += 1
        new = sorted(self._unseen) if self._steps_captured >= IDLE_AFTER else []
        for name in new:
            self._idle.add(name)
            self._cover.leave_idle(name, self._unseen.pop(name))
        if not (new or back):
            return
        self.sources = self._monitored_sources()
        self.coverage = self._cover.to_dict()
        if new:
            self._warn("idle", self._cover.idle_warning(new, IDLE_AFTER))
        self._write_coverage()

    def _monitored_sources(self) -> dict[str, int]:
        """meta.sources: how many layers each adapter monitors, the idle ones left out."""
        return dict(Counter(src for name, src in self._layer_source.items() if name not in self._idle))

    def _owner(self, layer: str) -> str:
        """The monitored layer a tensor's layer name belongs to (a TE LayerNormMLP's ``<layer>.fc1``)."""
        name = layer
        while name and name not in self._layer_source:
            name = name.rpartition(".")[0]
        return name or layer

    def _write_coverage(self) -> None:
        if self.rank == 0 and self._writer is not None and self._store_failed is None:
            from fp8scope.store.manifest import update_manifest

            with self._manifest_lock:
                update_manifest(self.run_dir, meta={"coverage": self.coverage, "sources": self.sources})

    # ---- failure handling ------------------------------------------------------------
    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"fp8scope: {message}", RuntimeWarning, stacklevel=3)

    def _capture_failed(self, exc: BaseException) -> None:
        self._warn("capture", f"capture disabled after an error ({type(exc).__name__}: {exc}); training continues")
        self.collector.enabled = False
        self.collector.active = False

    # ---- per step ----------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """The global step now being captured (ended by the next ``step()``)."""
        return self._step

    def step(self, step: int | None = None, **scalars: Any) -> None:
        """End the current training step: log its stats and the given scalars.

        ``step=N`` names the global step being ended (otherwise the monitor counts).
        Scalars (``loss=``, ``grad_norm=``, ``lr=``, any name) may be Python numbers or
        0-d tensors; device tensors are not synced, they travel with the step's single transfer
        (CPU tensors are read as floats: a memory read, not a sync).
        """
        if self._closed or not self.enabled:
            return
        try:
            if step is not None:
                self._step = int(step)
            self.collector.step = self._step
            captured = self.collector.active
            payload = self.collector.end_step(scalars)
            if len(self.collector.traced_layers) != self._traced_said:  # experts ran compiled, uncaptured
                self._left_traced()
            if len(self.collector.keys) != self._keys_seen or (self._unseen and captured):
                self._track_layers(captured)
            if self._writer is not None and self._writer.failed is None:
                # wait only for the previous step: this one's copy and append overlap the next step
                self._writer.wait(self._writer.submit(payload) - 1, timeout=60)
                flagged, layers = self._writer.take_suspicious(before=self._step)
                if flagged:  # clipping or NaN seen on an earlier step: look closer
                    self.collector.look_closer(self.full_on_anomaly, layers)
        except Exception as exc:
            self._warn("step", f"step logging failed ({type(exc).__name__}: {exc}); training continues")
        self._step += 1
        self.collector.begin_step(self._step)

    # ---- extension points for later stages (detection, shadow steps) ---------------------
    def add_step_listener(self, listener) -> None:
        """Run ``listener(step, rank, tensors_batch, scalars_batch)`` in the writer thread after
        each step is written; it may return ``{table: RecordBatch}`` to write as well (events).
        It never runs on the training thread, so it cannot slow a step down."""
        if self._writer is not None:
            self._writer.listeners.append(listener)

    def _start_detector(self, detect: Any, on_event: Any) -> None:
        if detect is False or detect is None or self._writer is None:  # no writer: no steps to examine
            return
        try:
            from fp8scope.detect import DetectConfig
            from fp8scope.detect import child
            from fp8scope.detect.online import BackgroundDetector, OnlineDetector

            config = detect if isinstance(detect, DetectConfig) else None
            det = None
            if child.wanted():  # the rules' Python in a child process: none of it holds training's GIL
                try:
                    det = child.ChildDetector(config, on_event=on_event)
                except Exception as exc:
                    self._warn("detect-process", f"online detection runs in a thread ({type(exc).__name__}: {exc})")
            if det is None:
                det = OnlineDetector(config, on_event=on_event)
            prime = None
            if self._resumed_from:  # a resumed run: the rules continue from its last logged steps
                from fp8scope.resume import logged_steps

                streams, rank, start = self._resumed_from, self.rank, self._step
                prime = lambda: logged_steps(streams, rank, start)  # noqa: E731 (read in the detection thread)
            # own thread: the writer thread (which step() waits for on CPU) only queues the step
            self.detector = BackgroundDetector(det, self._submit_events, prime=prime)
            self.add_step_listener(self.detector)
        except Exception as exc:  # fail open: no detection, logging goes on
            self._warn("detect", f"online detection disabled ({type(exc).__name__}: {exc})")

    def _submit_events(self, table: str, batch) -> None:
        if self._writer is not None:
            self._writer.submit_table(table, batch)

    def log_table(self, table: str, batch) -> None:
        """Append rows to another table of the run (``schema.register_table`` first)."""
        if self._writer is not None and not self._closed:
            try:
                self._writer.submit_table(table, batch)
            except Exception as exc:
                self._warn("log_table", f"could not log {table} rows ({exc}); training continues")

    def flush(self) -> None:
        """Wait until every ended step is written."""
        if self._writer is not None:
            self._writer.sync(timeout=60)

    def close(self) -> None:
        """Detach all hooks and finish writing. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for undo in self._detach:
            try:
                undo()
            except Exception:
                pass
        self._detach.clear()
        if self.detector is not None and self._writer is not None:
            self.flush()  # every step has reached the detector
            self.detector.close()  # its last events are queued before the writer closes
        if self._writer is not None:
            self.flush()
            self._writer.close()

    @property
    def logging_failed(self) -> str | None:
        """Why logging stopped, or None while it works."""
        return self._writer.failed if self._writer is not None else self._store_failed

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._writer is not None:
                self.close()
        except Exception:
            pass
