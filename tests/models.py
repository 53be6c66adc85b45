"""Tiny models, data and training loops shared by the core tests.

Every model computes its own loss (``model(*batch)`` returns a scalar), so the same
loop drives a DDP-wrapped model on each rank and the single-process reference. Data
is a deterministic function of the step: the reference trains on the global batch of
``world_size * BATCH`` samples, rank ``r`` on rows ``r*BATCH:(r+1)*BATCH``. The loss is
a mean over equal shards, so DDP's averaged gradients equal the reference's.

A :class:`Setup` names a model, an optimizer, a shard mode and a freeze schedule; it
is picklable so a table of them can be sent to spawned ranks. The checkpoint tests'
net, schedule and assertions are at the end. This is the tests' one helper module
(with ``_dist.py``, the process harness, and ``hf_trainer_cases.py``, the Trainer runs);
test modules never import each other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 4  # samples per rank and step


class MLP(nn.Module):
    """Three linears, a (1, 3) output scale (a 2-D param with a length-1 dim) and a
    trainable param the forward never uses (its grad stays None: no update, no state)."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))
        self.scale = nn.Parameter(torch.ones(1, 3))
        self.unused = nn.Parameter(torch.ones(4))
        self.to(dtype)

    def forward(self, x, y):
        return F.mse_loss(self.net(x) * self.scale, y)

    def batch(self, step: int, n: int):
        g = torch.Generator().manual_seed(1000 + step)
        dtype = self.scale.dtype
        return torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)


class TiedLM(nn.Module):
    """Embedding tied to the output head (one param object used twice)."""

    vocab, width, length = 11, 6, 5

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.embed = nn.Embedding(self.vocab, self.width)
        self.mix = nn.Linear(self.width, self.width)
        self.head = nn.Linear(self.width, self.vocab, bias=False)
        self.head.weight = self.embed.weight
        self.to(dtype)

    def forward(self, ids, targets):
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def batch(self, step: int, n: int):
        g = torch.Generator().manual_seed(2000 + step)
        ids = torch.randint(0, self.vocab, (n, self.length), generator=g)
        return ids, torch.randint(0, self.vocab, (n, self.length), generator=g)


class MixedDtype(nn.Module):
    """An fp32 branch and a bf16 branch with separate losses.

    The branches share no gradient path, so the fp32 params can be compared with
    fp32 tolerances whatever rounding the bf16 branch sees.
    """

    def __init__(self, dtype=None):
        super().__init__()
        self.fp32 = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.bf16 = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)).to(torch.bfloat16)

    def forward(self, x, y32, y16):
        return F.mse_loss(self.fp32(x), y32) + F.mse_loss(self.bf16(x.bfloat16()).float(), y16)

    def batch(self, step: int, n: int):
        g = torch.Generator().manual_seed(3000 + step)
        return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g), torch.randn(n, 4, generator=g)


