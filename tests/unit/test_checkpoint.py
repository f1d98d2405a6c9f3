"""Checkpoints with refreshes in flight (issue 7, item 1; Note [Checkpoints with work in flight]
in asteria/runtime/state.py): a ``fixed_delay`` run saved while refreshes are in flight and
resumed in a fresh process follows the uninterrupted run bit for bit."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(1)
    from asteria.optim import SOAP, KLShampoo, Shampoo
    from asteria.runtime import Runtime, RuntimeConfig

    name, steps, save_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ckpt, out = sys.argv[4:6]
    # "plain": what a framework does: save model and optimizer, load both, then attach
    plain = sys.argv[6:] == ["plain"]
    cls = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 4))
    opt = cls(model.parameters(), precondition_frequency=5)
    config = RuntimeConfig(staleness=3, fixed_delay=2, workers=1)
    rt = None if plain else Runtime(model, opt, config)
    start = 0
    if save_at < 0:  # resume
        state = torch.load(ckpt, weights_only=plain)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if not plain:
            rt.load_state_dict(state["runtime"])
        start = state["step"]
    if rt is None:
        rt = Runtime(model, opt, config)
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(32, 12, generator=gen)
        opt.zero_grad()
        model(x).sin().square().mean().backward()
        opt.step()
        if step + 1 == save_at:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}
            if not plain:
                state["runtime"] = rt.state_dict()
            torch.save(state, ckpt)
            in_flight = state["optimizer"].get("asteria_runtime", {}).get("pending", [])
            print("in flight at save:", len(in_flight))
    rt.close()
    torch.save([p.detach() for p in model.parameters()], out)
    """
)


def _run(tmp_path, *args) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("plain", [False, True], ids=["with_runtime_state", "plain_torch"])
@pytest.mark.parametrize("name", ["soap", "kl_shampoo", "shampoo"])
def test_resume_with_refreshes_in_flight_is_bitwise(name, plain, tmp_path):
    """Also the plain torch pattern (issue 16, item 8): only ``model.state_dict()`` and
    ``optimizer.state_dict()`` saved (loaded with ``weights_only=True``), the runtime attached
    after loading: the optimizer's state carries the refreshes in flight (Note [Runtime state in
    the optimizer's checkpoint] in asteria/optim/base.py)."""
    ckpt = tmp_path / "ckpt.pt"
    mode = ["plain"] if plain else []
    _run(tmp_path, name, 100, 0, ckpt, tmp_path / "straight.pt")
    # the 51st step is the optimizers' step 50 (their first only initialises): it requests
    # refreshes that install at step 52, so they are in flight at the save. Shampoo requests
    # them one step ahead (Note [Refresh lead]): at its step 49, in flight after the 50th.
    save_at = 50 if name == "shampoo" else 51
    printed = _run(tmp_path, name, 100, save_at, ckpt, tmp_path / "first.pt", *mode)
    assert "in flight at save: 0" not in printed and "in flight at save:" in printed
    _run(tmp_path, name, 100, -1, ckpt, tmp_path / "resumed.pt", *mode)
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_resume_without_the_runtime_state_diverges(tmp_path):
    """The test above can fail: dropping the refreshes in flight changes the continuation."""
    ckpt = tmp_path / "ckpt.pt"
    _run(tmp_path, "soap", 60, 0, ckpt, tmp_path / "straight.pt")
    _run(tmp_path, "soap", 60, 51, ckpt, tmp_path / "first.pt")
    state = torch.load(ckpt, weights_only=False)
    state["runtime"]["pending"] = []
    del state["optimizer"]["asteria_runtime"]
    torch.save(state, ckpt)
    _run(tmp_path, "soap", 60, -1, ckpt, tmp_path / "resumed.pt")
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert any(not torch.equal(a, b) for a, b in zip(straight, resumed))


def test_load_state_dict_rejects_what_it_cannot_use():
    from asteria.optim import SOAP
    from asteria.runtime import Runtime, RuntimeConfig

    model = torch.nn.Linear(4, 3)
    opt = SOAP(model.parameters())
    with Runtime(model, opt, RuntimeConfig(workers=1)) as rt:
        with pytest.raises(ValueError, match="format 1"):
            rt.load_state_dict({"pending": []})
        bogus = {"format": 1, "pending": [{"key": (0, 0), "requested": 5, "results": [None]}]}
        bogus["pending"][0]["error"] = None
        with pytest.raises(ValueError, match="load the optimizer's state_dict first"):
            rt.load_state_dict(bogus)


@pytest.mark.parametrize("name", ["soap", "kl_shampoo", "shampoo"])
def test_native_and_orchestrated_checkpoints_load_into_each_other(name):
    """A native checkpoint continues under the runtime at S=0 exactly as natively, and the
    orchestrated optimizer's checkpoint continues natively exactly as under the runtime."""
    from asteria.optim import SOAP, KLShampoo, Shampoo
    from asteria.runtime import Runtime, RuntimeConfig

    cls = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}[name]

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        return model, cls(model.parameters(), precondition_frequency=4)

    def train(model, opt, steps, first):
        for step in range(first, first + steps):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).sin().square().mean().backward()
            opt.step()

    def params(model):
        return [p.detach().clone() for p in model.parameters()]

    model, opt = setup()
    train(model, opt, 10, 0)
    # state_dict() returns references to the live state (torch.optim's convention): copy it
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, 10, 10)
    native = params(model)

    # native -> orchestrated (S = 0 is native mode bit for bit)
    model, opt = setup()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)):
        train(model, opt, 5, 10)
        mid = copy.deepcopy((model.state_dict(), opt.state_dict()))
        train(model, opt, 5, 15)
    assert all(torch.equal(a, b) for a, b in zip(params(model), native))

    # orchestrated -> native
    model, opt = setup()
    model.load_state_dict(mid[0])
    opt.load_state_dict(mid[1])
    train(model, opt, 5, 15)
    assert all(torch.equal(a, b) for a, b in zip(params(model), native))
