"""Models and trainers we did not write: a ``transformers`` Llama and GPT-2 built from small
configs (random weights, no download), trained a few steps with the Hugging Face and Lightning
callbacks, with and without gradient accumulation, in what-if mode and after ``convert_to_fp8``.

Each run checks that every projection is monitored, that the logged loss, lr and grad norm are
those of the step that ran (against the trainer's own record of that step), and that ``report``
reads the run.
"""

from __future__ import annotations

import json
import math
import warnings

import pandas as pd
import pytest
import torch

import fp8scope
from fp8scope.cli.main import main as cli_main
from fp8scope.emulate import convert_to_fp8

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16
# Every GEMM of a block, and the head: what "every projection" means for each architecture.
PROJECTIONS = {
    "llama": [f"model.layers.{i}.{p}" for i in range(2)
              for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"],
    "gpt2": [f"transformer.h.{i}.{p}" for i in range(2)
             for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + ["lm_head"],
}


def build(arch: str, fp8: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    if fp8:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every projection converts: no "left in high precision"
            convert_to_fp8(model)
        assert sum(type(m).__name__ == "Fp8Linear" for m in model.modules()) == len(PROJECTIONS[arch])
    return model


def dataset(n: int):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, VOCAB, (SEQ,), generator=g)), "labels": ids} for _ in range(n)]


def check_tensors(run, arch: str, fp8: bool, steps: int, micro: int, prefix: str = "") -> None:
    df = run.tensors()
    assert sorted(df.layer.unique()) == sorted(prefix + p for p in PROJECTIONS[arch])
    assert len(df[df.step == 0]) == 3 * len(PROJECTIONS[arch])  # activation, weight, gradient of each
    assert sorted(df.step.unique()) == list(range(steps))
    assert (df["calls"] == micro).all()  # the micro-batches merge into their optimizer step
    assert set(df.source) == {"emulated" if fp8 else "whatif"}
    # weights read as [out, in] whatever the layer stores (GPT-2's Conv1D keeps [in, out])
    shapes = {t["layer"]: t["shape"] for t in run.manifest["tensors"] if t["tensor"] == "weight"}
    first = prefix + PROJECTIONS[arch][0]
    assert shapes[first] == ([96, 32] if arch == "gpt2" else [32, 32])
    assert shapes[prefix + "lm_head"] == [VOCAB, 32]


def scalars_by_step(run) -> dict[str, dict[int, float]]:
    sc = run.scalars()
    return {name: dict(zip(g.step.astype(int), g.value.astype(float))) for name, g in sc.groupby("name")}


