"""stage=2 with backwards whose graph is not one plain pass: gradient checkpointing (both
kinds), ranks whose backward reaches no param, PEFT/LoRA, params added after binding, a
backward that raises midway, bf16 params with fp32 masters.

Each equality case trains on 2 and 3 gloo ranks in float64 (different data per rank,
small buckets so a model spans several) and is compared with a single-process run of
the same torch optimizer on the global batch (the mean of every rank's loss): params to
1e-12 relative, the consolidated state dict, replicas bitwise identical, every ``p.grad``
None after each syncing backward. One spawn per world size runs the table.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests._dist import run_case, run_ranks
from tests.models import (
    BATCH, Setup, assert_params_equal, assert_replicas_identical, assert_state_dict_equal, build_model, make_zero,
    count_reduce_scatters, params_of, shard_of, stage2_memory_trace, holds_no_grads,
)

STEPS = 5
BUCKET_MB = 0.0005  # ~65 float64 elements: about one block per bucket


class Blocks(nn.Module):
    """An input layer, four tanh blocks (each optionally checkpointed), a head. ``gate``
    (inside block 1) is used unless the forward is told to skip it; ``share`` ties block 2
    to block 1 (one Linear run in two regions); ``boom`` raises in the backward between
    block 2 and block 1 when set; ``ctx`` is the checkpoint kind: None, "reentrant",
    "non-reentrant"."""

    def __init__(self, ctx=None, share=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        if share:
            self.blocks[2] = self.blocks[1]
        self.gate = nn.Parameter(torch.full((6,), 0.5))
        self.head = nn.Linear(6, 3)
        self.register_buffer("proj", torch.linspace(-1, 1, 18).reshape(6, 3))
        self.double()
        self.ctx, self.boom, self.path = ctx, False, "params"

    def _block(self, k, h, use_gate):
        h = torch.tanh(self.blocks[k](h))
        return h * self.gate if k == 1 and use_gate else h

    def forward(self, x, y, use_gate=True):
        if self.path == "buffer":  # no param at all: the output needs no grad
            return F.mse_loss(x @ self.proj, y)
        h = self.inp(x)
        for k in range(4):
            if k == 1 and self.boom:
                h = _Boom.apply(h)
            if self.ctx is None:
                h = self._block(k, h, use_gate)
            else:
                h = checkpoint(self._block, k, h, use_gate, use_reentrant=self.ctx == "reentrant")
        return F.mse_loss(self.head(h), y)

    def batch(self, step: int, n: int):
        g = torch.Generator().manual_seed(500 + step)
        return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in the backward")


@dataclasses.dataclass(frozen=True)
class Case:
    ctx: str | None = None
    share: bool = False
    accumulate: int = 1
    no_sync: bool = False
    skip_gate_on: int | None = None  # this rank's forward does not use ``gate``
    buffer_path_on: int | None = None  # this rank's forward uses no param (its output needs no grad)
    raise_at: int | None = None  # this step's backward raises midway (every rank), then zero_grad()
    step_after_raise: bool = False  # ... and a step() before zero_grad() (must raise the same clear error)
    add_group_at: int | None = None  # gate is frozen and not in the optimizer until this step, then added
    bucket_mb: float = BUCKET_MB
    shard: str = "flat"
    overlap: bool = False  # overlap_param_sync: the next forward waits for the parameter sync


CASES = {
    "reentrant": Case(ctx="reentrant"),
    "reentrant-param": Case(ctx="reentrant", shard="param"),
    "reentrant-overlap-param-sync": Case(ctx="reentrant", overlap=True, accumulate=2),
    "non-reentrant": Case(ctx="non-reentrant"),
    "reentrant-accumulate-4": Case(ctx="reentrant", accumulate=4),
    "reentrant-no-sync-2": Case(ctx="reentrant", accumulate=2, no_sync=True),
    "non-reentrant-no-sync-2": Case(ctx="non-reentrant", accumulate=2, no_sync=True),
    # gate sits inside a reentrant region and rank 1 skips it: it stays "may still come"
    # until the backward ends there, then is averaged with that rank's zeros.
    "reentrant-unused-in-region-on-one-rank": Case(ctx="reentrant", skip_gate_on=1),
    "reentrant-unused-in-region-no-sync-2": Case(ctx="reentrant", skip_gate_on=1, accumulate=2, no_sync=True),
    # One Linear in two reentrant regions, one bucket: its two grads are summed before the bucket goes.
    "reentrant-shared-one-bucket": Case(ctx="reentrant", share=True, bucket_mb=1.0),
    "non-reentrant-shared": Case(ctx="non-reentrant", share=True),
    # No hangs: rank 1's forward reaches no param.
    "no-param-on-one-rank": Case(buffer_path_on=1),
    "no-param-on-one-rank-reentrant": Case(ctx="reentrant", buffer_path_on=1, accumulate=2),
    # Recovery and late params.
    "raise-midway": Case(raise_at=2),
    "raise-midway-reentrant-step-first": Case(ctx="reentrant", raise_at=2, step_after_raise=True),
    "add-param-group-after-bind": Case(add_group_at=2),
    "add-param-group-after-bind-reentrant": Case(ctx="reentrant", add_group_at=3, shard="param"),
}


def _build(case: Case) -> Blocks:
    model = Blocks(case.ctx, case.share)
    if case.add_group_at is not None:
        model.gate.requires_grad_(False)
    return model


def _params_for_optimizer(case: Case, model: Blocks):
    return [p for n, p in model.named_parameters() if not (case.add_group_at is not None and n == "gate")]


def _loss(model: Blocks, batch, case: Case, rank: int):
    model.path = "buffer" if case.buffer_path_on == rank else "params"
    return model(*batch, use_gate=case.skip_gate_on != rank)


def _loop(case: Case, model, opt, *, world_size, rank=None):
    """Train STEPS steps; ``rank=None``: the reference (one backward of the mean of every rank's
    loss). Returns (errors seen, whether every p.grad was None after every syncing backward)."""
    errors, freed = [], True
    for step in range(STEPS):
        if step == case.add_group_at:
            model.gate.requires_grad_(True)
            opt.add_param_group({"params": [model.gate]})
        model.boom = step == case.raise_at
        batch = model.batch(step, BATCH * world_size)
        try:
            if rank is None:
                sum(_loss(model, shard_of(batch, r), case, r) for r in range(world_size)).div(world_size).backward()
            else:
                part, micro = shard_of(batch, rank), BATCH // case.accumulate
                for m in range(case.accumulate):
                    mb = tuple(t[m * micro : (m + 1) * micro] for t in part)
                    if case.no_sync and m + 1 < case.accumulate:
                        with model.no_sync():
                            (_loss(model, mb, case, rank) / case.accumulate).backward()
                    else:
                        (_loss(model, mb, case, rank) / case.accumulate).backward()
                        freed = freed and holds_no_grads(model.parameters())
        except RuntimeError as e:
            assert step == case.raise_at and "boom" in str(e), e
            errors.append(str(e))
            if case.step_after_raise and rank is not None:
                with pytest.raises(RuntimeError, match="raised before it finished") as info:
                    opt.step()
                errors.append(str(info.value))
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return errors, freed


def _train(rank, world_size, case: Case):
    from hf_zero import ZeroBucketOptimizer

    model = _build(case)
    opt = ZeroBucketOptimizer(_params_for_optimizer(case, model), torch.optim.AdamW, stage=2, shard=case.shard,
                              overlap_param_sync=case.overlap, lr=1e-2, weight_decay=0.1)
    opt.bind_module(model, bucket_cap_mb=case.bucket_mb)
    reducer = opt.gradient_path.stage2
    scattered = count_reduce_scatters(opt)
    errors, freed = _loop(case, model, opt, world_size=world_size, rank=rank)
    opt.wait_param_sync()
    opt.consolidate_state_dict(to=0)
    return {
        "params": params_of(model),
        "state_dict": opt.state_dict() if rank == 0 else None,
        "errors": errors,
        "freed": freed,
        "leftover": reducer.bucket_bytes,
        "scattered": len(scattered),
        "buckets": len(opt.gradient_path.wanted_buckets),
    }


def _reference(case: Case, world_size: int):
    model = _build(case)
    opt = torch.optim.AdamW(_params_for_optimizer(case, model), lr=1e-2, weight_decay=0.1)
    errors, _ = _loop(case, model, opt, world_size=world_size)
    return params_of(model), opt.state_dict(), errors


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", CASES)
def test_stage2_graph_matches_reference(name, world_size):
    case = CASES[name]
    per_rank = run_case(_train, CASES, name, world_size, timeout=220)
    ref_params, ref_state, ref_errors = _reference(case, world_size)
    assert_replicas_identical([r["params"] for r in per_rank])
    assert_params_equal(per_rank[0]["params"], ref_params)
    assert_state_dict_equal(per_rank[0]["state_dict"], ref_state)
    for r in per_rank:
        assert r["freed"] and r["leftover"] == 0
        if case.raise_at is None:
            assert r["scattered"] >= STEPS * (1 if case.no_sync else case.accumulate) * min(2, r["buckets"])
        assert len(r["errors"]) == len(ref_errors) + case.step_after_raise
        if case.step_after_raise:
            assert "call optimizer.zero_grad()" in r["errors"][1]


# -- the rest: one 2-rank spawn ------------------------------------------------------------------
class DeepCheckpointed(nn.Module):
    """An input layer and eight equal layers, each in a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 32).double()
        self.layers = nn.ModuleList(nn.Linear(32, 32).double() for _ in range(8))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = checkpoint(lambda h, layer=layer: torch.tanh(layer(h)), x, use_reentrant=True)
        return x.square().mean()


