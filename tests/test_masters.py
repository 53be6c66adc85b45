"""fp32 master weights for 16-bit params (``master_weights``) equal a hand-written
single-process fp32-master reference, bitwise.

The reference keeps an fp32 copy of every param, steps it with the plain torch
optimizer on the averaged grads cast to fp32, and rounds it into the bf16 params
(``Tensor.copy_``: round to nearest even). It replays the grads the sharded run
averaged (each rank records, before every step, the averaged grad of the elements it
owns), so the comparison is about the optimizer alone and can be bitwise.

One chain per configuration: steps 0-5 on 2 ranks (a param group frozen for steps
2-3 where the configuration says so), saved (sharded or consolidated), resumed on 3
ranks for steps 6-9 (another freeze), saved, resumed on 1 rank for steps 10-12. After
each phase the masters (``"master_param"`` in the consolidated state dict), the other
optimizer state and the bf16 params must equal the reference's bitwise.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import BATCH, build_model, optimizer_spec, shard_of

BF16 = torch.bfloat16
MASTER = "master_param"
PHASES = ((2, range(0, 6)), (3, range(6, 10)), (1, range(10, 13)))  # (world size, steps)
FREEZES = {2: ("net.0.",), 4: (), 7: ("net.2.", "scale"), 9: ()}  # step -> prefixes frozen from then on
HYPER = {  # small steps: most updates are below half a bf16 ulp, which only masters keep
    "adamw": dict(lr=1e-3, weight_decay=0.1),
    "sgd": dict(lr=1e-2, momentum=0.9),
    "adafactor": dict(lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False),
}


@dataclass(frozen=True)
class Config:
    optimizer: str = "adamw"
    shard: str = "flat"
    view: bool = True
    grad_reduce: str = "all_reduce"
    freeze: bool = True
    resume: str = "sharded"  # or "consolidated"
    clip: str = ""  # "norm" or "value": clipped with the optimizer's own methods
    masters: object = "auto"


CONFIGS = {
    "adamw-flat-sharded": Config(),
    "adamw-param-consolidated": Config(shard="param", resume="consolidated"),
    "adamw-flat-no-view-consolidated": Config(view=False, resume="consolidated"),
    "adamw-flat-reduce-scatter-clip-norm": Config(grad_reduce="reduce_scatter", freeze=False, clip="norm",
                                                  resume="consolidated"),
    "adamw-param-reduce-scatter-clip-value": Config(shard="param", grad_reduce="reduce_scatter", freeze=False,
                                                    clip="value"),
    "sgd-flat-sharded": Config(optimizer="sgd"),
    "adafactor-param-consolidated": Config(optimizer="adafactor", shard="param", resume="consolidated"),
    "explicit-true-param-sharded": Config(shard="param", masters=True),
    "pure-bf16-flat-sharded": Config(masters=False),
}
CLIP_NORM, CLIP_VALUE = 0.05, 0.02


def _frozen_at(config: Config, step: int) -> tuple[str, ...]:
    if not config.freeze:
        return ()
    at = [s for s in FREEZES if s <= step]
    return FREEZES[max(at)] if at else ()


def _apply_freeze(config: Config, model, step: int) -> None:
    frozen = _frozen_at(config, step)
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen and name.startswith(frozen)))


def _make(config: Config, model):
    from hf_zero import ZeroBucketOptimizer

    cls, _ = optimizer_spec(config.optimizer)
    return ZeroBucketOptimizer(
        model.named_parameters(), cls, shard=config.shard, parameters_as_bucket_view=config.view,
        grad_reduce=config.grad_reduce, master_weights=config.masters, **HYPER[config.optimizer],
    )


def _owned_grads(opt, rank: int) -> dict:
    """The averaged grads this rank can vouch for: its own ranges once a layout exists
    (after a reduce-scatter only those hold the average), else whole grads (rank 0's are used)."""
    opt.average_unreduced_grads()
    layout = opt.gradient_path.layout
    pieces, laid = {}, set()
    if layout is not None:
        for r, pcs in enumerate(layout.all_pieces()):
            for pc in pcs:
                laid.add(pc.index)
                if r == rank:
                    pieces.setdefault(pc.index, []).append((pc.start, pc.stop))
    out = {}
    for i, p in enumerate(opt.params):
        if not p.requires_grad or p.grad is None:
            continue
        g = p.grad.detach().reshape(-1)
        if i in laid:
            for start, stop in pieces.get(i, ()):
                out[(i, start, stop)] = g[start:stop].clone()
        elif rank == 0:
            out[(i, 0, g.numel())] = g.clone()
    return out


def _phase(rank, world_size, base: str, phase: int):
    """Run every configuration's phase ``phase`` on this rank; return per configuration
    the recorded grads, the params and (rank 0) the consolidated state dict."""
    steps = PHASES[phase][1]
    out = {}
    for name, config in CONFIGS.items():
        where = os.path.join(base, name)
        model = build_model("mlp", BF16)
        if phase:
            model.load_state_dict(torch.load(os.path.join(where, f"model-{phase - 1}.pt")))
        _apply_freeze(config, model, steps[0])
        opt = _make(config, model)
        if phase and config.resume == "sharded":
            opt.load_sharded(os.path.join(where, f"sharded-{phase - 1}"))
        elif phase:
            opt.load_state_dict(torch.load(os.path.join(where, f"optimizer-{phase - 1}.pt")))
        ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.0002)
        if config.grad_reduce == "reduce_scatter":
            opt.bind_ddp(ddp)
        grads, norms = [], []
        for step in steps:
            _apply_freeze(config, model, step)
            ddp(*shard_of(model.batch(step, BATCH * world_size), rank)).backward()
            grads.append(_owned_grads(opt, rank))
            if config.clip == "norm":
                norms.append(opt.clip_grad_norm_(CLIP_NORM).item())
            elif config.clip == "value":
                opt.clip_grad_value_(CLIP_VALUE)
            opt.step()
            opt.zero_grad(set_to_none=True)
        stats = opt.stats()
        opt.consolidate_state_dict(to=0, device="cpu")
        state = opt.state_dict() if rank == 0 else None
        if rank == 0:
            os.makedirs(where, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(where, f"model-{phase}.pt"))
            torch.save(state, os.path.join(where, f"optimizer-{phase}.pt"))
        opt.save_sharded(os.path.join(where, f"sharded-{phase}"))
        dist.barrier()
        out[name] = {
            "grads": grads,
            "norms": norms,
            "params": [p.detach().clone() for p in model.parameters()],
            "state": state,
            "stats": stats,
            "trainable": [p.requires_grad for p in model.parameters()],
            "grad_reduce": opt.grad_reduce,
        }
    return out


