"""bench/gpu_check.sh and the CPU-runnable pieces of the GPU check (docs/gpu.md): the dry run lists
every phase with its command and runs nothing; the measured memory mode skips cleanly without
CUDA; the summary builder judges fixture results against the goals; the refresh-capacity bench
and step_time's --layers/--energy run on CPU at tiny sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench import gpu_summary
from bench._common import device_tag

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
PHASES = [
    "build",
    "info",
    "tests",
    "step_tiny",
    "step_olmo",
    "profile",
    "memory",
    "peers",
    "ttt",
    "summary",
]
STAGES = {
    "1": ["build", "info", "tests", "summary"],
    "2": ["build", "step_tiny", "step_olmo", "summary"],
    "3": ["build", "profile", "memory", "summary"],
    "4": ["build", "peers", "ttt", "summary"],
}
STAGE_LIMIT_S = 480  # at most 8 minutes a stage (issue 50)


def _dry_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", SCRIPT, "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def _phase_lines(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("== phase "):
            out[line.split()[2]] = line
    return out


def _boxes(stdout: str) -> dict[str, tuple[int, int, int]]:
    """phase -> (timeout, box, need) from the dry run's phase lines."""
    out = {}
    for name, line in _phase_lines(stdout).items():
        words = line.replace(",", " ").replace(")", " ").replace("s ", " ").split()
        timeout = int(words[words.index("(timeout") + 1])
        box = int(words[words.index("box") + 1])
        need = int(words[words.index("need") + 1])
        out[name] = (timeout, box, need)
    return out


def test_dry_run_lists_every_phase_and_runs_nothing(tmp_path):
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    phases = _phase_lines(proc.stdout)
    assert list(phases) == PHASES
    assert "TORCH_CUDA_ARCH_LIST=9.0" in phases["build"]
    assert "--no-build-isolation --no-deps -e ." in phases["build"]
    assert "ASTERIA_FORCE_CUDA=1" in phases["build"]
    # the GPU machine's torch (2.11) is inside the supported range: no override (issue 40)
    assert "ASTERIA_UNSUPPORTED_TORCH" not in phases["build"]
    assert "-m asteria.info" in phases["info"]
    assert "tests/gpu/test_window_gpu.py" in phases["tests"]
    for step in (phases["step_tiny"], phases["step_olmo"]):
        assert "bench/step_time.py --device cuda" in step
        for opt in ("soap", "kl_shampoo", "shampoo"):  # every tier, in the same run
            assert all(f"{opt}_{mode}" in step for mode in ("native", "device", "window"))
        assert "adamw" in step
    assert "--model tiny" in phases["step_tiny"] and "--model olmo-150m" in phases["step_olmo"]
    assert "--energy" in phases["step_olmo"]
    profile = phases["profile"]
    assert "bench/profile_step.py --device cuda --model tiny" in profile
    assert "soap_asteria+window" in profile and "soap_asteria+bases_device" in profile
    assert "bench/memory.py --measure-cuda --model olmo-150m" in phases["memory"]
    assert "bench/optim_step.py\\ --device\\ cuda" in phases["peers"]
    assert "ASTERIA_META_SHAMPOO=" in phases["peers"]
    ttt = phases["ttt"]
    assert "bench/time_to_target.py --device cuda --presets tiny" in ttt
    assert "--variants adamw,muon" in ttt and "--seeds 1,2" in ttt
    assert "bench/gpu_summary.py" in phases["summary"]
    for name in ("step_time", "step_time_tiny", "profile_step", "memory", "optim_step"):
        assert f"bench/results/{name}_" in proc.stdout
    for phase in PHASES:  # every phase is time-boxed
        assert "(timeout " in phases[phase]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_fits_its_limit_with_each_phase_s_measured_need(tmp_path, stage):
    """Issue 50: a stage's boxes add up to at most its limit (8 minutes), and each box covers
    the phase's need (NEED_S: docs/gpu.md, "Stages")."""
    proc = _dry_run(tmp_path, "--stage", stage)
    assert proc.returncode == 0, proc.stderr
    boxes = _boxes(proc.stdout)
    assert list(boxes) == STAGES[stage]
    assert sum(box for _, box, _ in boxes.values()) <= STAGE_LIMIT_S - 10
    for name, (timeout, box, need) in boxes.items():
        assert need <= box, f"{name}: box {box}s under its need {need}s"
        assert timeout == box  # at the start of a dry run, nothing has eaten into the boxes
    assert f"stage{stage}" in proc.stdout.splitlines()[0]


