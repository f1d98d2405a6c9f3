"""asteria.train: the CLI end to end, the data split and batches, presets, and input errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from asteria.train import data, models
from asteria.train.cli import main
from asteria.train.loop import TrainConfig, lr_factor
from asteria.train.optimizers import OPTIMIZERS, build_optimizer, parse_names

# A handful of small steps: enough to exercise validation, refresh flags and every output file.
QUICK = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--val-every", "2"]
QUICK += ["--data-bytes", "100000", "--no-progress", "--threads", "1"]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_compare_writes_every_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    assert main([*QUICK, "--compare", "adamw,soap", "--out", str(out)]) == 0

    records = _read_jsonl(out / "metrics.jsonl")
    assert [(r["optimizer"], r["step"]) for r in records] == [
        (name, step) for name in ("adamw", "soap") for step in range(1, 5)
    ]
    for r in records:
        assert math.isfinite(r["loss"]) and r["step_ms"] > 0 and 0 <= r["opt_ms"] <= r["step_ms"]
        assert ("val_loss" in r) == (r["step"] in (2, 4))
    soap = [r for r in records if r["optimizer"] == "soap"]
    assert soap[0]["refresh"] is True  # the first step initialises every factor
    assert "refresh" not in records[0]  # AdamW has no refresh steps to report

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"adamw", "soap"}
    assert summary["env"]["torch"] == torch.__version__
    for name, run in summary["runs"].items():
        assert run["config"]["optimizer"] == name and run["config"]["steps"] == 4
        assert run["final_val_loss"] == records[4 * ("adamw", "soap").index(name) + 3]["val_loss"]
        assert run["lr"] == OPTIMIZERS[name].lr_for("tiny") and not run["diverged"]

    report = (out / "report.md").read_text()
    assert "| adamw |" in report and "| soap |" in report and "(loss.png)" in report
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    for name in ("adamw", "soap"):
        assert f"{name}: lr {OPTIMIZERS[name].lr_for('tiny'):g}  final loss" in printed


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
    files = data.stdlib_files()
    first = next(f.read_bytes() for f in files if f.stat().st_size > 0)
    assert first[:100] == bytes(a.train[:100].tolist())
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels) and not any(r.startswith("site-packages/") for r in rels)


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
        (["--optimizer", "sgdd"], "unknown optimizer 'sgdd'; choose from adamw, soap"),
        (["--compare", "adamw,lion"], "unknown optimizer 'lion'"),
        (["--compare", "adamw,adamw"], "repeat"),
        (["--compare", ","], "no optimizer names"),
        (["--model", "gpt5"], "invalid choice: 'gpt5'"),
        (["--steps", "0"], "steps must be >= 1, got 0"),
        (["--lr", "-1"], "lr must be > 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--seq-len", "512"], "exceeds model 'tiny'"),
        (["--data", "/no/such/corpus"], "neither 'stdlib' nor an existing file or directory"),
    ],
)
def test_bad_arguments_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*QUICK, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_corpus_too_small_or_empty_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "small.txt").write_bytes(b"x = 1\n" * 20)
    (tmp_path / "empty").mkdir()
    for source, message in [("small.txt", "needs at least"), ("empty", "gave 0 tokens")]:
        with pytest.raises(SystemExit):
            main([*QUICK, "--data", str(tmp_path / source)])
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