@functools.cache
def _chain():
    """Every phase, in order (each resumes from the files the previous one wrote)."""
    base = tempfile.mkdtemp(prefix="hf_zero_masters_")
    return [run_ranks(_phase, ws, base, k, timeout=240) for k, (ws, _) in enumerate(PHASES)]


def _full_grads(per_rank: list[dict], shapes: list[torch.Size]) -> dict[int, torch.Tensor]:
    """Assemble one step's averaged grads from every rank's record."""
    flat: dict[int, torch.Tensor] = {}
    filled: dict[int, int] = {}
    for record in per_rank:
        for (i, start, stop), g in record.items():
            if i not in flat:
                flat[i] = torch.full((shapes[i].numel(),), float("nan"), dtype=g.dtype)
                filled[i] = 0
            flat[i][start:stop] = g
            filled[i] += stop - start
    for i, n in filled.items():
        assert n == shapes[i].numel(), f"param {i}: recorded {n} of {shapes[i].numel()} grad elements"
    return {i: g.view(shapes[i]) for i, g in flat.items()}


def _clip(config: Config, grads: dict[int, torch.Tensor]) -> float | None:
    """The clipping torch would do on the bf16 grads, with the norm summed in float64."""
    if config.clip == "value":
        for g in grads.values():
            g.clamp_(-CLIP_VALUE, CLIP_VALUE)
    elif config.clip == "norm":
        total = sum(g.double().pow(2).sum() for g in grads.values()).sqrt()
        total16 = total.to(BF16)
        coef = torch.clamp(CLIP_NORM / (total16 + 1e-6), max=1.0)
        for g in grads.values():
            g.mul_(coef)
        return total.item()
    return None