def test_a_run_leaves_one_archive_and_one_summary(tmp_path):
    """The device tool brings back at most 8 files: a stage leaves two, the archive holding
    every log and result with the commit."""
    env = {
        **os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
        "ASTERIA_COMMIT": "abc1234",
    }  # fmt: skip
    proc = subprocess.run(
        ["bash", SCRIPT, "--cpu-rehearsal", "--stage", "1", "--only", "info,summary"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert "abc1234" in proc.stdout.splitlines()[0], proc.stdout
    out = sorted(os.listdir(tmp_path / "out"))
    assert out == ["gpu_check_stage1.tar.gz", "gpu_check_stage1.txt"]
    summary = (tmp_path / "out" / "gpu_check_stage1.txt").read_text()
    assert "at abc1234" in summary and "info" in summary
    import tarfile

    with tarfile.open(tmp_path / "out" / "gpu_check_stage1.tar.gz") as tar:
        names = tar.getnames()
    assert "./commit.txt" in names and "./info.log" in names
    assert any(n.startswith("./results/gpu_summary_") for n in names)
    for line in open(os.path.join(ROOT, "build", "gpu_check", "results",
                                  "gpu_summary_cpu_rehearsal.json")):  # fmt: skip
        assert json.loads(line)["recorded"]["commit"] == "abc1234"


def test_dry_run_rehearsal_and_only(tmp_path):
    proc = _dry_run(tmp_path, "--cpu-rehearsal")
    assert proc.returncode == 0, proc.stderr
    phases = _phase_lines(proc.stdout)
    assert "build" not in phases  # a rehearsal never rebuilds the CPU extension
    assert "--device cpu" in phases["step_olmo"] and "--model nano" in phases["step_olmo"]
    assert "--device cpu --quick" in phases["ttt"]
    assert "cpu_rehearsal.json" in proc.stdout

    proc = _dry_run(tmp_path, "--only", "memory,summary")
    assert proc.returncode == 0, proc.stderr
    assert list(_phase_lines(proc.stdout)) == ["memory", "summary"]


@pytest.mark.parametrize(
    "args", [["--bogus"], ["--only", "nosuchphase"], ["--only"], ["--stage", "9"], ["--stage"]]
)
def test_bad_arguments_exit_2(tmp_path, args):
    assert _dry_run(tmp_path, *args).returncode == 2


def test_device_tag():
    assert device_tag("NVIDIA H200") == "h200"
    assert device_tag("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert device_tag("NVIDIA GH200 480GB") == "gh200_480gb"
    assert device_tag("  ") == "unknown"


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.no_gpu  # checks the skip without CUDA
def test_measured_memory_mode_skips_cleanly_without_cuda(capsys):
    from bench import memory

    memory.main(["--measure-cuda"])
    payload = _last_json(capsys.readouterr().out)
    assert payload["benchmark"] == "memory" and payload["mode"] == "measure_cuda"
    assert "no CUDA device" in payload["skipped"]
    assert "measured" not in payload


def test_measured_memory_builds_each_default_optimizer():
    # the first GPU run failed kl_shampoo here: asteria-train's registry spells it kl-shampoo
    from bench import memory

    for name in memory.OPTIMIZERS:  # the default --optimizers, soap,kl_shampoo
        opt = memory.measured_optimizer(name, [torch.nn.Parameter(torch.zeros(4, 4))])
        assert isinstance(opt, memory.OPTIMIZERS[name])
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        memory.measured_optimizer("adam", [torch.nn.Parameter(torch.zeros(2))])


def test_measured_summary_ratios():
    from bench.memory import measured_summary

    runs = {
        "soap": {
            "none": {"peak_bytes": 1000, "resident_bytes": 0},
            "native": {"peak_bytes": 1400, "resident_bytes": 380},
            "asteria": {"peak_bytes": 1200, "resident_bytes": 190},
        }
    }
    s = measured_summary(runs)["soap"]
    assert s["native_optimizer_peak_bytes"] == 400 and s["asteria_optimizer_peak_bytes"] == 200
    assert s["ratio"] == pytest.approx(0.5) and s["resident_ratio"] == pytest.approx(0.5)


def test_measured_summary_with_a_failed_run():
    from bench.memory import measured_summary

    runs = {
        "soap": {
            "none": {"peak_bytes": 1000, "resident_bytes": 0},
            "native": {"peak_bytes": 1400, "resident_bytes": 380},
            "asteria": {"error": "OutOfMemoryError: CUDA out of memory"},
        }
    }
    s = measured_summary(runs)["soap"]
    assert s["native_optimizer_peak_bytes"] == 400 and s["asteria_optimizer_peak_bytes"] is None
    assert s["ratio"] is None and s["resident_ratio"] is None
    memory = {"benchmark": "memory", "mode": "measure_cuda", "measured": {"soap": s},
              "errors": {"soap/asteria": "OutOfMemoryError: CUDA out of memory"}}  # fmt: skip
    row = gpu_summary.memory_rows(memory, None)[0]
    assert row["status"] == "n/a" and "OutOfMemoryError" in row["note"]


def _write(path, payload) -> str:
    path.write_text("a log line\n" + json.dumps(payload) + "\n")
    return str(path)


def _step_fixture(energy: bool = True) -> dict:
    results = {
        "adamw": {"spike_ratio": 1.05, "energy_j_per_step": {"nvml": 10.0}},
        "soap_native": {"spike_ratio": 2.4},
        "soap_asteria": {"spike_ratio": 1.10, "energy_j_per_step": {"nvml": 10.5}},
        "kl_shampoo_native": {"spike_ratio": 2.1},
        "kl_shampoo_asteria": {"spike_ratio": 1.30, "energy_j_per_step": {"nvml": 12.0}},
    }
    ratios = {
        "adamw_vs_adamw_median": 1.0,
        "soap_native_vs_adamw_median": 1.3,
        "soap_asteria_vs_adamw_median": 1.08,
        "kl_shampoo_native_vs_adamw_median": 1.4,
        "kl_shampoo_asteria_vs_adamw_median": 1.2,
    }
    if energy:
        ratios["soap_asteria_vs_adamw_energy_per_step"] = 1.05
        ratios["kl_shampoo_asteria_vs_adamw_energy_per_step"] = 1.2
    config = {"device": "cuda", **({"energy": True} if energy else {})}
    return {"benchmark": "step_time", "config": config, "results": results, "ratios": ratios}


def _by_figure(summary: dict) -> dict[str, dict]:
    return {r["figure"]: r for r in summary["rows"]}


def test_summary_on_fixture_results(tmp_path, capsys):
    step = _write(tmp_path / "step.json", _step_fixture())
    memory = _write(
        tmp_path / "memory.json",
        {"benchmark": "memory", "mode": "measure_cuda",
         "measured": {"soap": {"ratio": 0.6}, "kl_shampoo": {"ratio": 0.8}}},
    )  # fmt: skip
    capacity = _write(
        tmp_path / "capacity.json",
        {"benchmark": "capacity",
         "sizes": [{"n": 256, "eigh_capacity": 3.0, "qr_capacity": 5.0}], "not_measured": [4096]},
    )  # fmt: skip
    gpu_summary.main(["--step-time", step, "--memory", memory, "--capacity", capacity])
    out = capsys.readouterr().out
    summary = _last_json(out)
    rows = _by_figure(summary)
    assert rows["soap_asteria spike (max/median)"]["status"] == "met"
    assert rows["kl_shampoo_asteria spike (max/median)"]["status"] == "MISSED"
    assert rows["soap_native spike (max/median)"]["status"] == "info"
    assert rows["soap_asteria median step / AdamW"]["status"] == "met"
    assert rows["soap_asteria energy per step / AdamW"]["status"] == "met"
    assert rows["kl_shampoo_asteria energy per step / AdamW"]["status"] == "MISSED"
    assert rows["soap device optimizer memory / native"]["status"] == "met"
    assert rows["kl_shampoo device optimizer memory / native"]["status"] == "info"
    assert rows["n=256 eigh capacity (pool/s / device/s)"]["value"] == 3.0
    assert rows["n=4096 capacity"]["status"] == "n/a"
    assert (summary["met"], summary["missed"], summary["unmeasured"]) == (4, 2, 0)
    assert "goals: 4 met, 2 missed, 0 not measured" in out


def test_summary_says_why_a_figure_is_missing(tmp_path):
    load = gpu_summary.load_result
    step = load(_write(tmp_path / "step.json", _step_fixture(energy=False)))
    skipped = {"benchmark": "memory", "mode": "measure_cuda", "skipped": "no CUDA"}
    memory = load(_write(tmp_path / "memory.json", skipped))
    (tmp_path / "bad.json").write_text("not json\n")
    summary = gpu_summary.build_summary(step, memory, load(str(tmp_path / "bad.json")))
    rows = _by_figure(summary)
    energy = rows["soap_asteria energy per step / AdamW"]
    assert energy["status"] == "n/a" and "without --energy" in energy["note"]
    memory_row = rows["soap device optimizer memory / native"]
    assert memory_row["status"] == "n/a" and "no CUDA" in memory_row["note"]
    assert "not JSON" in rows["refresh capacity (pool / device)"]["note"]
    assert summary["unmeasured"] == 3 and summary["met"] == 2

    missing = gpu_summary.build_summary(load(str(tmp_path / "absent.json")), load(None), load(None))
    assert missing["met"] == missing["missed"] == 0 and missing["unmeasured"] == 6
    assert all(r["note"] for r in missing["rows"])


def test_summary_time_to_target_and_capacity_rows(tmp_path):
    # bench/time_to_target.py's figures (the goal: best Asteria <= 0.7x AdamW on every seed) and
    # bench/capacity.py's one-core and device job times, as gpu_check.sh passes them
    load = gpu_summary.load_result
    run = {"ratio_to_reference": {"median": 0.8}, "step_time_vs_reference": {"median": 1.5}}
    never = {"ratio_to_reference": {"median": None}, "step_time_vs_reference": {"median": 2.0}}
    ttt = {
        "benchmark": "time_to_target",
        "presets": {
            "tiny": {"goals": {"best_asteria_worst_ratio": 0.9},
                     "runs": {"adamw": run, "soap:native": never, "soap:asteria": run}},
            "nano": {"goals": {"best_asteria_worst_ratio": 0.6}, "runs": {"adamw": run}},
        },
    }  # fmt: skip
    capacity = {"job_s": {"qr:1024": 0.067, "root:2048": 0.84}, "device_job_s": {"qr:1024": 0.0046}}
    summary = gpu_summary.build_summary(
        load(None), load(None),
        load(_write(tmp_path / "capacity.json", capacity)),
        load(_write(tmp_path / "ttt.json", ttt)),
    )  # fmt: skip
    rows = _by_figure(summary)
    best = "time to AdamW's loss, best Asteria / AdamW (worst seed)"
    assert rows[f"tiny: {best}"]["status"] == "MISSED" and rows[f"nano: {best}"]["status"] == "met"
    assert rows["tiny: soap:asteria time to AdamW's loss / AdamW (median)"]["value"] == 0.8
    assert rows["tiny: soap:native time to AdamW's loss / AdamW (median)"]["status"] == "n/a"
    assert rows["tiny: soap:native median step / AdamW"]["status"] == "info"
    assert rows["qr:1024 one core / device time"]["value"] == pytest.approx(0.067 / 0.0046)
    assert "no device time" in rows["root:2048 one core / device time"]["note"]
    # asked for but missing: one unmeasured goal, with its reason; not asked for: no rows
    missing = gpu_summary.build_summary(load(None), load(None), load(None), load("/nonexistent"))
    assert _by_figure(missing)[best]["status"] == "n/a" and missing["unmeasured"] == 7
    assert not any("AdamW's loss" in r["figure"] for r in gpu_summary.build_summary(
        load(None), load(None), load(None))["rows"])  # fmt: skip


def test_refresh_time_on_cpu(capsys):
    from bench import gpu_refresh_time

    gpu_refresh_time.main(
        ["--device", "cpu", "--sizes", "8,16", "--workers", "1", "--repeats", "1"]
    )
    payload = _last_json(capsys.readouterr().out)
    assert payload["benchmark"] == "capacity" and payload["not_measured"] == []
    assert [r["n"] for r in payload["sizes"]] == [8, 16]
    for row in payload["sizes"]:
        for key in ("device_eigh_ms", "pool_eigh_ms", "pool_qr_per_s", "eigh_capacity"):
            assert row[key] > 0

    gpu_refresh_time.main(["--device", "cpu", "--sizes", "8,16", "--budget-s", "0"])
    payload = _last_json(capsys.readouterr().out)
    assert payload["sizes"] == [] and payload["not_measured"] == [8, 16]


def test_step_time_layers_and_energy_on_cpu(capsys):
    from bench import step_time

    common = ["--model", "nano", "--steps", "12", "--skip", "1", "--batch-size", "2",
              "--seq-len", "16", "--variants", "adamw"]  # fmt: skip
    step_time.main(common)
    plain = _last_json(capsys.readouterr().out)
    assert "layers" not in plain["config"] and "energy" not in plain["config"]
    assert "energy_j_per_step" not in plain["results"]["adamw"]

    step_time.main([*common, "--layers", "1", "--energy"])
    payload = _last_json(capsys.readouterr().out)
    assert payload["config"]["layers"] == 1 and payload["config"]["energy"] is True
    adamw = payload["results"]["adamw"]
    assert set(adamw["energy_j_per_step"]) | set(adamw["energy_unavailable"]) >= {"rapl"}
    assert all(j >= 0 for j in adamw["energy_j_per_step"].values())


def test_step_time_forces_the_tier_each_variant_names(tmp_path, monkeypatch, capsys):
    """Issue 50: ``<opt>_window`` trains through the window (on the CPU: its stand-in),
    ``<opt>_device`` with the bases on the device, whatever auto placement would pick; a
    partial JSON is written after each variant."""
    from bench import step_time

    partial = tmp_path / "partial.json"
    monkeypatch.setenv("BENCH_PARTIAL_JSON", str(partial))
    step_time.main(["--model", "nano", "--layers", "1", "--steps", "12", "--skip", "1",
                    "--batch-size", "2", "--seq-len", "16",
                    "--variants", "soap_window,soap_device,shampoo_window"])  # fmt: skip
    results = _last_json(capsys.readouterr().out)["results"]
    assert results["soap_window"]["bases_access"] == "window"
    assert results["soap_window"]["window"]["fills"] > 0
    assert results["shampoo_window"]["bases_access"] == "window"
    assert results["soap_device"]["bases_access"] is None  # on the device
    written = json.loads(partial.read_text())
    assert written["partial"] is True and set(written["results"]) == set(results)
    assert written["recorded"]["commit"]


def test_step_time_keep_going_records_a_failed_variant(monkeypatch, capsys):
    from bench import step_time

    real = step_time.run_variant

    def run_variant(variant, args, corpus):
        if variant == "soap_native":
            raise RuntimeError("planted failure")
        return real(variant, args, corpus)

    monkeypatch.setattr(step_time, "run_variant", run_variant)
    argv = ["--model", "nano", "--steps", "12", "--skip", "1", "--batch-size", "2",
            "--seq-len", "16", "--variants", "adamw,soap_native"]  # fmt: skip
    with pytest.raises(RuntimeError, match="planted"):
        step_time.main(argv)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        step_time.main([*argv, "--keep-going"])
    assert exit_.value.code == 1
    payload = _last_json(capsys.readouterr().out)
    assert payload["errors"] == {"soap_native": "RuntimeError: planted failure"}
    assert list(payload["results"]) == ["adamw"]


def test_summary_judges_the_window_and_device_tiers_where_they_ran(tmp_path):
    """Stage 2 runs each optimizer natively, with the bases on the device and behind the window
    (no auto variant), and the memory phase the window forced beside auto: the goals apply to
    those rows."""
    results = {"adamw": {"spike_ratio": 1.0}}
    ratios = {}
    for opt in ("soap", "kl_shampoo"):
        for mode, median in (("native", 1.2), ("device", 1.05), ("window", 1.3)):
            results[f"{opt}_{mode}"] = {"spike_ratio": 1.1}
            ratios[f"{opt}_{mode}_vs_adamw_median"] = median
    step = {"results": results, "ratios": ratios, "config": {"device": "cuda"}}
    memory = {
        "benchmark": "memory", "mode": "measure_cuda",
        "measured": {"soap": {"ratio": 1.0, "window_ratio": 0.6},
                     "kl_shampoo": {"ratio": 1.0, "window_ratio": 0.55}},
    }  # fmt: skip
    summary = gpu_summary.build_summary((step, None), (memory, None), (None, "not given"))
    rows = {r["figure"]: r for r in summary["rows"]}
    assert rows["soap_device median step / AdamW"]["status"] == "met"
    assert rows["soap_window median step / AdamW"]["status"] == "MISSED"
    assert rows["kl_shampoo_window spike (max/median)"]["status"] == "met"
    assert "soap_asteria spike (max/median)" not in rows  # not run: no row
    assert rows["soap device optimizer memory / native (window)"]["status"] == "met"
    assert rows["soap device optimizer memory / native (auto)"]["status"] == "info"


def test_measured_summary_has_the_window_beside_auto():
    from bench.memory import measured_summary

    runs = {
        "soap": {
            "none": {"peak_bytes": 1000, "resident_bytes": 0},
            "native": {"peak_bytes": 1400, "resident_bytes": 380},
            "window": {"peak_bytes": 1260, "resident_bytes": 240},
            "asteria": {"peak_bytes": 1400, "resident_bytes": 380},  # auto: bases on the device
        }
    }
    s = measured_summary(runs)["soap"]
    assert s["window_optimizer_peak_bytes"] == 260 and s["window_ratio"] == pytest.approx(0.65)
    assert s["ratio"] == pytest.approx(1.0)


def test_the_time_to_target_stage_uses_options_the_bench_has(tmp_path):
    """Stage 4's hook for issue 49's bench: its command line parses with
    bench/time_to_target.py's own parser (a renamed option fails here, not on the GPU)."""
    import shlex

    from bench import time_to_target

    proc = _dry_run(tmp_path, "--cpu-rehearsal", "--stage", "4")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(_phase_lines(proc.stdout)["ttt"].split(": ", 1)[1])
    argv = words[words.index("bench/time_to_target.py") + 1 :]
    args = time_to_target.parse_args(argv)
    assert args.device == "cpu" and args.tune_missing
    assert "muon" in args.variants and args.eval_seeds["tiny"] == [1, 2]


def test_the_stages_variants_are_ones_the_benches_know(tmp_path):
    import shlex

    from bench import profile_step, step_time

    phases = _phase_lines(_dry_run(tmp_path).stdout)

    def option(phase: str, name: str) -> str:
        words = shlex.split(phases[phase].split(": ", 1)[1])
        return words[words.index(name) + 1]

    for phase in ("step_tiny", "step_olmo"):
        assert set(option(phase, "--variants").split(",")) <= set(step_time.VARIANTS)
    for variant in option("profile", "--variants").split(","):
        profile_step.parse_variant(variant)  # raises for an unknown one


def test_the_peers_stage_names_optimizers_the_bench_has(tmp_path):
    """Stage 4's --only list against bench/optim_step.py's contenders (each one this checkout
    can build: the peers that are installed here, Meta's where ../shared/peers has it)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import optim_step
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    phases = _phase_lines(_dry_run(tmp_path, "--stage", "4").stdout)
    import shlex

    script = shlex.split(phases["peers"].split(": ", 1)[1])[-1]  # bash -c's script
    words = shlex.split(script)
    names = words[words.index("--only") + 1].split(",")
    known = set(optim_step.contenders(None, compile_heavyball=False))
    missing = [n for n in names if n not in known]
    absent = {"meta_shampoo", "meta_soap", "meta_kl_shampoo"} - known  # no ../shared/peers
    assert not set(missing) - absent, missing
    assert len(names) == len(set(names)) >= 10
