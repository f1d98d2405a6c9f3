"""The tier policy: which memory tier each kind of optimizer state lives in.

Owns: the state kinds and tiers, the rule that places them (``plan``) and the planned bytes per
tier and kind. Pure: budgets, architecture facts (``Arch``) and per-block sizes (``BlockSizes``,
in the step's order) in, a ``Placement`` out (``accounting.py`` sizes an optimizer).

Kinds: ``factors`` and ``moments`` (every step: the device); ``bases`` (the results in use:
``auto`` puts them in host memory, read through mapped views on unified-memory machines and
directly on a CPU, on a discrete GPU on the device where they fit the budget, Note [Bases by
budget], else behind a device window, Note [Bases window] in window.py, for an optimizer that
reads them in the runtime's pieces, ``bases_window``); ``results`` (finished refreshes waiting
for ``fixed_delay``: host, the coldest to NVMe when ``host_budget_bytes`` binds);
``snapshots`` (a spilled refresh's inputs, with it on NVMe); ``staging`` (pinned host slots).

Note [Bases by budget]: behind the window a step pays host work per piece and device copies, on
the device nothing. So under ``auto`` the bases stay on the device where its optimizer state with
them fits ``bases_device_bytes`` (``device_bases_fraction`` of the memory free at attach) and
``device_budget_bytes``. ``memory_report()["placement"]["notes"]`` says what was chosen, why.

Note [Window by shape group]: a slot of one block's bases cut every group to single blocks (4.4x
to 15.6x native SOAP's ATen ops a step, growing with the layers). So a slot holds the largest
shape group's bases (``BlockSizes.group``), as far as the room beside the factors and moments
allows (at least the largest block's): a step fills the window about once per shape group.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "KINDS",
    "PLACEABLE",
    "TIERS",
    "Arch",
    "BlockSizes",
    "Placement",
    "explicit_tiers",
    "plan",
]

TIERS = ("device", "host", "nvme")
KINDS = ("factors", "moments", "bases", "results", "snapshots", "staging")
#: What an explicit ``placement`` may choose, per kind (the first entry is the ``auto`` home).
PLACEABLE: dict[str, tuple[str, ...]] = {
    "factors": ("device",),
    "moments": ("device",),
    "bases": ("host", "device"),
    "results": ("host", "nvme"),
}


@dataclass(frozen=True)
class Arch:
    """What the machine is: ``cuda`` (the optimizer's tensors are on a GPU) and
    ``unified_memory`` (the GPU reads host memory coherently at speed: GH200/GB10, i.e.
    ``torch.cuda.get_device_properties(i)`` reports an integrated or host-coherent device)."""

    cuda: bool
    unified_memory: bool = False


@dataclass(frozen=True)
class BlockSizes:
    """Bytes of one block's state by kind (0: none). ``param``: its parameter's index (a parameter's
    blocks are consecutive); unpreconditioned parameters' ``moments`` are a block of their own;
    ``results``: one finished refresh; ``snapshots``: its inputs."""

    name: str
    param: int
    factors: int = 0
    moments: int = 0
    bases: int = 0
    results: int = 0
    snapshots: int = 0
    #: What blocks whose bases one batched update reads together share (the parameter group,
    #: and the bases' shapes and dtypes: Note [Window by shape group]); None: a group alone.
    group: Hashable | None = None


@dataclass(frozen=True)
class Placement:
    """Where each kind lives, and the planned bytes per tier and kind: ``tiers`` (kind -> tier; the
    ``results``, and ``snapshots``, of the blocks in ``spilled`` go to ``nvme``), ``bases_access``
    (how the device reads host bases: ``"direct"``, ``"mapped"`` or ``"window"`` of
    ``window_bytes``; ``None``: on the device), ``bytes`` (tier -> kind -> planned peak bytes) and
    ``notes`` (why)."""

    tiers: dict[str, str]
    spilled: frozenset[str] = frozenset()
    bases_access: str | None = None
    window_bytes: int = 0
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def results_tier(self, name: str) -> str:
        return "nvme" if name in self.spilled else self.tiers["results"]

    def total(self, tier: str) -> int:
        return sum(self.bytes.get(tier, {}).values())


def _check_budget(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be None or an integer number of bytes >= 0, got {value!r}")


def explicit_tiers(placement: Mapping[str, str]) -> dict[str, str]:
    """Every placeable kind's tier under an explicit ``placement`` (missing kinds: auto)."""
    for kind, tier in placement.items():
        if kind not in PLACEABLE:
            raise ValueError(
                f"placement: unknown state kind {kind!r}; the kinds are {sorted(PLACEABLE)}"
            )
        if tier not in PLACEABLE[kind]:
            raise ValueError(
                f"placement: {kind!r} cannot live in {tier!r}; allowed: {PLACEABLE[kind]}"
            )
    return {kind: placement.get(kind, tiers[0]) for kind, tiers in PLACEABLE.items()}


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.3f} GiB)"