LAYER_BYTES = (32 * 32 + 32) * 8


def _memory_reentrant(rank, world_size):
    """Per backward: p.grads freed, buckets alive after, the most alive during, bucket count."""
    return stage2_memory_trace(DeepCheckpointed(), rank, layer_bytes=LAYER_BYTES)


def _shared_small_buckets(rank, world_size):
    """One Linear in two reentrant regions, one block per bucket: its second grad comes after its
    bucket went. Every rank must raise the same error (no hang), and the next backward start clean."""
    model = Blocks("reentrant", share=True)
    opt = make_zero(Setup(), model, stage=2)
    opt.bind_module(model, bucket_cap_mb=36 * 8 / (1 << 20))  # a block's weight, its bias: two buckets
    batch = shard_of(model.batch(0, BATCH * world_size), rank)
    try:
        model(*batch).backward()
        message = None
    except RuntimeError as e:
        message = str(e)
    opt.zero_grad()
    model.ctx = "non-reentrant"
    model(*batch).backward()
    opt.step()
    return message, params_of(model)


_LOT: list = []


def _lot(rank, world_size):
    return {"memory": _memory_reentrant(rank, world_size), "shared": _shared_small_buckets(rank, world_size),
            "hf": {k: _hf_train(rank, world_size, *v) for k, v in HF_CASES.items()},
            "bf16": _bf16_masters(rank, world_size)}