def _reference(name: str, chain: list, *, masters: bool) -> list[dict]:
    """Per phase: the reference's bf16 params, fp32 masters and optimizer state after it."""
    config = CONFIGS[name]
    model = build_model("mlp", BF16)
    params = [p.detach().clone() for p in model.parameters()]
    cls, _ = optimizer_spec(config.optimizer)
    stepped = [p.detach().float().clone() for p in params] if masters else [p.clone() for p in params]
    opt = cls(stepped, **HYPER[config.optimizer])
    shapes = [p.shape for p in params]
    out = []
    for per_rank in chain:
        norms = []
        for k in range(len(per_rank[0][name]["grads"])):
            grads = _full_grads([r[name]["grads"][k] for r in per_rank], shapes)
            norms.append(_clip(config, grads))
            for i, t in enumerate(stepped):
                t.grad = grads[i].to(t.dtype) if i in grads else None
            opt.step()
            for i in grads:
                params[i] = stepped[i].to(BF16) if masters else stepped[i].detach().clone()
        state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for i, s in ((i, opt.state[t]) for i, t in enumerate(stepped)) if s}
        out.append({"params": [p.clone() for p in params], "masters": [t.detach().clone() for t in stepped],
                    "state": state, "norms": norms})
    return out


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
    assert torch.equal(got, want), f"{what}: max abs difference {(got.double() - want.double()).abs().max().item():.3g}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c.masters is not False])
def test_masters_equal_fp32_master_reference_bitwise(name):
    config = CONFIGS[name]
    chain = _chain()
    ref = _reference(name, chain, masters=True)
    for phase, (per_rank, want) in enumerate(zip(chain, ref)):
        ws = PHASES[phase][0]
        got = [r[name] for r in per_rank]
        assert got[0]["grad_reduce"] == config.grad_reduce or ws == 1
        if config.freeze:  # the freeze really left params without grads
            names = [n for n, _ in build_model("mlp", BF16).named_parameters()]
            for k, step in enumerate(PHASES[phase][1]):
                frozen = _frozen_at(config, step)
                recorded = {i for r in per_rank for (i, _, _) in r[name]["grads"][k]}
                assert recorded and not any(names[i].startswith(frozen) for i in recorded if frozen), (phase, step)
        for r in got[1:]:
            for i, (a, b) in enumerate(zip(r["params"], got[0]["params"])):
                assert torch.equal(a, b), f"phase {phase} (N={ws}): param {i} differs between ranks"
        for i, (p, w) in enumerate(zip(got[0]["params"], want["params"])):
            _equal(p, w, f"phase {phase} (N={ws}): bf16 param {i}")
        state = got[0]["state"]["state"]
        for i, master in enumerate(want["masters"]):
            p = got[0]["params"][i]
            if i in state and MASTER in state[i]:
                _equal(state[i][MASTER], master, f"phase {phase} (N={ws}): master of param {i}")
            else:  # never stepped: its master is its value
                _equal(p.float(), master, f"phase {phase} (N={ws}): param {i} without a saved master")
        assert sorted(i for i, s in state.items() if set(s) - {MASTER}) == sorted(want["state"]), (
            f"phase {phase}: params with optimizer state")
        for i, st in want["state"].items():
            assert sorted(set(state[i]) - {MASTER}) == sorted(st), f"phase {phase}: state keys of param {i}"
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    _equal(state[i][k], v, f"phase {phase} (N={ws}): state {k!r} of param {i}")
                else:
                    assert state[i][k] == v, (phase, i, k)
        if config.clip == "norm":
            for n, w in zip(got[0]["norms"], want["norms"]):
                assert abs(n - w) <= 1e-2 * w, (n, w)
            assert max(want["norms"]) > CLIP_NORM, "the clipping never clipped"


@pytest.mark.timeout(900)
def test_masters_make_a_difference():
    """The comparison can fail: on the same grads, pure-bf16 steps end elsewhere."""
    name = "adamw-flat-sharded"
    chain = _chain()
    with_masters = _reference(name, chain, masters=True)[-1]["params"]
    pure = _reference(name, chain, masters=False)[-1]["params"]
    changed = sum(int((a != b).sum()) for a, b in zip(with_masters, pure))
    total = sum(a.numel() for a in pure)
    assert changed > total // 10, f"only {changed} of {total} elements differ"


