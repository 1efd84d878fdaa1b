"""Shadow BF16 steps: compare mode localizes an FP8-only fault, forks give the right verdict,
the real training state is left bit-identical, memory stays bounded, the tables are readable.

All CPU, real training of small models (the tiny GPT of the demo, an MLP with dropout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8scope
from fp8scope.demo import train as T
from fp8scope.demo.inject import Injector
from fp8scope.emulate import DelayedScaling, Fp8Linear, convert_to_fp8
from fp8scope.shadow import FP8_INDUCED, NOT_FP8, Shadow, verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    # Shared CI boxes: intra-op threads oversubscribe badly on tiny matmuls (10x slower).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gpt_loss(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def tiny_gpt(spec: str | None):
    """Tiny GPT with *every* Linear (lm_head included) in emulated FP8, delayed scaling, history 16."""
    args = T.default_args(n_layers=2, d_model=64, n_heads=4, seq_len=32, batch_size=8, steps=100,
                          corpus_chars=50_000, fp8="off", warmup=5)
    setup = T.build(args)
    convert_to_fp8(setup.model, DelayedScaling(amax_history_len=16))  # shares params: optimizer still valid
    setup.injector = Injector([spec] if spec else []).attach(setup.model)
    return setup


def train(setup, n, shadow=None, mon=None, hook=None, start=0):
    for step in range(start, start + n):
        setup.injector.step = step
        for g in setup.optimizer.param_groups:
            g["lr"] = setup.lr_at(step)
        batch = setup.batches.next()
        loss = (shadow.loss_fn if shadow else gpt_loss)(setup.model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(setup.model.parameters(), 1.0)
        if shadow is not None:
            shadow.after_step(batch)
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        if mon is not None:
            mon.step(loss=loss.detach())
        if hook is not None:  # where an online detector's callback lands: after the step is logged
            hook(step)


# ---- the acceptance scenarios ----------------------------------------------------------------
def test_fp8_only_fault_is_fp8_induced_and_localized(tmp_path):
    """One bad batch puts a 1e6x outlier into lm_head's input at step S. Both precisions see it;
    afterwards delayed scaling keeps the spike in lm_head's amax history for 16 steps, so in FP8
    the whole input of lm_head underflows to zero (logits 0, loss = ln(vocab)) while BF16 trains on.
    The detection fires after S: the fork and the compare start at S+1. S is late enough that the
    loss before it (the fork's baseline) sits well below ln(vocab) / 1.5, the FP8 fork's final loss:
    at S = 30 the margin was 0.05 % and one CPU's matmul rounding took the verdict to inconclusive."""
    S = 50
    setup = tiny_gpt(f"outlier:lm_head:{S}:1e6:1")
    mon = fp8scope.Monitor(setup.model, tmp_path / "run", every=10)
    shadow = Shadow(mon, setup.model, gpt_loss, setup.optimizer, fork_steps=8, max_grad_norm=1.0)

    def detect(step):
        if step == S:  # what online detection would report for the spike (saturation at step S)
            shadow.on_event({"step": S, "rule": "saturation", "severity": "critical", "layer": "lm_head"})

    train(setup, S + 9, shadow, mon, hook=detect)
    shadow.close()
    mon.close()

    (fork,) = shadow.forks
    assert fork.start_step == S + 1 and fork.trigger == f"event:saturation@{S}"
    assert fork.verdict == FP8_INDUCED, fork.reason
    from fp8scope.detect.report import build_report

    rep = build_report(fp8scope.load_run(tmp_path / "run"))  # the report shows the fork, its trigger and evidence
    assert [(f["trigger"], f["verdict"]) for f in rep["forks"]] == [(fork.trigger, FP8_INDUCED)]
    assert "BF16 forks: fp8-induced" in rep["verdict"] and rep["forks"][0]["reason"] == fork.reason
    cmp = shadow.compares[-1]
    assert cmp.step == S + 1
    top = cmp.most_divergent(1)[0]
    assert top["layer"] == "lm_head"
    assert top["local_rel_err"] > 0.9 and top["output_rel_err"] > 0.9 and top["wgrad_rel_err"] > 0.9
    others = [r for r in cmp.rows if r["layer"] != "lm_head"]
    assert max(r["local_rel_err"] for r in others) < 0.1  # ordinary FP8 noise elsewhere
    assert max(r["output_rel_err"] for r in others) < 0.1
    assert cmp.loss_fp8 > cmp.loss_bf16 + 0.5

    run = fp8scope.load_run(tmp_path / "run")
    forks = run.table("shadow_fork").to_pandas()
    assert forks.sort_values("step")["verdict"].iloc[-1] == FP8_INDUCED
    assert len(forks) == 8 and set(forks["verdict"].iloc[:-1]) == {"pending"}
    comp = run.table("shadow_compare").to_pandas()
    at = comp[comp.step == S + 1].sort_values("local_rel_err", ascending=False)
    assert at["layer"].iloc[0] == "lm_head"


def test_lr_blowup_is_not_fp8():
    S = 30
    setup = tiny_gpt(f"lr:{S}:100")
    shadow = Shadow(None, setup.model, gpt_loss, setup.optimizer, fork_steps=8, max_grad_norm=1.0)
    train(setup, S + 8, shadow, hook=lambda step: shadow.fork("manual") if step == S - 1 else None)
    (fork,) = shadow.forks
    assert fork.start_step == S
    assert fork.verdict == NOT_FP8, fork.reason
    # the replica followed the real run's lr schedule (the injected x100 included)
    assert max(fork.loss_bf16) > 2 * fork.baseline


def test_an_event_on_a_simulated_cast_starts_no_fork(tmp_path):
    """A what-if layer trained in high precision: an event about its simulated cast (here saturation,
    after an outlier planted in its input) says something about a recipe, and a BF16 fork would rerun
    what already ran in BF16 there. Online detection marks such events ``simulated``; ``Shadow.on_event``
    then arms a compare and starts no fork. An event about the real tensor (the amax spike) still does."""
    from fp8scope.detect import DetectConfig

    S, layer = 30, "blocks.1.mlp.down"
    args = T.default_args(n_layers=2, d_model=64, n_heads=4, seq_len=32, batch_size=8, steps=100,
                          corpus_chars=50_000, fp8="off", warmup=5)
    setup = T.build(args)
    convert_to_fp8(setup.model, DelayedScaling(amax_history_len=16), skip=[layer])  # that one layer what-if
    setup.injector = Injector([f"outlier:{layer}:{S}:1000"]).attach(setup.model)
    got = []
    mon = fp8scope.Monitor(setup.model, tmp_path / "run", every=10, on_event=got.append,
                           detect=DetectConfig(warmup_rows=0))
    train(setup, S + 3, mon=mon)
    mon.close()
    at = {(e["rule"], e["simulated"]) for e in got if e["layer"] == layer and e["step"] == S}
    assert ("saturation", True) in at and ("amax_spike", False) in at, at
    sim = next(e for e in got if e["layer"] == layer and e["step"] == S and e["rule"] == "saturation")
    real = next(e for e in got if e["layer"] == layer and e["step"] == S and e["rule"] == "amax_spike")
    assert sim["severity"] != "info" and "simulated" in sim["message"]
    assert not any(e["simulated"] for e in got if e["layer"] != layer)  # every other layer ran FP8

    for event, forks in ((sim, 0), (real, 1)):
        setup = tiny_gpt(None)
        shadow = Shadow(None, setup.model, gpt_loss, setup.optimizer, fork_steps=2, max_grad_norm=1.0)
        train(setup, 4, shadow, hook=lambda step: shadow.on_event(event) if step == 0 else None)
        assert len(shadow.forks) == forks, (event["rule"], shadow.forks)
        assert shadow.compares, "an event of either kind arms a compare"


# ---- the real training state is untouched ---------------------------------------------------
class DropoutNet(nn.Module):
    """Dropout first, then a plain Linear (FP8 cannot touch it: its error must be exactly 0
    if and only if the RNG state was restored), then FP8 layers."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.inp = nn.Linear(16, 32)
        self.hid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(F.dropout(F.gelu(self.hid(F.gelu(self.inp(self.drop(x))))), 0.2, self.training))


def _dropout_setup():
    torch.manual_seed(0)
    model = DropoutNet()
    convert_to_fp8(model, DelayedScaling(amax_history_len=4), layers=["hid", "out"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def mlp_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _run_mlp(model, opt, n, shadow=None, snapshots=None):
    torch.manual_seed(123)  # batches come from the global RNG: the shadow must not shift it
    for step in range(n):
        batch = (torch.randn(64, 16) * 3, torch.randint(0, 4, (64,)))
        loss = (shadow.loss_fn if shadow else mlp_loss)(model, batch)
        loss.backward()
        if snapshots is not None:
            snapshots.append({n_: p.grad.clone() for n_, p in model.named_parameters()})
        if shadow is not None:
            before = {n_: p.grad for n_, p in model.named_parameters()}
            shadow.after_step(batch)
            assert all(p.grad is before[n_] for n_, p in model.named_parameters())  # same objects
        opt.step()
        opt.zero_grad(set_to_none=True)


def _fp8_state(model):
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            for role in ("activation", "weight", "gradient"):
                st = m.scaling_state(role)
                out[f"{name}.{role}"] = (st.amax_history, st.scale.clone(), st.scale_inv.clone(), st.updates)
    return out


def test_compare_leaves_grads_scaling_state_and_rng_bit_identical():
    m1, o1 = _dropout_setup()
    g1: list = []
    _run_mlp(m1, o1, 6, snapshots=g1)

    m2, o2 = _dropout_setup()
    g2: list = []
    shadow = Shadow(None, m2, mlp_loss, o2, compare_every=1)
    _run_mlp(m2, o2, 6, shadow=shadow, snapshots=g2)
    shadow.close()

    assert len(shadow.compares) == 6
    for a, b in zip(g1, g2):  # the real gradients of every step
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for (k, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), k
    s1, s2 = _fp8_state(m1), _fp8_state(m2)
    for k in s1:
        h1, sc1, si1, u1 = s1[k]
        h2, sc2, si2, u2 = s2[k]
        assert torch.equal(h1, h2) and torch.equal(sc1, sc2) and torch.equal(si1, si2) and u1 == u2, k

    for c in shadow.compares:
        rows = {r["layer"]: r for r in c.rows}
        # dropout before `inp` was replayed exactly: the plain layer sees the same input
        assert rows["inp"]["output_rel_err"] == 0.0 and rows["inp"]["output_cos"] == pytest.approx(1.0)
        assert rows["inp"]["local_rel_err"] == 0.0  # no FP8 in a plain layer
        assert 0 < rows["hid"]["local_rel_err"] < 0.2  # real, small FP8 error
        assert rows["out"]["wgrad_rel_err"] > 0


def test_compare_called_after_optimizer_step_is_skipped_with_a_warning():
    model, opt = _dropout_setup()
    shadow = Shadow(None, model, mlp_loss, opt, compare_every=1)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    shadow.loss_fn(model, batch).backward()
    opt.step()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        shadow.after_step(batch)
    assert not shadow.compares and any("before optimizer.step" in str(x.message) for x in w)


def test_capture_memory_is_bounded_by_sample_size():
    """What the FP8 step keeps does not grow with the batch: sample_size elements per tensor."""
    model, opt = _dropout_setup()
    shadow = Shadow(None, model, mlp_loss, opt, compare_every=1, sample_size=256)
    sizes = []
    for bs in (256, 4096):
        batch = (torch.randn(bs, 16), torch.randint(0, 4, (bs,)))
        shadow.loss_fn(model, batch).backward()
        shadow.after_step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sizes.append(shadow.last_compare.capture_bytes)
    # 3 outputs + 3 weights, each <= 256 float32 values + 256 int32 indices
    assert sizes[0] == sizes[1] <= 6 * 256 * 8
    assert all(r["output_rel_err"] is not None for r in shadow.last_compare.rows)
    # sampled and exact estimates agree (the sample is a fixed random subset)
    exact = Shadow(None, model, mlp_loss, opt, compare_every=1, sample_size=None)
    batch = (torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
    exact.loss_fn(model, batch).backward()
    exact.after_step(batch)
    opt.zero_grad(set_to_none=True)
    assert exact.last_compare.capture_bytes > sizes[1]


def test_fork_replica_is_independent_and_memory_reported():
    model, opt = _dropout_setup()
    shadow = Shadow(None, model, mlp_loss, opt, fork_steps=3)
    shadow.fork()
    _run_mlp(model, opt, 4, shadow=shadow)
    (f,) = shadow.forks
    assert f.done and len(f.loss_bf16) == 3 and f.replica is None  # replica freed at the end
    n_params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert f.bytes >= 3 * n_params  # params + AdamW exp_avg + exp_avg_sq (+ buffers, FP8 state)
    # the replica's hooks: none of the shadow's own (a deepcopy must not drag the Shadow along)
    assert all(p.grad is None for p in model.parameters())


def test_verdict_rules():
    """The curves against each other and against the pre-anomaly baseline (docs/shadow.md)."""
    assert verdict([2.0, float("nan")], [2.0, 2.1], 2.0, 1.5)[0] == FP8_INDUCED
    assert verdict([2.0, float("nan")], [2.0, float("inf")], 2.0, 1.5)[0] == NOT_FP8
    # an FP8-only fault: FP8 stuck at ln(vocab) while the BF16 replica trains on
    stuck, trains = [3.8] * 12, [2.0 - 0.02 * i for i in range(12)]
    assert verdict(stuck, trains, 2.0, 1.5)[0] == FP8_INDUCED
    # a 30x learning-rate jump: FP8 and BF16 curves identical, both above the baseline -> not FP8
    assert verdict([3.1, 3.0, 2.9, 3.0], [3.1, 3.0, 2.95, 3.02], 2.0, 1.5)[0] == NOT_FP8
    # nothing happened: BF16 follows FP8 at the baseline
    assert verdict([2.0, 2.05], [2.0, 2.0], 2.0, 1.5)[0] == NOT_FP8
    # BF16 does worse than FP8: the data cannot blame FP8
    assert verdict([2.0, 2.1], [2.0, 9.0], 2.0, 1.5)[0] == "inconclusive"
    # both diverge from the same state, BF16 even further (a learning-rate jump on this CPU): not FP8
    assert verdict([8.1] * 4, [9.2] * 4, 2.55, 1.5)[0] == NOT_FP8
    # FP8 a bit worse than BF16, both at the baseline: nothing to blame
    assert verdict([2.0, 2.4], [2.0, 2.0], 2.0, 1.5)[0] == "inconclusive"
    # FP8 stays above its baseline while BF16 trains on below it (a poisoned amax history): 12 % worse
    assert verdict([0.74] * 8, [0.66] * 8, 0.72, 1.5)[0] == FP8_INDUCED


def test_tables_readable_without_importing_shadow(tmp_path):
    """The CLI/dashboard read shadow tables from the streams' own schemas (no shadow import)."""
    model, opt = _dropout_setup()
    mon = fp8scope.Monitor(model, tmp_path / "r", every=1)
    shadow = Shadow(mon, model, mlp_loss, opt, compare_every=2, fork_steps=2)
    shadow.fork()
    torch.manual_seed(0)
    for _ in range(3):
        batch = (torch.randn(16, 16), torch.randint(0, 4, (16,)))
        loss = shadow.loss_fn(model, batch)
        loss.backward()
        shadow.after_step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.step(loss=loss.detach())
    shadow.close()
    mon.close()
    code = (
        "import sys, fp8scope; r = fp8scope.load_run(sys.argv[1]);"
        "assert 'fp8scope.shadow' not in sys.modules;"
        "c = r.table('shadow_compare'); f = r.table('shadow_fork');"
        "print(c.num_rows, f.num_rows, sorted(c.column_names)[:3], r.sql('select count(*) n from shadow_compare')['n'][0])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    n_cmp, n_fork = map(int, out.stdout.split()[:2])
    assert n_cmp == 2 * 3 and n_fork == 2  # steps 0 and 2, 3 layers; a 2-step fork


def test_torchao_layers_run_in_high_precision_and_are_restored():
    pytest.importorskip("torchao.float8")
    from torchao.float8 import convert_to_float8_training

    from fp8scope.shadow import high_precision

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(4, 32)
    y_ref = m(x)
    convert_to_float8_training(m)
    assert type(m[0]).__name__ == "Float8Linear"
    with high_precision(m):
        assert torch.equal(m(x), y_ref)  # exactly nn.Linear
    assert "forward" not in m[0].__dict__ and "forward" not in m[2].__dict__  # override removed