def _lot_results() -> list:
    if not _LOT:
        _LOT.append(run_ranks(_lot, 2, timeout=200))
    return _LOT[0]


@pytest.mark.timeout(220)
def test_reentrant_checkpoint_buckets_go_as_their_region_ends():
    """Every layer in a reentrant checkpoint (its params unreachable from the outer graph when
    the backward starts): the buckets still go as the regions finish, at most three of the
    eight one-layer buckets alive at once (not all of them until the end)."""
    for r in _lot_results():
        for freed, alive, peak, pooled, buckets in r["memory"]:
            assert freed and alive == 0
            assert buckets == 9
            assert 0 < peak <= 3 * LAYER_BYTES, peak
            assert pooled <= peak, (pooled, peak)


@pytest.mark.timeout(220)
def test_a_param_in_two_reentrant_regions_after_its_bucket_went_is_one_clear_error_on_every_rank():
    per_rank = _lot_results()
    for r in per_rank:
        message, _ = r["shared"]
        assert message is not None and "arrived after its bucket was reduced" in message, message
        assert "blocks.1.weight" in message or "#" in message
        assert "use_reentrant=False" in message
    assert_replicas_identical([r["shared"][1] for r in per_rank])


# -- Hugging Face models: gradient checkpointing, PEFT/LoRA -----------------------------------------
def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=37, n_positions=8, n_embd=8, n_layer=3, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config).double().train()


