"""MoE experts stored as 3-D weights (``transformers`` 5.x), captured what-if per expert: a Mixtral
(``F.linear`` on ``[out, in]`` slices) and a GPT-OSS (``x @ W[e]`` on ``[in, out]`` slices, biases)
built from small configs, trained with each of ``transformers``' three experts implementations.

The loop of per-expert GEMMs goes through the plain what-if capture that every other layer uses;
the grouped and batched GEMMs take one segmented reduction for all experts. So the three must log
the same rows, on cheap and on full steps, and each expert's activation must be the amax of the
tokens routed to it. A cheap step's ops must not grow with the number of experts, and a NaN in
one expert's weight must be found in that expert.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8scope
from fp8scope.detect.analysis import analysis
from tests.conftest import fp8scope_python_calls

transformers = pytest.importorskip("transformers")

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
STEPS = 3


def build(arch: str, implementation: str, experts: int = 4, top_k: int = 2):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=32)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=64, **common)
    else:
        cfg = transformers.GptOssConfig(intermediate_size=32, head_dim=8, layer_types=["full_attention"] * 2, **common)
    return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=implementation)


def run(tmp_path, arch: str, implementation: str, every: int, steps: int = STEPS, plant=None, compiled=None,
        backend: str = "inductor", **kw):
    """Train ``steps`` steps; ``compiled`` "before" or "after" the monitor attached: the forward through
    ``torch.compile(fullgraph=True)``, where a graph break raises. Returns the tensors table and, per
    step, the hidden states and routing that layer 0's experts received."""
    model = build(arch, implementation, **kw)
    experts = model.model.layers[0].mlp.experts
    seen: dict[int, tuple] = {}
    now = [0]
    if not compiled:  # (traced, the step's number would be a guard: a recompile a step)
        experts.register_forward_hook(lambda m, args, out: seen.__setitem__(now[0], (args[0].detach(), args[1])))
    run_dir = tmp_path / f"{arch}-{implementation}-{every}{'-compiled' if compiled else ''}"
    forward = torch.compile(model, fullgraph=True, backend=backend) if compiled else model
    mon = fp8scope.Monitor(forward if compiled == "before" else model, run_dir, every=every)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        now[0] = step
        if plant is not None:
            plant(model, step)
        ids = torch.randint(0, 96, (4, 16), generator=g)
        out = forward(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=out.loss)
    mon.close()
    return fp8scope.load_run(run_dir).tensors(), seen, run_dir


def _rows(df):
    ex = df[df["layer"].str.contains(".mlp.experts.")]
    return ex.set_index(["step", "layer", "tensor"])[["amax", "scale", "scale_inv"]].sort_index()


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_each_expert_is_a_layer_and_the_three_implementations_log_the_same_rows(tmp_path, arch):
    ref, seen, run_dir = run(tmp_path, arch, "eager", every=1)
    tensors = json.loads((run_dir / "run.json").read_text())["tensors"]
    names = {t["layer"] for t in tensors if ".experts." in t["layer"]}
    assert names == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(4)
                     for p in ("gate_up_proj", "down_proj")}
    assert {t["source"] for t in tensors if ".experts." in t["layer"]} == {"whatif"}
    expected = _rows(ref)
    # each expert's gate_up activation: the amax of the tokens routed to it
    for step, (hidden, routing) in seen.items():
        for e in range(4):
            mine = (routing == e).any(-1)
            got = expected.loc[(step, f"model.layers.0.mlp.experts.{e}.gate_up_proj", "activation"), "amax"]
            assert got == pytest.approx(float(hidden[mine].abs().max()), rel=1e-6)
    for implementation in IMPLEMENTATIONS:
        for every in (1, 100):  # full steps (each expert's slice), cheap steps (one scatter for all)
            if (implementation, every) == ("eager", 1):
                continue
            got = _rows(run(tmp_path, arch, implementation, every)[0])
            assert list(got.index) == list(expected.index), (implementation, every)
            # (bmm and grouped_mm sum in another order than F.linear: the GEMMs after the first differ in the last bits)
            np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-4,
                                       err_msg=f"{implementation} {every}")