def check_report(path, fp8: bool, capsys) -> None:
    """``report`` reads the run and says what was measured; ``info`` too."""
    capsys.readouterr()
    assert cli_main(["report", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["measured"]["kind"] == ("fp8" if fp8 else "whatif")
    assert (rep["measured"]["whatif_recipe"] is None) == fp8
    assert (rep["recipe"] is None) != fp8  # an emulated model carries its recipe
    assert cli_main(["info", str(path)]) == 0
    assert ("what-if" in capsys.readouterr().out.split("measured", 1)[1].splitlines()[0]) != fp8


# ---- Hugging Face Trainer ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("fp8", [False, True], ids=["whatif", "fp8"])
@pytest.mark.parametrize("micro", [1, 2], ids=["ga1", "ga2"])
def test_hf_trainer(tmp_path, arch, fp8, micro, capsys):
    from fp8scope.integrations.hf import Fp8ScopeCallback

    steps = 5
    model = build(arch, fp8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=micro,
        max_steps=steps, logging_steps=1, learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine",
        max_grad_norm=0.5, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    cb = Fp8ScopeCallback(str(tmp_path / "run"), every=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(4 * micro * steps), callbacks=[cb])
    trainer.train()
    run = fp8scope.load_run(tmp_path / "run")
    check_tensors(run, arch, fp8, steps, micro)
    # the Trainer's own record of each step (logging_steps=1: its log is that step's loss)
    logged = {int(h["step"]) - 1: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == list(range(steps))
    ours = scalars_by_step(run)
    for step, h in logged.items():
        assert ours["loss"][step] == pytest.approx(h["loss"], rel=1e-5)
        assert ours["lr"][step] == pytest.approx(h["learning_rate"], rel=1e-6, abs=1e-12)
        assert ours["grad_norm"][step] == pytest.approx(h["grad_norm"], rel=1e-5)
    assert ours["lr"][0] == 0.0  # warm-up: the first step ran with lr 0 (not the next step's lr)
    assert max(ours["grad_norm"].values()) > 0.5  # clipped steps: the norm logged is the one before clipping
    check_report(tmp_path / "run", fp8, capsys)


def test_hf_scalars_do_not_wait_for_logging_steps(tmp_path):
    """logging_steps=3: the Trainer logs averages every 3 steps; fp8scope keeps every step."""
    from fp8scope.integrations.hf import Fp8ScopeCallback

    steps = 6
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=steps, logging_steps=3, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True,
    )
    cb = Fp8ScopeCallback(str(tmp_path / "run"), every=50)
    trainer = transformers.Trainer(model=build("llama", False), args=args, train_dataset=dataset(8 * steps),
                                   callbacks=[cb])
    trainer.train()
    ours = scalars_by_step(fp8scope.load_run(tmp_path / "run"))
    assert sorted(ours["loss"]) == sorted(ours["grad_norm"]) == list(range(steps))
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [int(h["step"]) for h in logged] == [3, 6]
    for h in logged:  # the Trainer's average over its 3 steps is the mean of our 3 per-step losses
        window = [ours["loss"][s] for s in range(int(h["step"]) - 3, int(h["step"]))]
        assert sum(window) / 3 == pytest.approx(h["loss"], rel=1e-5)
        assert ours["grad_norm"][int(h["step"]) - 1] == pytest.approx(h["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["whatif", "fp8"])
def test_hf_trainer_resumed_from_a_checkpoint_logs_what_the_uninterrupted_run_logs(tmp_path, fp8):
    """``trainer.train(resume_from_checkpoint=...)``: the Trainer restores the weights, optimizer,
    scheduler, RNG and data position, the emulated layers their scaling state (their
    ``_extra_state`` rides in the Trainer's safetensors), and the callback's monitor continues at
    the checkpoint's step, rebuilding the what-if tensors' states from the run's log. A run stopped
    after step 5 and resumed from its step-4 checkpoint logs every row as the run that went through
    does, bit for bit."""
    from fp8scope.integrations.hf import Fp8ScopeCallback

    class Stop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 6

    def trainer(run: str, out: str, stop: bool = False) -> transformers.Trainer:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=8, logging_steps=1,
            learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine", max_grad_norm=0.5, report_to=[],
            save_strategy="steps", save_steps=4, use_cpu=True, disable_tqdm=True,
        )
        callbacks = [Fp8ScopeCallback(str(tmp_path / run), every=3)] + ([Stop()] if stop else [])
        return transformers.Trainer(model=build("llama", fp8), args=args, train_dataset=dataset(4 * 8),
                                    callbacks=callbacks)

    trainer("straight", "a").train()
    trainer("resumed", "b", stop=True).train()
    trainer("resumed", "c").train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))

    def rows(run: str):
        t = fp8scope.load_run(tmp_path / run).table("tensors")
        rows = t.to_pandas().drop(columns=["segment"]).sort_values(["step", "layer", "tensor"])
        return t, rows.reset_index(drop=True)

    (t, resumed), (_, straight) = rows("resumed"), rows("straight")
    assert sorted(set(zip(t["segment"].to_pylist(), t["step"].to_pylist()))) == [
        *[(0, s) for s in range(4)], *[(1, s) for s in range(4, 8)]]  # steps 4-5 logged again, by segment 1
    assert (straight[straight.step == 4]["scale"] != 1).all()
    pd.testing.assert_frame_equal(resumed, straight)


# ---- Lightning ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("fp8", [False, True], ids=["whatif", "fp8"])
@pytest.mark.parametrize("micro", [1, 4], ids=["acc1", "acc4"])
def test_lightning(tmp_path, arch, fp8, micro, capsys):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.utilities import grad_norm

    from fp8scope.integrations.lightning import Fp8ScopeCallback

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build(arch, fp8)
            self.record: dict[int, dict] = {}  # the module's own record of each optimizer step

        def training_step(self, batch, _):
            loss = self.model(input_ids=batch, labels=batch).loss
            rec = self.record.setdefault(self.global_step, {"losses": []})
            rec["losses"].append(loss.item())
            rec["lr"] = self.trainer.optimizers[0].param_groups[0]["lr"]  # what the coming step uses
            return loss

        def on_before_optimizer_step(self, optimizer):  # Lightning's norm, before clipping
            self.record[self.global_step]["grad_norm"] = float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"])

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=2e-3)
            warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}

    steps = 4
    data = torch.stack([d["input_ids"] for d in dataset(4 * micro * steps)])
    dl = torch.utils.data.DataLoader(data, batch_size=4)
    cb = Fp8ScopeCallback(str(tmp_path / "run"), every=2)
    module = LitLM()
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=micro, gradient_clip_val=0.5, callbacks=[cb],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(module, dl)
    run = fp8scope.load_run(tmp_path / "run")
    check_tensors(run, arch, fp8, steps, micro, prefix="model.")
    ours = scalars_by_step(run)
    assert sorted(module.record) == list(range(steps))
    for step, rec in module.record.items():
        assert len(rec["losses"]) == micro
        assert ours["loss"][step] == pytest.approx(sum(rec["losses"]) / micro, rel=1e-5)  # unscaled mean
        assert ours["lr"][step] == pytest.approx(rec["lr"], rel=1e-6)
        assert ours["grad_norm"][step] == pytest.approx(rec["grad_norm"], rel=1e-4)
    assert ours["lr"][0] == pytest.approx(2e-3 / 3)  # the first step's lr, not the scheduler's next one
    assert max(ours["grad_norm"].values()) > 0.5  # clipped steps: the norm logged is the one before clipping
    assert all(math.isfinite(v) for v in ours["loss"].values())
    check_report(tmp_path / "run", fp8, capsys)