def _hf_model(kind: str):
    model = _tiny_gpt2()
    if kind.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                                                 fan_in_fan_out=True, init_lora_weights="gaussian"))
    if "reentrant" in kind:
        from tests.hf_trainer_cases import enable_activation_checkpointing

        enable_activation_checkpointing(model, use_reentrant=kind.endswith("-reentrant"))
    return model


def _hf_batch(step: int, n: int):
    g = torch.Generator().manual_seed(700 + step)
    return (torch.randint(0, 37, (n, 8), generator=g),)


def _hf_loop(model, opt, steps, world_size, rank=None):
    for step in range(steps):
        ids = _hf_batch(step, BATCH * world_size)[0]
        if rank is None:
            sum(model(input_ids=shard_of((ids,), r)[0], labels=shard_of((ids,), r)[0]).loss
                for r in range(world_size)).div(world_size).backward()
        else:
            part = shard_of((ids,), rank)[0]
            model(input_ids=part, labels=part).loss.backward()
            assert holds_no_grads(model.parameters())
        opt.step()
        opt.zero_grad()


HAS_PEFT = importlib.util.find_spec("peft") is not None  # the test extra has it; .ci/floor does not
HF_CASES = {  # name: (model kind, steps)
    "gpt2-reentrant": ("gc-reentrant", 3),
    "gpt2-non-reentrant": ("gc-non-reentrant", 3),
    **({"lora": ("lora", 3), "lora-gc-reentrant": ("lora-gc-reentrant", 3)} if HAS_PEFT else {}),
}


def _hf_train(rank, world_size, kind, steps):
    from hf_zero import ZeroBucketOptimizer

    model = _hf_model(kind)
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    opt.bind_module(model, bucket_cap_mb=0.0005)
    names = [n for n, _ in model.named_parameters()]
    bucketed = sorted({names[i] for b in opt.gradient_path.wanted_buckets for i in b})
    _hf_loop(model, opt, steps, world_size, rank)
    return params_of(model), bucketed, len(opt.gradient_path.wanted_buckets)