@pytest.mark.timeout(900)
def test_master_weights_false_is_pure_bf16():
    """``master_weights=False``: the inner optimizer steps the bf16 params (today's behaviour),
    bitwise equal to the plain optimizer on the bf16 params; no masters are saved or held."""
    name = "pure-bf16-flat-sharded"
    chain = _chain()
    ref = _reference(name, chain, masters=False)
    for phase, (per_rank, want) in enumerate(zip(chain, ref)):
        got = per_rank[0][name]
        for i, (p, w) in enumerate(zip(got["params"], want["params"])):
            _equal(p, w, f"phase {phase}: bf16 param {i}")
        state = got["state"]["state"]
        assert sorted(state) == sorted(want["state"])
        for i, st in want["state"].items():
            assert MASTER not in state[i]
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    _equal(state[i][k], v, f"phase {phase}: state {k!r} of param {i}")
        assert got["stats"]["master_bytes_per_rank"] == [0] * PHASES[phase][0]


@pytest.mark.timeout(900)
def test_checkpoint_key_and_stats():
    """The consolidated state dict carries each stepped bf16 param's full fp32 master under
    "master_param"; stats() counts the masters apart from the optimizer state."""
    name = "adamw-flat-sharded"
    chain = _chain()
    model = build_model("mlp", BF16)
    for phase, per_rank in enumerate(chain):
        got = per_rank[0][name]
        state = got["state"]["state"]
        params = dict(model.named_parameters())
        names = list(params)
        assert state, "no state saved"
        for i, st in state.items():
            assert MASTER in st, f"param {names[i]} has state but no master"
            assert st[MASTER].dtype == torch.float32 and st[MASTER].shape == params[names[i]].shape
        assert "unused" not in [names[i] for i in state], "a never-stepped param got a master entry"
        stats = got["stats"]
        trainable = sum(p.numel() for p, t in zip(model.parameters(), got["trainable"]) if t)
        assert sum(stats["master_bytes_per_rank"]) == 4 * trainable
        adam = sum(st["exp_avg"].numel() * 8 for st in state.values())
        assert sum(stats["state_bytes_per_rank"]) >= adam
        assert sum(stats["state_bytes_per_rank"]) < adam + 4 * trainable  # masters not counted twice


# -- single process: defaults, fp32 params, bad values, fp16, freeze -----------------------
@pytest.mark.timeout(60)
def test_frozen_master_survives_unless_the_param_changed():
    """Across a freeze, an untouched param's master comes back exactly (sub-ulp part
    included); a param changed while frozen restarts its master from its 16-bit value."""
    from hf_zero import ZeroBucketOptimizer

    model = build_model("mlp", BF16)
    opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3)
    _plain_loop(model, opt, 3)
    names = [n for n, _ in model.named_parameters()]
    kept, changed = names.index("net.0.weight"), names.index("net.2.weight")
    before = {i: v[MASTER].clone() for i, v in opt.state_dict()["state"].items()}
    assert not torch.equal(before[kept], model.net[0].weight.detach().float()), "masters hold nothing below bf16"
    for layer in (model.net[0], model.net[2]):
        layer.weight.requires_grad_(False)
    _plain_loop(model, opt, 1)
    with torch.no_grad():
        model.net[2].weight[0, 0] += 1.0
    for layer in (model.net[0], model.net[2]):
        layer.weight.requires_grad_(True)
    opt.refresh_trainable()
    after = opt.state_dict()["state"]
    _equal(after[kept][MASTER], before[kept], "master of the untouched frozen param")
    want = before[changed].clone()
    want[0, 0] = model.net[2].weight[0, 0].float()
    _equal(after[changed][MASTER], want, "master of the param changed while frozen")



def _plain_loop(model, opt, steps, scaler=None):
    for step in range(steps):
        loss = model(*model.batch(step, BATCH))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["yes", "true", 1, None, 0.5])
def test_bad_master_weights_value_is_named(value):
    from hf_zero import ZeroBucketOptimizer

    model = build_model("mlp", BF16)
    with pytest.raises(ValueError, match="master_weights"):
        ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, master_weights=value, lr=1e-3)