def plan(
    blocks: Sequence[BlockSizes],
    arch: Arch,
    *,
    device_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    nvme: bool = False,
    placement: str | Mapping[str, str] = "auto",
    staging_bytes: int = 0,
    bases_window: bool = False,
    window_blocks: int = 2,
    bases_device_bytes: int | None = None,
) -> Placement:
    """Place every kind of state (the module docstring's rules). ``blocks``: in access order;
    ``nvme``: a spill directory is configured; ``bases_window``: the consumer can read host bases
    through a device window (a ring of ``window_blocks`` slots: asteria/memory/window.py);
    ``bases_device_bytes``: Note [Bases by budget]. A ``ValueError`` says what to change where the
    budgets cannot be met."""
    _check_budget("device_budget_bytes", device_budget_bytes)
    _check_budget("host_budget_bytes", host_budget_bytes)
    if placement == "auto":
        tiers = {kind: homes[0] for kind, homes in PLACEABLE.items()}
    elif isinstance(placement, Mapping):
        tiers = explicit_tiers(placement)
    else:
        raise ValueError(f"placement must be 'auto' or a dict kind -> tier, got {placement!r}")
    if window_blocks < 1:
        raise ValueError(f"window_blocks must be >= 1, got {window_blocks}")
    notes: list[str] = []

    total = {k: sum(getattr(b, k) for b in blocks) for k in ("factors", "moments", "bases")}
    if placement == "auto" and arch.cuda and not arch.unified_memory and bases_device_bytes:
        whole = total["factors"] + total["moments"] + total["bases"]
        if whole <= bases_device_bytes and (
            device_budget_bytes is None or whole <= device_budget_bytes
        ):
            tiers["bases"] = "device"
            notes.append(
                f"bases on the device: the device state with them ({whole} bytes) fits the "
                f"bases budget ({bases_device_bytes} bytes, RuntimeConfig.device_bases_fraction "
                "of the device memory free at attach)"
            )
        else:
            notes.append(
                f"bases in host memory: the device state with them ({whole} bytes) is over the "
                f"bases budget ({bases_device_bytes} bytes) or device_budget_bytes"
            )
    bases_access: str | None = None
    window = 0
    if tiers["bases"] == "host":
        if not arch.cuda:
            bases_access = "direct"
        elif arch.unified_memory:
            bases_access = "mapped"
        elif bases_window:
            bases_access = "window"
            slot = window_slot(blocks, window_blocks, _window_room(total, device_budget_bytes,
                                                                   bases_device_bytes))  # fmt: skip
            window = window_blocks * slot
            notes.append(
                f"the bases window: {window_blocks} slots of {slot} bytes, a slot a shape "
                "group's bases where the device has room (Note [Window by shape group])"
            )
        else:
            tiers["bases"] = "device"
            notes.append(
                "bases stay on the device: a discrete GPU reads host bases only through a "
                "device window, and this optimizer does not read its bases through the runtime"
            )
    if tiers["bases"] == "host":
        notes.append(f"bases in host memory, read by the device: {bases_access}")

    device = {"factors": total["factors"], "moments": total["moments"]}
    device["bases"] = total["bases"] if tiers["bases"] == "device" else window
    need_device = sum(device.values())
    if device_budget_bytes is not None and need_device > device_budget_bytes:
        parts = ", ".join(f"{k} {v}" for k, v in device.items() if v)
        hint = (
            "place bases in host memory (placement={'bases': 'host'}) or raise it"
            if tiers["bases"] == "device" and (arch.unified_memory or not arch.cuda)
            else "raise it, or shard or shrink the model (max_preconditioner_dim)"
        )
        raise ValueError(
            f"device_budget_bytes={device_budget_bytes} is smaller than the {need_device} bytes "
            f"that must stay on the device ({parts}); {hint}"
        )

    host = {"bases": total["bases"] if tiers["bases"] == "host" else 0, "staging": staging_bytes}
    fixed_host = host["bases"] + host["staging"]
    room = None if host_budget_bytes is None else host_budget_bytes - fixed_host
    if room is not None and room < 0:
        raise ValueError(
            f"host_budget_bytes={host_budget_bytes} is smaller than the {fixed_host} bytes "
            f"that must stay in host memory (bases {host['bases']}, staging "
            f"{host['staging']}); raise it to at least {fixed_host}, or keep the bases on "
            "the device: placement={'bases': 'device'}"
        )
    spilled: list[str] = []
    results_host = 0
    if tiers["results"] == "nvme":
        spilled = [b.name for b in blocks if b.results]
    else:
        for b in blocks:  # hottest first: once one block does not fit, every later one spills
            if room is None or (not spilled and results_host + b.results <= room):
                results_host += b.results
            elif b.results:
                spilled.append(b.name)
        if spilled:
            notes.append(
                f"host_budget_bytes binds: the refresh results of the last {len(spilled)} "
                "blocks in access order go to NVMe"
            )
    host["results"] = results_host
    spilled_set = frozenset(spilled)
    nvme_bytes = {
        "results": sum(b.results for b in blocks if b.name in spilled_set),
        "snapshots": sum(b.snapshots for b in blocks if b.name in spilled_set),
    }
    if spilled and not nvme:
        if tiers["results"] == "nvme":
            raise ValueError(
                "placement puts refresh results on 'nvme' but nvme_path is not set; set "
                "nvme_path to a writable directory on a local drive"
            )
        need = fixed_host + sum(b.results for b in blocks)
        raise ValueError(
            f"{len(spilled)} blocks' refresh results ({_gib(nvme_bytes['results'])}) do not fit "
            f"host_budget_bytes={host_budget_bytes}; set nvme_path to a directory on a local "
            f"drive to spill them, or raise host_budget_bytes to at least {need}"
        )
    return Placement(
        tiers=tiers,
        spilled=spilled_set,
        bases_access=bases_access,
        window_bytes=window,
        bytes={
            "device": device,
            "host": host,
            "nvme": nvme_bytes,
        },
        notes=tuple(notes),
    )