@pytest.mark.parametrize("fp8", [False, True], ids=["whatif", "fp8"])
def test_lightning_resumed_from_a_checkpoint_logs_what_the_uninterrupted_run_logs(tmp_path, fp8):
    """``trainer.fit(ckpt_path=...)``: Lightning restores the weights (the emulated layers' scaling
    state with them), optimizer, scheduler and loop position, the callback's monitor continues at
    ``trainer.global_step``, and the what-if tensors continue from the run's log. Two epochs of 4
    steps; a run stopped in its second epoch and resumed from its first epoch's checkpoint logs every
    row as the run that went through does, bit for bit."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fp8scope.integrations.lightning import Fp8ScopeCallback

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build("llama", fp8)

        def training_step(self, batch, _):
            if self.global_step == getattr(self, "stop_at", None):
                self.trainer.should_stop = True
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=2e-3)
            warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}

    data = torch.stack([d["input_ids"] for d in dataset(16)])

    def fit(run: str, stop_at: int | None = None, ckpt: str | None = None) -> None:
        module = LitLM()
        module.stop_at = stop_at
        saves = ModelCheckpoint(dirpath=tmp_path / f"{run}-ckpt", every_n_epochs=1, save_top_k=-1)
        monitor = Fp8ScopeCallback(str(tmp_path / run), every=3)
        trainer = L.Trainer(max_epochs=2, gradient_clip_val=0.5, callbacks=[monitor, saves], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt)

    def rows(run: str) -> pd.DataFrame:
        t = fp8scope.load_run(tmp_path / run).table("tensors").to_pandas().drop(columns=["segment"])
        return t.sort_values(["step", "layer", "tensor"]).reset_index(drop=True)

    fit("straight")
    fit("resumed", stop_at=6)
    (ckpt,) = (tmp_path / "resumed-ckpt").glob("epoch=0-*.ckpt")
    fit("resumed", ckpt=str(ckpt))
    straight = rows("straight")
    assert sorted(straight.step.unique()) == list(range(8)) and (straight[straight.step == 4]["scale"] != 1).all()
    pd.testing.assert_frame_equal(rows("resumed"), straight)