@pytest.mark.timeout(60)
def test_float32_params_unchanged_and_bf16_get_masters():
    """One process, fp32 and bf16 branches (separate losses): the fp32 params and their
    state equal plain AdamW bitwise, with no master; the bf16 params carry masters."""
    from hf_zero import ZeroBucketOptimizer

    assert not dist.is_initialized()
    model = build_model("mixed")
    ref_model = build_model("mixed")
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    fp32 = [p for p in ref_model.parameters() if p.dtype == torch.float32]
    ref = torch.optim.AdamW(fp32, lr=1e-3, weight_decay=0.1)
    for step in range(4):
        model(*model.batch(step, BATCH)).backward()
        ref_model(*ref_model.batch(step, BATCH)).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref_model.zero_grad()
    state = opt.state_dict()["state"]
    want = ref.state_dict()["state"]
    k = 0
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        if p.dtype == torch.float32:
            _equal(p.detach(), q.detach(), f"fp32 param {i}")
            assert MASTER not in state[i]
            for key, v in want[k].items():
                _equal(state[i][key], v, f"fp32 param {i} state {key}")
            k += 1
        else:
            assert state[i][MASTER].dtype == torch.float32
            assert state[i]["exp_avg"].dtype == torch.float32
            _equal(state[i][MASTER].to(BF16), p.detach(), f"bf16 param {i}: rounded master")


@pytest.mark.fast  # the fast subset's masters test
@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [None, 1], ids=["one-chunk", "piece-by-piece"])
@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_16bit_params_with_masters_match_reference(dtype, chunk, monkeypatch):
    """fp16 params (no GradScaler) step through fp32 masters like bf16 ones; stepping the
    pieces a chunk at a time (at most one chunk of fp32 grads alive) changes nothing."""
    import hf_zero._partition
    from hf_zero import ZeroBucketOptimizer

    if chunk is not None:
        monkeypatch.setattr(hf_zero._partition, "_CPU_GRAD_CHUNK_ELEMENTS", chunk)
    model = build_model("mlp", dtype)
    params16 = [p.detach().clone() for p in model.parameters()]
    masters = [p.float() for p in params16]
    ref = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1)
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    for step in range(3):
        model(*model.batch(step, BATCH)).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = None if p.grad is None else p.grad.float()
        ref.step()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()["state"]
    for i, (p, m) in enumerate(zip(model.parameters(), masters)):
        _equal(p.detach(), m.to(dtype), f"{dtype} param {i}")
        if i in state:
            _equal(state[i][MASTER], m, f"master of {dtype} param {i}")
            for key, v in ref.state[m].items():
                _equal(state[i][key], v, f"{dtype} param {i} state {key}")


@pytest.mark.timeout(60)
def test_fp16_params_with_grad_scaler_raise_before_anything_changes():
    """A GradScaler cannot unscale fp16 grads (torch refuses them): the step raises a
    ValueError before any param or state changes. Train fp16 with fp32 params under
    autocast, or bf16 params, instead."""
    from hf_zero import ZeroBucketOptimizer

    model = build_model("mlp", torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="FP16 gradients"):
        _plain_loop(model, opt, 1, scaler=scaler)
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a.detach(), b)
    assert opt.state_dict()["state"] == {}


def _joined(rank, world_size):
    from torch.distributed.algorithms.join import Join

    from hf_zero import ZeroBucketOptimizer

    model = build_model("mlp", BF16)
    del model.unused  # DDP's join hook assumes every param gets a grad
    ddp = DDP(model)
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, shard="flat", lr=1e-3)
    with Join([ddp, opt]):
        for step in range(2 + rank):
            ddp(*shard_of(model.batch(step, BATCH * world_size), rank)).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict()["state"] if rank == 0 else None
    return [p.detach().clone() for p in model.parameters()], state


@pytest.mark.timeout(200)
def test_join_with_masters_keeps_replicas_and_masters_consistent():
    per_rank = run_ranks(_joined, 2, timeout=120)
    params, state = per_rank[0]
    for a, b in zip(per_rank[1][0], params):
        assert torch.equal(a, b), "replicas differ"
    assert len(state) == len(params)
    for i, p in enumerate(params):
        _equal(state[i][MASTER].to(BF16), p, f"param {i}: rounded master")
        assert int(state[i]["step"]) == 3
