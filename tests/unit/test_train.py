"""asteria.train: the CLI end to end, the data split and batches, presets, and input errors."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asteria.train import cli, corpus, data, energy, loop, models, report
from asteria.train.cli import main
from asteria.train.loop import TrainConfig, lr_factor
from asteria.train.optimizers import (
    OPTIMIZERS,
    CPUMuon,
    MuonWithAdamW,
    build_optimizer,
    hidden_matrices,
    parse_names,
    parse_run,
)

# A handful of small steps: enough to exercise validation, refresh flags and every output file.
QUICK = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--val-every", "2"]
QUICK += ["--data-bytes", "100000", "--no-progress", "--threads", "1"]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_compare_writes_every_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    labels = ("adamw", "soap:native", "soap:asteria")
    assert main([*QUICK, "--compare", ",".join(labels), "--out", str(out)]) == 0

    records = _read_jsonl(out / "metrics.jsonl")
    assert [(r["optimizer"], r["step"]) for r in records] == [
        (name, step) for name in labels for step in range(1, 5)
    ]
    for r in records:
        assert math.isfinite(r["loss"]) and r["step_ms"] > 0 and 0 <= r["opt_ms"] <= r["step_ms"]
        assert ("val_loss" in r) == (r["step"] in (2, 4))
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / (r["step_ms"] / 1e3))
        assert r["memory"]["device"] > 0 and r["elapsed_s"] > 0
        assert (r["barrier_wait_ms"] is None) == (r["optimizer"] != "soap:asteria")
        assert ("staleness" in r) == ("installs" in r) == (r["optimizer"] == "soap:asteria")
        assert ("basis_age" in r) == (r["optimizer"] == "soap:asteria")
        if "basis_age" in r:  # the first step makes the bases (0), later steps read them
            assert r["basis_age"] == (None if r["step"] == 1 else r["step"] - 1)
    soap = [r for r in records if r["optimizer"] == "soap:native"]
    assert soap[0]["refresh"] is True  # the first step initialises every factor
    assert "refresh" not in records[0]  # AdamW has no refresh steps to report
    # AdamW keeps two fp32 moments per parameter and a 4-byte step count per tensor.
    model = models.build_model(models.PRESETS["tiny"], vocab_size=257, max_seq_len=32, seed=0)
    adamw_bytes = sum(8 * p.numel() + 4 for p in model.parameters())
    assert records[0]["memory"] == {"device": adamw_bytes}

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["runs"]) == list(labels)
    assert summary["env"]["torch"] == torch.__version__
    assert set(summary["energy"]) == {"sources", "unavailable"}
    for i, (name, run) in enumerate(summary["runs"].items()):
        assert run["config"]["optimizer"] == name.split(":")[0] and run["config"]["steps"] == 4
        assert run["final_val_loss"] == records[4 * i + 3]["val_loss"]
        assert run["status"] == "finished" and not run["diverged"]
        assert run["lr"] == OPTIMIZERS[name.split(":")[0]].lr_for("tiny")
    runtime_summary = summary["runs"]["soap:asteria"]["runtime"]
    assert set(runtime_summary) >= {"staleness_histogram", "jobs", "basis_age"}
    assert runtime_summary["basis_age"]["within_bound"] and runtime_summary["basis_age"]["max"] == 3
    # Staleness 0 would be bit-identical to native; the default budget (5) need not be, but
    # nothing is due between step 1 and step 4 here, so the losses agree.
    native = [r["loss"] for r in records if r["optimizer"] == "soap:native"]
    assert native == [r["loss"] for r in records if r["optimizer"] == "soap:asteria"]

    report = (out / "report.md").read_text()
    for label in labels:
        assert f"| {label} |" in report
    for plot in ("loss.png", "loss_time.png", "step_time.png", "memory.png"):
        assert f"({plot})" in report
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if not summary["energy"]["sources"]:
        assert "Energy: not measured on this machine." in report
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "adamw.pt", "soap_asteria.pt", "soap_native.pt"
    ]  # fmt: skip
    printed = capsys.readouterr().out
    for name in labels:
        assert (
            f"{name}: lr {OPTIMIZERS[name.split(':')[0]].lr_for('tiny'):g}  final loss" in printed
        )
    assert f"report: {(out / 'report.md').resolve()}" in printed


def test_module_entry_point_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "asteria.train", *QUICK, "--optimizer", "adamw", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "final loss" in proc.stdout
    assert len(_read_jsonl(out / "metrics.jsonl")) == 4


def test_same_seed_trains_identically(tmp_path: Path) -> None:
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        main([*QUICK, "--optimizer", "adamw", "--out", str(out)])
        runs.append([r["loss"] for r in _read_jsonl(out / "metrics.jsonl")])
    assert runs[0] == runs[1]


# -- data ---------------------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_and_split_in_slices() -> None:
    a = data.load_corpus(max_bytes=50_000)
    b = data.load_corpus(max_bytes=50_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    n = a.num_tokens
    assert a.val.numel() == sum((j + 1) * n // 100 - j * n // 100 for j in range(19, 100, 20))
    stream = torch.cat([a.train, a.val])
    assert int(stream.min()) >= 0 and int(stream.max()) < data.VOCAB_SIZE
    assert int((stream == data.EOD).sum()) == a.num_documents
    assert stream.numel() == 50_000 + a.num_documents  # the byte cap, plus one EOD per file
    docs = corpus.documents()
    assert docs[0][1][:100] == bytes(a.train[:100].tolist())
    rels = [rel for rel, _ in docs]
    assert rels == sorted(rels) and not any(r.startswith("site-packages/") for r in rels)


def test_embedded_corpus_is_fixed_bytes_with_a_checksum(tmp_path: Path) -> None:
    # Note [Embedded corpus]: the default corpus is the snapshot's bytes whatever Python runs,
    # its checksum the constant, computed alike by the stdlib-only module and by data.py.
    docs = corpus.documents()
    assert len(docs) == 314 and sum(len(d) for _, d in docs) == corpus.SNAPSHOT_BYTES
    assert docs[0][0] == "__future__.py" and docs[-1][0] == "encodings/cp775.py"
    full = data.load_corpus()
    assert full.sha256 == corpus.CORPUS_SHA256 == corpus.checksum(d for _, d in docs)
    assert full.num_tokens == corpus.SNAPSHOT_BYTES + 314 and "CPython 3.11.7" in full.name
    part = data.load_corpus(max_bytes=50_000)
    assert part.sha256 == corpus.checksum((d for _, d in docs), 50_000) != full.sha256
    assert corpus.LICENSE.read_text().startswith("A. HISTORY OF THE SOFTWARE")
    # Under 3.11.7 the snapshot is the interpreter's own library, as the former default read it.
    if sys.version_info[:3] == (3, 11, 7):
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [path for _, path in corpus.stdlib_sources(root)]
        tokens, _ = data._tokenize(files, corpus.SNAPSHOT_BYTES, check_text=False)
        assert data.token_checksum(tokens) == corpus.CORPUS_SHA256
    # The same check in a Python that imports nothing but the module (the command
    # docs/train.md gives for another interpreter).
    proc = subprocess.run(
        [sys.executable, "-I", corpus.__file__], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and corpus.CORPUS_SHA256 in proc.stdout, proc.stdout
    # A corrupted archive is refused, naming the file.
    bad = tmp_path / "bad.tar.xz"
    bad.write_bytes(corpus.ARCHIVE.read_bytes()[:-1] + b"\0")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "ARCHIVE", bad)
        with pytest.raises(corpus.CorpusError, match="bad.tar.xz has SHA-256"):
            corpus.documents()


def test_own_data_keeps_working_and_has_its_checksum(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello world\n" * 400)
    (tmp_path / "b.txt").write_bytes(b"second file\n" * 400)
    c = data.load_corpus(str(tmp_path), min_tokens=16)
    assert c.name == str(tmp_path) and c.num_documents == 2
    stream = b"hello world\n" * 400 + b"second file\n" * 400
    assert c.sha256 == corpus.checksum([stream[:4800], stream[4800:]])
    assert c.sha256 != data.load_corpus(str(tmp_path / "a.txt"), min_tokens=16).sha256


def test_batches_are_deterministic_per_seed() -> None:
    corpus = data.load_corpus(max_bytes=50_000)

    def take(seed: int) -> list[torch.Tensor]:
        stream = data.train_batches(corpus, batch_size=4, seq_len=64, seed=seed)
        return [next(stream) for _ in range(10)]

    first, again, other = take(0), take(0), take(1)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not any(torch.equal(x, y) for x, y in zip(first, other))
    val = data.val_batches(corpus, batch_size=4, seq_len=64, max_batches=3)
    assert [v.shape for v in val] == [(4, 64)] * 3
    assert torch.equal(val[0][0], corpus.val[:64].long())


def test_train_and_val_windows_never_cross_the_split(tmp_path: Path) -> None:
    # 9,999 bytes + EOD = 10,000 tokens in 100 slices of 100; slices 19, 39, .. 99 are validation.
    text = bytes(ord("z") if (i // 100) % 20 == 19 else ord("a") for i in range(9999))
    (tmp_path / "text.txt").write_bytes(text)
    corpus = data.load_corpus(str(tmp_path))
    assert corpus.train.numel() == 9500 and bool((corpus.train == ord("a")).all())
    assert int((corpus.val == ord("z")).sum()) == 499 and int(corpus.val[-1]) == data.EOD
    stream = data.train_batches(corpus, batch_size=4, seq_len=64, seed=0)
    assert all(bool((next(stream) == ord("a")).all()) for _ in range(50))
    val = data.val_batches(corpus, batch_size=4, seq_len=64, max_batches=10)
    assert sum(v.shape[0] for v in val) == 500 // 64
    assert all(bool((v != ord("a")).all()) for v in val)


# -- models, schedule, optimizer table ----------------------------------------------------------


def test_tiny_preset_builds_and_counts() -> None:
    preset = models.get_preset("tiny")
    model = models.build_model(preset, vocab_size=data.VOCAB_SIZE, max_seq_len=64, seed=0)
    assert sum(p.numel() for p in model.parameters()) == models.num_params(
        preset, vocab_size=data.VOCAB_SIZE
    )
    again = models.build_model(preset, vocab_size=data.VOCAB_SIZE, max_seq_len=64, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("name", list(models.PRESETS))
def test_every_preset_gives_a_config(name: str) -> None:
    preset = models.PRESETS[name]
    cfg = models.olmo2_config(preset, vocab_size=50304, max_seq_len=preset.max_seq_len)
    assert cfg.hidden_size == preset.hidden_size and cfg.num_hidden_layers == preset.num_layers
    assert cfg.intermediate_size % 128 == 0 and cfg.intermediate_size >= 8 * cfg.hidden_size / 3


def test_large_preset_shapes() -> None:
    assert models.PRESETS["olmo2-7b"].intermediate_size == 11008  # OLMo 7B (fused: 22016)
    assert (models.PRESETS["olmo-660m"].hidden_size, models.PRESETS["olmo-660m"].num_heads) == (
        1408,
        22,
    )
    assert models.num_params(models.PRESETS["olmo2-7b"], vocab_size=100352) == pytest.approx(
        7.30e9, rel=0.005
    )


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = TrainConfig(steps=100, warmup_frac=0.1)
    factors = [lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert factors[-1] == pytest.approx(0.1, abs=0.01)
    # Muon's (Note [Muon as people use it]): the peak from step 0 for 60 % of the steps, then a
    # linear cooldown to 10 %
    muon = [lr_factor(s, TrainConfig(steps=100, optimizer="muon")) for s in range(100)]
    assert muon[:60] == [1.0] * 60 and muon[60] == pytest.approx(1.0)
    assert muon[80] == pytest.approx(0.55) and muon[-1] == pytest.approx(0.1225)
    assert all(a > b for a, b in zip(muon[60:], muon[61:]))


def test_muon_is_torchs_on_the_hidden_matrices_and_adamw_on_the_rest() -> None:
    model = models.build_model(models.PRESETS["nano"], vocab_size=257, max_seq_len=32, seed=0)
    hidden = hidden_matrices(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted({names[id(p)].split(".")[-2] for p in hidden}) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"
    ]  # fmt: skip
    assert len(hidden) == 2 * 7  # two layers; not the embedding, not the output layer
    opt = build_optimizer("muon", model.parameters(), 0.01, hidden=hidden)
    assert isinstance(opt, MuonWithAdamW) and isinstance(opt.muon, torch.optim.Muon)
    assert isinstance(opt.adamw, torch.optim.AdamW)
    muon_group, adamw_group = opt.param_groups
    assert muon_group["muon"] and muon_group["adjust_lr_fn"] == "match_rms_adamw"
    assert muon_group["weight_decay"] == 0.1 and muon_group["momentum"] == 0.95
    assert not adamw_group["muon"] and adamw_group["betas"] == (0.9, 0.95)
    assert adamw_group["weight_decay"] == 0.01 and muon_group["lr"] == adamw_group["lr"] == 0.01
    rest = {names[id(p)] for p in adamw_group["params"]}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= rest
    # one scheduler drives both optimizers: the groups are theirs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[0]["lr"] == 0.005
    x = torch.randint(0, 257, (2, 32))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    sched.step()
    assert set(opt.state) == {p for p in model.parameters()}
    assert all("momentum_buffer" in opt.state[p] for p in hidden)
    # state_dict round trip (saved and loaded as a checkpoint is): the copy steps as the original
    twin = models.build_model(models.PRESETS["nano"], vocab_size=257, max_seq_len=32, seed=0)
    twin.load_state_dict(model.state_dict())
    twin_opt = build_optimizer("muon", twin.parameters(), 0.01, hidden=hidden_matrices(twin))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin_opt.load_state_dict(torch.load(buf, weights_only=True))
    assert twin_opt.muon.state is twin_opt.state and twin_opt.adamw.param_groups[0]["lr"] == 0.005
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(input_ids=x, labels=x).loss.backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_cpu_muon_is_torchs_update_with_a_float32_iteration() -> None:
    # With torch's bfloat16 iteration it is torch.optim.Muon bit for bit; on a CPU its default,
    # float32, is the same iteration, closer to the exact orthogonalization.
    torch.manual_seed(0)
    w0, grads = torch.randn(48, 24), [torch.randn(48, 24) for _ in range(3)]
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    weights = []
    for make in (
        lambda p: torch.optim.Muon([p], **kw),
        lambda p: CPUMuon([p], ns_dtype=torch.bfloat16, **kw),
        lambda p: CPUMuon([p], **kw),
    ):
        p = torch.nn.Parameter(w0.clone())
        o = make(p)
        for g in grads:
            p.grad = g.clone()
            o.step()
        weights.append(p.detach())
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[1], weights[2])
    assert torch.allclose(weights[1], weights[2], atol=0.02 * 0.2 * 48**0.5 * 3 * 0.1)


def test_continuous_mode_and_the_first_order_optimizers_parse() -> None:
    assert parse_run("soap:continuous").mode == "continuous"
    assert parse_run("soap-f1").label == "soap-f1:native"
    assert parse_run("muon").label == "muon"
    with pytest.raises(ValueError, match="muon has no preconditioner refreshes"):
        parse_run("muon:continuous")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_table_builds_each(name: str) -> None:
    for model in ("nano", "tiny", "olmo2-7b"):
        opt = build_optimizer(name, [torch.nn.Parameter(torch.zeros(4, 3))], model=model)
        assert (
            opt.param_groups[0]["lr"]
            == OPTIMIZERS[name].lrs[model if model != "olmo2-7b" else "tiny"]
        )


# -- input errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer", "sgdd"], "unknown optimizer 'sgdd'; choose from adamw, soap, kl-shampoo"),
        (["--compare", "adamw:asteria"], "adamw has no preconditioner refreshes"),
        (["--compare", "soap:fast"], "unknown mode 'fast' in 'soap:fast'; choose from native"),
        (["--model", "gpt5"], "invalid choice: 'gpt5' (choose from 'nano', 'tiny', 'olmo-60m'"),
        (["--staleness", "-1"], "staleness must be an integer >= 0, got -1"),
        (["--fixed-delay", "9"], "fixed_delay must be in [0, staleness=5]"),
        (["--fsdp", "--optimizer", "soap"], "runs under torchrun"),
        (["--fsdp", "--compare", "adamw,muon"], "muon under --fsdp/--hsdp"),
        (["--fsdp"], "runs under torchrun"),
        (["--token-dtype", "uint16"], "--token-dtype needs --data to be one token file"),
        (["--compare", "adamw,lion"], "unknown optimizer 'lion'"),
        (["--compare", "adamw,adamw"], "repeat"),
        (["--compare", ","], "no optimizer names"),
        (["--steps", "0"], "steps must be >= 1, got 0"),
        (["--lr", "-1"], "lr must be > 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--seq-len", "512"], "exceeds model 'tiny'"),
        (["--data", "/no/such/corpus"], "neither 'stdlib' nor an existing file or directory"),
    ],
)
def test_bad_arguments_are_usage_errors(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        which = [] if {"--optimizer", "--compare"} & set(argv) else ["--optimizer", "adamw"]
        main([*QUICK, *which, *argv, "--out", str(out)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing written


def test_corpus_too_small_or_empty_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "small.txt").write_bytes(b"x = 1\n" * 20)
    (tmp_path / "empty").mkdir()
    for source, message in [("small.txt", "needs at least"), ("empty", "gave 0 tokens")]:
        with pytest.raises(SystemExit):
            main([*QUICK, "--data", str(tmp_path / source), "--out", str(tmp_path / "run")])
        assert message in capsys.readouterr().err


def test_parse_names_keeps_order() -> None:
    assert parse_names(" soap, adamw ") == ["soap", "adamw"]


def test_readme_usage_example_runs() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert 10 <= len(example.splitlines()) <= 16 and "from asteria.optim import SOAP" in example
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["loss"].item() < 1.5  # from ln(8) = 2.08 at the start


# -- run folder, checkpoints, resume, Ctrl-C ------------------------------------------------------


def test_existing_run_folder_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    with pytest.raises(SystemExit) as exc:
        main([*QUICK, "--optimizer", "adamw", "--out", str(out)])
    assert exc.value.code == 2
    assert "already exists; pass --resume" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == "precious\n"
    with pytest.raises(SystemExit):
        main([*QUICK, "--resume", "--out", str(tmp_path / "none")])
    assert "holds no run to continue" in capsys.readouterr().err


def _model_state(out: Path, label: str) -> dict[str, torch.Tensor]:
    path = out / "checkpoints" / f"{label.replace(':', '_')}.pt"
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.parametrize(
    ("runs", "steps", "stop", "extra"),
    [
        ("adamw", 6, 4, []),
        ("muon", 6, 4, []),
        ("soap:native", 6, 4, []),
        # refreshes requested at step 11 install at 13: in flight at the stop, in the checkpoint
        ("soap:asteria", 14, 12, ["--staleness", "2", "--fixed-delay", "2", "--workers", "1"]),
    ],
)
def test_stopped_and_resumed_run_matches_an_uninterrupted_one(
    tmp_path: Path, runs: str, steps: int, stop: int, extra: list[str], capsys
) -> None:
    args = [*QUICK, "--model", "nano", "--steps", str(steps), "--val-every", "3"]
    args += ["--compare", runs, *extra]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main([*args, "--out", str(whole)]) == 0
    assert main([*args, "--out", str(split), "--stop-after", str(stop)]) == 0
    assert "continue with: asteria-train --resume" in capsys.readouterr().out
    assert len(_read_jsonl(split / "metrics.jsonl")) == stop
    saved = torch.load(split / "checkpoints" / f"{runs.replace(':', '_')}.pt", weights_only=True)
    if runs.endswith(":asteria"):
        assert len(saved["runtime_state"]["pending"]) > 0
    assert not (split / "report.md").read_text().count("| finished")  # partial report
    # A resume may not change the run; it may leave everything out but --out.
    with pytest.raises(SystemExit):
        main([*args, "--steps", "17", "--out", str(split), "--resume"])
    assert "--resume cannot change a run's settings: --steps 17" in capsys.readouterr().err
    assert main(["--resume", "--out", str(split), "--no-progress"]) == 0
    assert f"{runs}: resuming at step {stop}" in capsys.readouterr().out

    a, b = _read_jsonl(whole / "metrics.jsonl"), _read_jsonl(split / "metrics.jsonl")
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in a] == [
        (r["step"], r["loss"], r.get("val_loss")) for r in b
    ]
    sa, sb = _model_state(whole, runs), _model_state(split, runs)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    summary = json.loads((split / "summary.json").read_text())
    assert (
        summary["runs"][runs]["status"] == "finished"
        and summary["runs"][runs]["steps_done"] == steps
    )
    # Resuming a finished run trains nothing and writes the same outputs again.
    assert main(["--resume", "--out", str(split), "--no-progress"]) == 0
    assert "done in an earlier invocation" in capsys.readouterr().out
    assert _read_jsonl(split / "metrics.jsonl") == b


def test_ctrl_c_stops_cleanly_with_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "asteria.train", *QUICK, "--model", "nano", "--steps", "100000"]
    cmd += ["--optimizer", "adamw", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Ctrl-C: stopping after this step" in stderr
    assert "continue with: asteria-train --resume --out" in stdout
    saved = torch.load(out / "checkpoints" / "adamw.pt", weights_only=True)
    assert saved["status"] == "running" and saved["step"] == len(_read_jsonl(metrics)) >= 3
    assert saved["batches"]["position"] == saved["step"]
    assert (out / "report.md").exists() and (out / "loss.png").exists()


# -- token files and bad data -------------------------------------------------------------------


def test_token_files_in_olmo_numpy_layout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ids = (np.arange(20_000) * 7919 % 1000).astype(np.uint16)
    raw = tmp_path / "part-0.npy"  # OLMo's files: raw ids, no header, despite the suffix
    ids.tofile(raw)
    corpus = data.load_corpus(str(raw), token_dtype="uint16")
    assert corpus.kind == "tokens" and corpus.vocab_size == 1000 and corpus.num_tokens == 20_000
    assert torch.equal(torch.cat([corpus.train, corpus.val]).sort().values,
                       torch.from_numpy(ids.astype(np.int32)).sort().values)  # fmt: skip
    header = tmp_path / "with_header.npy"
    np.save(header, ids.astype(np.uint32))
    assert data.load_corpus(str(header), vocab_size=1024).vocab_size == 1024

    out = tmp_path / "run"
    argv = [*QUICK, "--model", "nano", "--optimizer", "adamw", "--data", str(raw)]
    assert main([*argv, "--token-dtype", "uint16", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env"]["vocab_size"] == 1000 and "raw uint16 tokens" in summary["env"]["data"]
    assert "nats per token" not in (out / "report.md").read_text()  # the label lives in the plots

    bad = [
        ([str(raw)], "is not a text file (it has NUL bytes)"),
        ([str(raw), "--token-dtype", "uint32"], "read as raw uint32 has token id"),
        ([str(header), "--token-dtype", "uint16"], "holds uint32 ids but --token-dtype is uint16"),
        ([str(header), "--vocab-size", "10"], "outside --vocab-size 10"),
    ]
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    bad.append(([str(tmp_path / "odd.bin"), "--token-dtype", "uint16"], "not a multiple of 2"))
    np.save(tmp_path / "matrix.npy", np.zeros((4, 4), dtype=np.uint16))
    bad.append(([str(tmp_path / "matrix.npy")], "2-D uint16 array"))
    for extra, message in bad:
        with pytest.raises(SystemExit) as exc:
            main([*argv[:-1], *extra, "--out", str(tmp_path / "bad")])
        assert exc.value.code == 2 and not (tmp_path / "bad").exists()
        assert message in capsys.readouterr().err


# -- energy, memory, runtime flags --------------------------------------------------------------


def _zone(root: Path, name: str, energy: int, max_range: int) -> Path:
    zone = root / name
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "energy_uj").write_text(f"{energy}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_range}\n")
    return zone


def test_rapl_counts_across_wraparound_and_reports_unreadable_zones(tmp_path: Path) -> None:
    zone = _zone(tmp_path, "intel-rapl:0", 900, 1000)
    _zone(tmp_path, "intel-rapl:0:0", 5, 1000)  # a subzone: inside the package, not added again
    meter = energy.EnergyMeter.probe(str(tmp_path), use_nvml=False)
    assert meter.sources == ["rapl"] and meter.measured
    meter.start()
    (zone / "energy_uj").write_text("950\n")
    assert meter.read() == {"rapl": pytest.approx(50e-6)}
    (zone / "energy_uj").write_text("100\n")  # wrapped at 1000: +150
    assert meter.read() == {"rapl": pytest.approx(200e-6)}

    locked = tmp_path / "locked"
    z = _zone(locked, "intel-rapl:0", 1, 10)
    (z / "energy_uj").unlink()
    (z / "energy_uj").mkdir()  # unreadable (as root, chmod would not stop a read)
    meter = energy.EnergyMeter.probe(str(locked), use_nvml=False)
    assert not meter.measured and "IsADirectoryError" in meter.unavailable["rapl"]
    assert meter.describe().startswith("not measured on this machine")
    none = energy.EnergyMeter.probe(str(tmp_path / "absent"), use_nvml=False)
    assert "no " in none.unavailable["rapl"] and none.read() == {}


def test_efficiency_figure_needs_adamw_energy() -> None:
    assert energy.efficiency(257, 2.0, 200.0, 100.0) == pytest.approx((math.log(257) - 2.0) / 2)
    runs = {
        "adamw": {"final_val_loss": 2.5, "final_loss": 2.6, "energy_j": {"rapl": 100.0}},
        "soap:asteria": {"final_val_loss": 2.0, "final_loss": 2.1, "energy_j": {"rapl": 150.0}},
    }
    assert report.add_efficiency(runs, 257) == "rapl"
    assert runs["soap:asteria"]["efficiency"] == pytest.approx((math.log(257) - 2.0) / 1.5)
    assert runs["adamw"]["efficiency"] == pytest.approx(math.log(257) - 2.5)
    assert report.add_efficiency({"soap:native": {"energy_j": {}}}, 257) is None
    unmeasured = {"adamw": {"final_val_loss": 2.5, "final_loss": 2.6, "energy_j": {}}}
    assert (
        report.add_efficiency(unmeasured, 257) is None and "efficiency" not in unmeasured["adamw"]
    )


def test_memory_by_tier_reads_the_runtime_report_or_counts_state() -> None:
    p = torch.nn.Parameter(torch.zeros(10, 10))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    assert loop.memory_by_tier(opt, None) == {"device": 2 * 400 + 4}

    class Reporting:
        def memory_report(self) -> dict:
            return {
                "device": {"factors": 100, "moments": 20},
                "host": {"bases": 3000},
                "nvme": {"bases": 0},
                "planned": {"device": 1},
                "spill": None,
            }

    assert loop.memory_by_tier(opt, Reporting()) == {"device": 120, "host": 3000, "nvme": 0}

    class Failing:
        def memory_report(self) -> dict:
            raise RuntimeError("not yet")

    assert loop.memory_by_tier(opt, Failing()) == {"device": 804}


def test_runtime_knobs_are_flags_with_the_library_defaults() -> None:
    from asteria.runtime import RuntimeConfig

    parser = cli.build_parser()
    assert cli.runtime_config(parser.parse_args([])) == RuntimeConfig()
    args = parser.parse_args(["--staleness", "2", "--workers", "1", "--no-hooks"])
    assert cli.runtime_config(args) == RuntimeConfig(staleness=2, workers=1, hooks=False)
    text = parser.format_help()
    for f in dataclasses.fields(RuntimeConfig):
        if cli._knob_parser(f.type) is not None:
            assert "--" + f.name.replace("_", "-") in text


def test_fsdp_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    argv = [*QUICK, "--model", "nano", "--steps", "3", "--optimizer", "adamw"]
    one = tmp_path / "one"
    assert main([*argv, "--out", str(one)]) == 0
    out = tmp_path / "fsdp"
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "asteria.train",
        "--fsdp",
        *argv,
    ]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("adamw: lr") == 1  # rank 0 alone prints and writes
    assert "fsdp over 2 processes" in (out / "report.md").read_text()
    a, b = _read_jsonl(one / "metrics.jsonl"), _read_jsonl(out / "metrics.jsonl")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    assert [r["val_loss"] for r in a if "val_loss" in r] == pytest.approx(
        [r["val_loss"] for r in b if "val_loss" in r], rel=1e-5
    )


def test_fsdp_second_order_checkpoints_per_shard_and_resumes_under_torchrun(
    tmp_path: Path,
) -> None:
    """Asteria's optimizers under ``--fsdp``: their per-shard state goes through
    asteria.checkpoint; a run stopped at step 3 and resumed on 2 processes gives the same losses
    as the run without a stop, bit for bit; resuming on 1 process is refused with a message."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    argv = [*QUICK, "--model", "nano", "--steps", "6", "--compare", "soap:native,soap:asteria"]

    def launch(procs: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
        cmd = [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            str(procs),
            "-m",
            "asteria.train",
            "--fsdp",
            *argv,
        ]
        return subprocess.run(
            [*cmd, *extra, "--out", str(out)], capture_output=True, text=True, timeout=300
        )

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for proc in (launch(2, straight), launch(2, stopped, "--stop-after", "3")):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == [
        "soap_native.pt",
        "soap_native.step3.dcp",
    ]
    refused = launch(1, stopped, "--resume")
    assert refused.returncode != 0
    assert "saved by 2 ranks with sharded parameters and cannot be loaded on 1" in refused.stderr
    resumed = launch(2, stopped, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 3" in resumed.stdout
    a, b = _read_jsonl(straight / "metrics.jsonl"), _read_jsonl(stopped / "metrics.jsonl")
    assert [(r["optimizer"], r["loss"]) for r in a] == [(r["optimizer"], r["loss"]) for r in b]
    names = sorted(p.name for p in (stopped / "checkpoints").iterdir())
    assert names == [
        "soap_asteria.pt",
        "soap_asteria.step6.dcp",
        "soap_native.pt",
        "soap_native.step6.dcp",
    ]  # the step-3 directory went once the step-6 file named its successor


def test_the_training_leaves_the_refresh_workers_a_core_by_default(monkeypatch) -> None:
    """issue 24, item 5: on a CPU the training takes all cores but one by default, and the
    report's note says what the cores stand for; every core taken is said too."""
    from asteria.train.cli import training_threads

    cpu = torch.device("cpu")
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    threads, note = training_threads(None, cpu, distributed=False)
    assert threads == 3 and "3 of 4 CPU cores (by default)" in note and "1 core left" in note
    threads, note = training_threads(4, cpu, distributed=False)
    assert threads == 4 and "none is left for them" in note
    assert training_threads(None, cpu, distributed=True)[0] is None  # torchrun: torch's
    assert training_threads(None, torch.device("meta"), distributed=False) == (None, None)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert training_threads(None, cpu, distributed=False)[0] is None


def test_continuous_refresh_from_the_command_line(tmp_path: Path) -> None:
    """``--refresh continuous`` (issue 19): the runtime refreshes inside the interval, and the
    summary and report say how often blocks installed and where the jobs ran."""
    out = tmp_path / "run"
    argv = [*QUICK, "--model", "nano", "--steps", "12", "--optimizer", "soap", "--mode", "asteria"]
    argv += ["--refresh", "continuous", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    (run,) = summary["runs"].values()
    refresh = run["runtime"]["refresh"]
    assert refresh["mode"] == "continuous"
    assert refresh["interval_max"] is not None and refresh["interval_mean"] < 10
    assert run["runtime"]["placement"]["jobs"]["pool"] > 0
    assert run["runtime"]["basis_age"]["within_bound"]
    report_md = (out / "report.md").read_text()
    assert "steps between installs (mean, max)" in report_md and "(continuous)" in report_md


def test_compare_knows_muon_soap_f1_and_continuous_refresh(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Issue 49: asteria-train --compare runs Muon, SOAP at frequency 1 and the runtime's
    # continuous refresh, and reports the corpus's checksum.
    out = tmp_path / "run"
    labels = ("adamw", "muon", "soap-f1:native", "soap:continuous")
    assert main([*QUICK, "--model", "nano", "--compare", ",".join(labels), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["runs"]) == list(labels)
    assert summary["env"]["data_sha256"] == data.load_corpus(max_bytes=100_000).sha256
    assert summary["runs"]["muon"]["lr"] == OPTIMIZERS["muon"].lr_for("nano")
    assert summary["runs"]["soap:continuous"]["runtime"]["refresh"]["mode"] == "continuous"
    assert "runtime" not in summary["runs"]["soap-f1:native"]
    records = _read_jsonl(out / "metrics.jsonl")
    f1 = [r for r in records if r["optimizer"] == "soap-f1:native"]
    assert all(r["refresh"] for r in f1)  # a refresh at every step
    muon = [r for r in records if r["optimizer"] == "muon"]
    assert [r["lr"] for r in muon] == [OPTIMIZERS["muon"].lr_for("nano")] * 3 + [
        pytest.approx(OPTIMIZERS["muon"].lr_for("nano") * 0.6625)
    ]  # the peak from the first step; step 4 of 4 (x = 0.75) in the cooldown
    printed = capsys.readouterr().out
    assert f"sha256 {summary['env']['data_sha256']}" in printed
    assert f"sha256 {summary['env']['data_sha256']}" in (out / "report.md").read_text()