@functools.cache
def _hf_reference(kind, steps, world_size):
    model = _hf_model(kind)
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2)
    _hf_loop(model, opt, steps, world_size)
    return params_of(model), sorted(n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.timeout(220)
@pytest.mark.parametrize("name", [*HF_CASES, *([] if HAS_PEFT else [pytest.param("lora", marks=pytest.mark.skip(
    reason="peft is not installed (pip install hf_zero[test])"))])])
def test_hf_model_matches_reference(name):
    """A tiny GPT-2 with gradient_checkpointing_enable (both kinds), and LoRA through PEFT on its
    attention (with and without reentrant checkpointing): stage 2 on 2 ranks equals AdamW on the
    global batch; under LoRA only the adapters are in the buckets."""
    per_rank = [r["hf"][name] for r in _lot_results()]
    ref_params, trainable = _hf_reference(*HF_CASES[name], 2)
    assert_replicas_identical([r[0] for r in per_rank])
    assert_params_equal(per_rank[0][0], ref_params)
    assert per_rank[0][1] == trainable and per_rank[0][2] > 1
    if name.startswith("lora"):
        assert trainable and all("lora_" in n for n in trainable)


# -- bf16 with fp32 masters ---------------------------------------------------------------------------
BF16_STEPS = 6


def _bf16_masters(rank, world_size):
    """bf16 MLP, stage 2 with fp32 masters. Per step: each rank's local bf16 grads (from a plain
    copy of the params) and the params after the step."""
    model = build_model("mlp", torch.bfloat16)
    plain = build_model("mlp", torch.bfloat16)
    from hf_zero import ZeroBucketOptimizer

    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, stage=2, master_weights=True, lr=1e-3,
                              weight_decay=0.1, grad_accum_dtype="fp32")
    opt.bind_module(model, bucket_cap_mb=0.0001)
    local, after = [], []
    for step in range(BF16_STEPS):
        batch = shard_of(model.batch(step, BATCH * world_size), rank)
        with torch.no_grad():
            for p, q in zip(plain.parameters(), model.parameters()):
                p.copy_(q)
        plain.zero_grad()
        plain(*batch).backward()
        local.append([None if p.grad is None else p.grad.clone() for p in plain.parameters()])
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
        after.append(params_of(model))
    return local, after


def _bf16_reference(per_rank):
    """fp32 masters stepped by AdamW on the 2-rank average of the bf16 grads, summed in fp32 as
    ``grad_accum_dtype="fp32"`` shards sum them ((a + b) / 2 in fp32: the same bits as the reduce-scatter's
    a/2 + b/2 summed into a float32 shard), rounded into bf16 params (tests/test_masters.py)."""
    model = build_model("mlp", torch.bfloat16)
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1)
    out = []
    for step in range(BF16_STEPS):
        grads = [r["bf16"][0][step] for r in per_rank]
        for i, m in enumerate(masters):
            gs = [g[i] for g in grads]
            m.grad = None if gs[0] is None else (gs[0].float() + gs[1].float()) / 2
        opt.step()
        out.append([m.to(torch.bfloat16) for m in masters])
    return out


@pytest.mark.timeout(220)
def test_bf16_with_masters_equals_the_fp32_master_reference_bitwise():
    per_rank = _lot_results()
    want = _bf16_reference(per_rank)
    for step in range(BF16_STEPS):
        for r in per_rank:
            for i, (a, b) in enumerate(zip(r["bf16"][1][step], want[step])):
                assert torch.equal(a, b), f"step {step} param {i}: max diff {(a.float() - b.float()).abs().max()}"
    assert not torch.equal(want[-1][0], build_model("mlp", torch.bfloat16).net[0].weight), "nothing was trained"


# -- cost ---------------------------------------------------------------------------------------
@pytest.mark.fast
def test_a_graph_without_checkpoints_is_not_walked_again_while_the_same_params_are_unreached():
    """The walk for reentrant checkpoints runs only when a param is unreached, and once per set of
    unreached params (MLP.unused is never reached)."""
    import hf_zero._stage2.reducer as stage2

    walks = []
    real = stage2.reentrant_region_below

    def counting(root):
        walks.append(root)
        return real(root)

    stage2.reentrant_region_below = counting
    try:
        model = build_model("mlp")
        opt = make_zero(Setup(), model, stage=2)
        opt.bind_module(model)
        for step in range(3):
            model(*model.batch(step, BATCH)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        stage2.reentrant_region_below = real
    assert len(walks) == 1


@pytest.mark.fast
def test_reentrant_checkpoint_node_is_recognised():
    """hf_zero/_engine.py finds reentrant checkpoint regions by their node's name: fails loudly if
    torch renames it."""
    from hf_zero._engine import REENTRANT_NODES

    x = torch.ones(2, requires_grad=True)
    y = checkpoint(torch.sin, x, use_reentrant=True)
    assert y.grad_fn.name() in REENTRANT_NODES