@pytest.mark.parametrize("arch,implementation,compiled", [("mixtral", "grouped_mm", "before"),
                                                           ("gpt_oss", "batched_mm", "after")])
def test_compiled_experts_log_the_eager_rows_without_a_graph_break(tmp_path, arch, implementation, compiled):
    """Under torch.compile the experts' mode is traced too: a grouped or batched GEMM hands its input,
    stack and routing to the graph's taps, and its output's gradient goes the same way, so the graph
    runs the eager capture on the real tensors. Full and cheap steps (``every=2``) log the eager rows,
    with no graph break (``fullgraph``), nothing left, and no mode left active, in a model compiled
    before the monitor attached and after. Through AOT autograd without inductor, the part that is
    ours: inductor is the next test's, on the experts alone (a cold inductor compile of the whole
    model costs a CI run 30 s). GPT-OSS stores its stacks ``[experts, in, out]`` and adds their
    biases to the GEMM's output in place."""
    expected = _rows(run(tmp_path, arch, "eager", every=1)[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _rows(run(tmp_path, arch, implementation, every=2, compiled=compiled, backend="aot_eager")[0])
    assert not [str(w.message) for w in caught if "not monitored" in str(w.message) or "not captured" in str(w.message)]
    assert list(got.index) == list(expected.index)
    np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-4)
    assert not torch.overrides._get_current_function_mode_stack()


def test_experts_compiled_by_inductor_log_the_eager_rows(tmp_path):
    """Inductor hands the graph's taps its own views of the stacks (the taps check them by address)
    and fuses the experts' GEMMs' neighbours around the taps: a Mixtral's experts module alone,
    compiled by inductor, logs the eager rows on full and cheap steps."""

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = build("mixtral", "grouped_mm").model.layers[0].mlp.experts

        def forward(self, hidden, index, weights):
            return self.experts(hidden, index, weights)

    def rows(compiled: bool):
        model = Experts()
        forward = torch.compile(model, fullgraph=True) if compiled else model
        mon = fp8scope.Monitor(model, tmp_path / str(compiled), every=2)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            hidden = torch.randn(64, 32, generator=g, requires_grad=True)
            weights, index = torch.randn(64, 4, generator=g).softmax(-1).topk(2, -1)
            forward(hidden, index, weights).pow(2).mean().backward()
            mon.step()
        mon.close()
        return fp8scope.load_run(tmp_path / str(compiled)).tensors().set_index(
            ["step", "layer", "tensor"])[["amax", "scale", "scale_inv"]].sort_index()

    expected, got = rows(False), rows(True)
    assert len(expected) == 3 * 4 * 2 * 3  # steps, experts, stacks, roles
    assert list(got.index) == list(expected.index)
    np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-4)