class Tiny(nn.Module):
    """Three elements: on 3 ranks some ranks own nothing but padding (flat) or nothing (param)."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.lin = nn.Linear(2, 1).to(dtype)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y)

    def batch(self, step: int, n: int):
        g = torch.Generator().manual_seed(4000 + step)
        dtype = self.lin.weight.dtype
        return torch.randn(n, 2, generator=g, dtype=dtype), torch.randn(n, 1, generator=g, dtype=dtype)


MODELS = {"mlp": MLP, "tied": TiedLM, "mixed": MixedDtype, "tiny": Tiny}


def build_model(name: str, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name](dtype)


# Elementwise torch optimizers (valid in flat mode), with hyperparameters that use their state.
ELEMENTWISE = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adamw-amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    "adamw-fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "adamw-for-loop": (torch.optim.AdamW, dict(lr=1e-2, foreach=False)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2)),
}


def optimizer_spec(name: str) -> tuple[type, dict]:
    """(optimizer class, hyperparameters) for a short name."""
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor, dict(lr=1e-2, scale_parameter=False, relative_step=False, warmup_init=False)
    return ELEMENTWISE[name]


def param_groups(model: nn.Module, groups: str) -> list:
    """``"one"``: a single group; ``"named"``: one group of ``(name, param)`` pairs (its
    state dict lists ``param_names``); ``"decay"``: matrices decayed, vectors not."""
    params = list(model.named_parameters())
    if groups == "one":
        return [p for _, p in params]
    if groups == "named":
        return params
    if groups == "decay":
        return [
            {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    raise KeyError(groups)


@dataclass(frozen=True)
class Setup:
    """One training configuration. ``schedule`` maps a step to the param-name prefixes
    frozen from that step on (step 0 applies before DDP and the optimizer are built)."""

    model: str = "mlp"
    optimizer: str = "adamw"
    shard: str = "flat"
    view: bool = True
    groups: str = "one"
    schedule: tuple[tuple[int, tuple[str, ...]], ...] = ()
    lr_decay: float = 1.0  # every group's lr is multiplied by this after each step (an LR scheduler)
    # The plain-torch references step 16-bit params directly; fp32 masters are compared
    # with their own reference in tests/test_masters.py.
    master_weights: bool | str = False

    def apply_schedule(self, model: nn.Module, step: int) -> None:
        for at, frozen in self.schedule:
            if at == step:
                for name, p in model.named_parameters():
                    p.requires_grad_(not name.startswith(frozen))

    def changes_at(self, step: int) -> bool:
        return any(at == step for at, _ in self.schedule)


def shard_of(batch, rank: int) -> tuple:
    return tuple(t[rank * BATCH : (rank + 1) * BATCH] for t in batch)


def train_steps(
    setup: Setup, model, opt, steps, *, world_size, rank=None, forward=None, set_to_none=True, before_step=None
):
    """Run ``steps`` (an iterable of step numbers). ``rank=None`` is the reference: it
    trains on the global batch and, like a user of plain torch, drops frozen params'
    grads before stepping. ``before_step(step)`` runs between backward and step."""
    forward = forward or model
    for step in steps:
        setup.apply_schedule(model, step)
        batch = model.batch(step, BATCH * world_size)
        if rank is not None:
            batch = shard_of(batch, rank)
        forward(*batch).backward()
        if before_step is not None:
            before_step(step)
        if rank is None:
            for p in model.parameters():
                if not p.requires_grad:
                    p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if setup.lr_decay != 1.0:
            for group in opt.param_groups:
                group["lr"] *= setup.lr_decay


def make_zero(setup: Setup, model: nn.Module, **kwargs):
    from hf_zero import ZeroBucketOptimizer

    cls, hyper = optimizer_spec(setup.optimizer)
    return ZeroBucketOptimizer(
        param_groups(model, setup.groups), cls, shard=setup.shard,
        parameters_as_bucket_view=setup.view, **hyper, **{"master_weights": setup.master_weights, **kwargs},
    )


def make_reference(setup: Setup, model: nn.Module):
    cls, hyper = optimizer_spec(setup.optimizer)
    return cls(param_groups(model, setup.groups), **hyper)


def reference_run(setup: Setup, world_size: int, steps: int):
    """(final params, ``state_dict()``) of the plain optimizer on the global batch."""
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_reference(setup, model)
    train_steps(setup, model, opt, range(steps), world_size=world_size)
    return params_of(model), opt.state_dict()


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- comparisons -------------------------------------------------------------------
# Largest error allowed, relative to the largest magnitude of the expected tensor:
# tight for float64, fp32 rounding over a few steps, ~2.5 ulps for bf16 (whose grads
# are rounded differently by DDP's shard-mean-then-average and the global mean).
RELATIVE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def allowed_error(want: torch.Tensor) -> float:
    if not want.is_floating_point():
        return 0.0
    return RELATIVE_TOLERANCE[want.dtype] * want.detach().abs().max().item() if want.numel() else 0.0


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    )
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err <= allowed_error(want), f"{what}: max abs error {err:.3g} > {allowed_error(want):.3g}"


def assert_params_equal(got: list, want: list, what: str = "param") -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, f"{what} {i}")


def assert_state_dict_equal(got: dict, want: dict) -> None:
    """Same param groups, same state keys, values equal (``step`` exactly, on the same device)."""
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, want_state in want["state"].items():
        got_state = got["state"][i]
        assert sorted(got_state) == sorted(want_state), f"param {i}: state keys"
        for k, w in want_state.items():
            g, what = got_state[k], f"param {i} state {k!r}"
            assert type(g) is type(w), f"{what}: {type(g)} vs {type(w)}"
            if not isinstance(w, torch.Tensor):
                assert g == w, f"{what}: {g} vs {w}"
                continue
            assert g.device == w.device, f"{what}: on {g.device}, not {w.device}"
            if k == "step":
                assert g.dtype == w.dtype and torch.equal(g, w), f"{what}: {g} vs {w}"
            else:
                assert_close(g, w, what)


def assert_replicas_identical(per_rank: list[list[torch.Tensor]]) -> None:
    for r, params in enumerate(per_rank[1:], start=1):
        for i, (a, b) in enumerate(zip(params, per_rank[0])):
            assert torch.equal(a, b), f"param {i} differs between rank {r} and rank 0"


def is_view_into(p: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    return any(p.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)


# -- checkpoint tests: one float64 net, a freeze schedule, three optimizer kinds ---------
class CheckpointNet(nn.Module):
    """Params of odd sizes (flat ranges straddle them) and a (1, 3) one (Adafactor factors it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(1, 3))
        self.double()

    def forward(self, x):
        return ((self.b(torch.tanh(self.a(x))) * self.scale) ** 2).mean()


def checkpoint_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(100 + step), dtype=torch.float64)


def checkpoint_schedule(model: "CheckpointNet", step: int) -> None:
    """a.weight is frozen for steps 3-5; b.bias from step 6 on."""
    model.a.weight.requires_grad_(not 3 <= step < 6)
    model.b.bias.requires_grad_(step < 6)


def checkpoint_optimizer_class(kind: str):
    if kind == "adamw":
        return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9}
    from transformers.optimization import Adafactor

    return Adafactor, {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "warmup_init": False}