def window_slot(blocks: Sequence[BlockSizes], slots: int, room: int | None) -> int:
    """Bytes of one slot of the bases window (Note [Window by shape group]): the largest shape
    group's bases, at most ``room // slots`` (``room``: the device bytes the window may take;
    None: no limit), and never less than the largest block's bases."""
    largest = max((b.bases for b in blocks), default=0)
    groups: dict[Hashable, int] = {}
    for i, b in enumerate(blocks):
        key = ("alone", i) if b.group is None else b.group
        groups[key] = groups.get(key, 0) + b.bases
    widest = max(groups.values(), default=0)
    if room is not None:
        widest = min(widest, room // slots)
    return max(largest, widest)


#: Note [A window smaller than the bases it spares]: the window exists to take the bases off the
#: device, so it never takes more than 1/WINDOW_SHARE of them (at least WINDOW_FLOOR bytes, so
#: that a model whose bases are small keeps a shape group a slot). Without the cap a slot held a
#: whole shape group and the window two slots: at OLMo-2 1B one group is nearly every basis, and
#: the window was twice the bases it was meant to spare (issue 50: SOAP's device bytes 1.33x
#: native's instead of below). A step reads every basis through the window either way; a smaller
#: slot only cuts a step's reads into more pieces.
WINDOW_SHARE = 16
WINDOW_FLOOR = 256 << 20


def _window_room(
    total: Mapping[str, int], device_budget: int | None, bases_budget: int | None
) -> int:
    """The device bytes the bases window may take: at most 1/WINDOW_SHARE of the bases (Note [A
    window smaller than the bases it spares]), within what the tighter of the budgets leaves
    beside the factors and moments."""
    room = max(total["bases"] // WINDOW_SHARE, WINDOW_FLOOR)
    budgets = [b for b in (device_budget, bases_budget) if b is not None]
    if budgets:
        room = min(room, max(0, min(budgets) - total["factors"] - total["moments"]))
    return room