def test_an_expert_without_tokens_logs_amax_0_on_a_grouped_cheap_step_and_no_row_in_the_loop(tmp_path):
    # (step 0 is a full step, which captures each expert's rows as a plain layer's: none without tokens)
    # 16 experts, top-1, 64 tokens of an untrained router: some experts get none in some step
    grouped, seen, _ = run(tmp_path, "mixtral", "grouped_mm", every=100, experts=16, top_k=1)
    loop, _, _ = run(tmp_path, "mixtral", "eager", every=100, experts=16, top_k=1)
    idle = [(s, e) for s, (_, routing) in seen.items() for e in range(16) if s > 0 and not (routing == e).any()]
    assert idle, "every expert got a token: the case is not tested"
    g, lp = _rows(grouped), _rows(loop)
    for s, e in idle:
        key = (s, f"model.layers.0.mlp.experts.{e}.gate_up_proj", "activation")
        assert g.loc[key, "amax"] == 0.0 and key not in lp.index
    busy = lp.index.intersection(g.index)
    np.testing.assert_allclose(g.loc[busy, "amax"], lp.loc[busy, "amax"], rtol=1e-6)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__ not in ("detach", "alias"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _cheap_step_cost(tmp_path, experts: int, monitored: bool) -> tuple[int, int]:
    """A grouped cheap step's aten ops and fp8scope Python calls (the model's and the monitor's)."""
    model = build("mixtral", "grouped_mm", experts=experts)
    mon = fp8scope.Monitor(model, tmp_path / f"ops-{experts}-{monitored}", every=100, detect=False,
                           enabled=monitored)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        mon.step()

    for _ in range(2):  # step 0 is full; keys and slots are made on the first captures
        step()
    with OpCounter() as c:
        step()
    calls = fp8scope_python_calls(step)
    mon.close()
    return c.n, calls


def test_a_grouped_cheap_steps_ops_and_python_do_not_grow_with_the_number_of_experts(tmp_path):
    """A grouped GEMM's experts are captured together: the ops (on a GPU, launches) and the Python (a
    GPU's host time) of a cheap step are the same at 4 and at 16 experts. A Qwen3-MoE has 128 in each of
    48 layers: a loop per expert in Python cost its training thread tens of thousands of calls a step."""
    cost = {n: [a - b for a, b in zip(_cheap_step_cost(tmp_path, n, True), _cheap_step_cost(tmp_path, n, False))]
            for n in (4, 16)}
    assert cost[4] == cost[16], cost
    # 2 layers x 2 GEMMs x 3 roles x experts tensors: far under 2 ops a tensor at 16 experts
    assert cost[16][0] <= 2 * (2 * 2 * 3 * 16) + 60, cost


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_a_nan_in_one_experts_weight_is_found_in_that_expert(tmp_path, implementation):
    def plant(model, step):
        if step == 4:
            with torch.no_grad():
                model.model.layers[0].mlp.experts.down_proj[2, 3, 5] = float("nan")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN's own events, logged as they happen
        run(tmp_path, "mixtral", implementation, every=100, steps=6, plant=plant)
    _, rep = analysis(tmp_path / f"mixtral-{implementation}-100")
    o = rep["nan_origin"]
    assert (o["layer"], o["tensor"], o["step"]) == ("model.layers.0.mlp.experts.2.down_proj", "weight", 4), o


def test_bf16_compare_steps_and_a_fork_run_on_a_mixtral_with_its_experts_monitored(tmp_path):
    from fp8scope.emulate import convert_to_fp8
    from fp8scope.shadow import Shadow

    model = build("mixtral", "grouped_mm")
    head = model.get_output_embeddings()
    convert_to_fp8(model, skip=[n for n, m in model.named_modules() if m is head])
    mon = fp8scope.Monitor(model, tmp_path / "run", every=5)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids).loss

    shadow = Shadow(mon, model, loss_fn, opt, compare_every=2, fork_steps=3)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        ids = torch.randint(0, 96, (4, 16), generator=g)
        loss = shadow.loss_fn(model, ids)
        loss.backward()
        shadow.after_step(ids)
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss.detach())
        if step == 2:
            shadow.fork("manual")
    shadow.close()
    mon.close()
    (fork,) = shadow.forks
    assert fork.verdict != "pending"
    layers = {r["layer"] for r in shadow.compares[-1].rows}
    assert "model.layers.0.mlp.experts" in layers and "model.layers.0.self_attn.q_proj" in layers
    df = fp8scope.load_run(tmp_path / "run").tensors()
    # the shadow's BF16 passes and the fork's replica logged nothing: one row per expert tensor and step
    ex = df[df["layer"].str.startswith("model.layers.0.mlp.experts.")]
    assert not ex.duplicated(["step", "layer", "tensor"]).any() and set(ex["step"]) == set(range(8))


def _live_tensors() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_capture_keeps_no_step_alive(tmp_path, implementation):
    # a hook on a GEMM's output that held the output kept each step's activations alive in a cycle
    # (about 3 MB a step on a small Mixtral): the live tensors must not grow from step to step
    model = build("mixtral", implementation)
    mon = fp8scope.Monitor(model, tmp_path / "run", every=4, detect=False)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(1)
    live = []
    for step in range(13):
        ids = torch.randint(0, 96, (4, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss.detach())
        del loss
        if step in (4, 12):  # both after a full step and three cheap ones
            live.append(_live_tensors())
    mon.close()
    assert live[1] <= live[0] + 8, live  # bounded caches (a capture sequence's index tensors) aside