def checkpoint_train(model, opt, steps) -> None:
    for s in steps:
        checkpoint_schedule(model, s)
        model(checkpoint_batch(s)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def checkpoint_zero(model, kind, shard, view):
    from hf_zero import ZeroBucketOptimizer

    cls, kw = checkpoint_optimizer_class(kind)
    return ZeroBucketOptimizer(model.named_parameters(), cls, shard=shard, parameters_as_bucket_view=view, **kw)



def saved_linear(directory):
    """A one-step ``Linear(3, 2)`` saved with ``save_sharded(directory)``: ``(model, optimizer)``."""
    from hf_zero import ZeroBucketOptimizer

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.save_sharded(directory)
    return model, opt

def consolidated_copy(opt) -> dict | None:
    """A snapshot: state_dict() shares tensors with the live state (as torch's does)."""
    opt.consolidate_state_dict(to=0, device="cpu")
    return copy.deepcopy(opt.state_dict()) if opt.rank == 0 else None


def param_copy(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_dicts_equal(actual: dict, expected: dict) -> None:
    """Same param groups, same keys, bitwise equal tensors of the same dtype and shape."""
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for i, st in expected["state"].items():
        assert sorted(actual["state"][i]) == sorted(st), i
        for k, v in st.items():
            got = actual["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert got.dtype == v.dtype and got.shape == v.shape, (i, k)
                assert torch.equal(got, v), (i, k)
            else:
                assert got == v, (i, k)


def assert_param_dicts_equal(actual: dict, expected: dict) -> None:
    for k, v in expected.items():
        assert torch.equal(actual[k], v), k




def count_reduce_scatters(opt) -> list[int]:
    """The sizes of the buckets ``opt``'s comm reduce-scatters from now on (appended to the list returned)."""
    scattered: list[int] = []
    comm = opt.gradient_path.comm
    reduce_scatter = comm.reduce_scatter_

    def counted(buffer, bounds, **kwargs):
        scattered.append(buffer.numel())
        return reduce_scatter(buffer, bounds, **kwargs)

    comm.reduce_scatter_ = counted
    return scattered


def stage2_memory_trace(model, rank: int, *, layer_bytes: int, steps: int = 3, shards: bool = False,
                        groups: str = "one") -> list[tuple]:
    """Train ``model`` (its forward returns the loss of a (4, 32) float64 batch) ``steps`` steps under
    stage 2 with one-layer buckets; per backward: every p.grad freed, reduce-bucket bytes in use after,
    the most held during (the pool's included), the bytes the pool keeps after, (the shards' bytes,) the
    bucket count. ``groups``: the optimizer's param groups (``param_groups``)."""
    from hf_zero._stage2 import memory as stage2_memory

    opt = make_zero(Setup(groups=groups), model, stage=2)
    opt.bind_module(model, bucket_cap_mb=layer_bytes / (1 << 20))
    reducer = opt.gradient_path.stage2
    seen = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(4, 32, generator=g, dtype=torch.float64)).backward()
        held = (stage2_memory(reducer)["grad_shards"],) if shards else ()
        seen.append((holds_no_grads(model.parameters()), reducer.bucket_bytes,
                     reducer.peak_bucket_bytes, reducer.held_bucket_bytes, *held, len(opt.gradient_path.wanted_buckets)))
        opt.step()
        opt.zero_grad()
    return seen


def reference_clip(model, case, norms: list) -> None:
    """The single-process reference after its backward: frozen params' grads dropped (as hf_zero never
    steps them), then ``case.clip_norm`` (the total norm appended to ``norms``) and ``case.clip_value``."""
    for p in model.parameters():
        if not p.requires_grad:
            p.grad = None
    if case.clip_norm is not None:
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip_norm).item())
    if case.clip_value is not None:
        torch.nn.utils.clip_grad_value_(model.parameters(), case.clip_value)


def holds_grad(p) -> bool:
    """Whether ``p.grad`` holds a gradient: not None, nor stage 2's stand-in for its sharded grad (an
    expanded single element, [Note: p.grad stands in for the shards] in hf_zero/_stage2/stand_ins.py)."""
    g = p.grad
    return g is not None and not (g._is_view() and g._base.dim() == 0 and g.untyped_storage().nbytes() == g.element_size())


def holds_no_grads(params) -> bool:
    """Stage 2 after a syncing backward: no ``p.grad`` holds gradient memory."""
    return not any(holds_grad(p) for p in params)


def flat_tensors(x) -> list:
    """The tensors in ``x`` (nested lists, tuples and dicts, dicts by sorted key), numbers as 0-dim tensors."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in flat_tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in flat_tensors(y)]
    return [torch.tensor(x)]


def rank_batch(step: int, rank: int, *shape) -> torch.Tensor:
    """A float64 batch of ``shape`` drawn for ``step`` on ``rank`` (the same on every run)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def tanh_mlp(seed: int, dims=(5, 6, 1)) -> nn.Module:
    """A float64 ``Linear`` stack of widths ``dims`` with ``Tanh`` between, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()
