"""The overlapped parameter sync ([Note: overlapped parameter sync] in hf_zero/_overlap.py)
with each receive visible only at its wait (tests/_seams.py), 2 gloo ranks, float64, small
DDP buckets, transformer blocks as the overlap's units. Three models read params outside
their own module's forward: ``nn.MultiheadAttention`` reads ``out_proj.weight`` without
calling ``out_proj`` (inside its block); a tied head reads the embedding through
``F.linear`` (outside every block); a module added after binding registers a block's param
at the root and runs it before the blocks. Each trains bitwise like the same run without
overlap, in a plain DDP loop and under Trainer; at each block's forward the later blocks'
syncs are still in flight, and nothing a forward reads is. A control shows a reader that
does not wait sees the stale values the seam leaves. The launch order and the waits after a
changed module tree are checked in one process with stand-in syncs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests._seams import delay_param_receives

V, D, T, STEPS, BATCH, BLOCKS = 256, 64, 6, 6, 4, 3
BUCKET_MB = 0.05  # several buffers per block, some holding params of two blocks
KINDS = ("mha", "tied", "added")
ADD_AT = 4  # "added": the forward that adds a reader, once the buffers follow DDP's buckets
F64 = torch.float64


class TiedHead(nn.Module):
    """No params of its own: reads the embedding through ``F.linear``."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._weight = lambda: embedding.weight  # not a submodule: no second registration

    def forward(self, h):
        return F.linear(h, self._weight())


class Reader(nn.Module):
    """Registers ``linear`` and reads its params through ``F.linear`` without calling it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, h):
        return F.linear(h, self.linear.weight, self.linear.bias)


class Block(nn.Module):
    def __init__(self, mha: bool):
        super().__init__()
        self.norm = nn.LayerNorm(D, dtype=F64)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, dtype=F64) if mha else None
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D, dtype=F64), nn.Tanh(), nn.Linear(2 * D, D, dtype=F64))

    def forward(self, h):
        x = self.norm(h)
        if self.attn is not None:
            h = h + self.attn(x, x, x, need_weights=False)[0]
        return h + self.mlp(x)


class SeamLM(nn.Module):
    """``kind``: "mha" (MHA blocks, untied head), "tied" (MLP blocks, head tied to the
    embedding through F.linear), "added" (MHA blocks; the tied head is added at the first
    forward, after binding, and at the fifth a module registering the last block's
    ``out_proj`` at the root too, which reads it before the blocks run)."""

    _no_split_modules = ["Block"]  # transformers' name for the blocks (Trainer's units)

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.forwards = kind, 0
        self.emb = nn.Embedding(V, D, dtype=F64)
        self.blocks = nn.ModuleList(Block(mha=kind != "tied") for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(D, dtype=F64)
        self.head = {"mha": nn.Linear(D, V, dtype=F64), "tied": TiedHead(self.emb), "added": None}[kind]

    def forward(self, input_ids, labels):
        if self.head is None:
            self.head = TiedHead(self.emb)
        if self.kind == "added" and self.forwards == ADD_AT:
            self.peek = Reader(self.blocks[-1].attn.out_proj)
        self.forwards += 1
        h = self.emb(input_ids)
        if self.kind == "added" and self.forwards > ADD_AT:
            h = h + 0.1 * self.peek(h)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        # A regulariser reading a param in the loss.
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + 1e-3 * self.norm.weight.square().sum()
        return {"loss": loss}


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, V, (BATCH, T), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def _probe(model, started, record):
    """Pre-hooks (after the overlap's) on the root and each block: record which params
    the forward may read still lie in a sync not waited for, and how many syncs are."""
    def outside(m):
        return [p for n, p in m.named_parameters(remove_duplicate=False) if not n.startswith("blocks.")]

    def check(name, params):
        def hook(module, args):
            ps = params(module)
            record.append((name, sum(not d.done for d in started),
                           sum(1 for p in ps for d in started if not d.done and d.holds(p))))
        return hook

    model.register_forward_pre_hook(check("root", outside))
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(check(f"block{i}", lambda m: list(m.parameters())))


def _train(rank, world_size, *, kind="mha", overlap: bool, seam: bool, units=("Block",), peek=False, probe=False):
    import hf_zero._partition as partition_module
    from hf_zero import ZeroBucketOptimizer

    model = SeamLM(kind)
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, grad_reduce="reduce_scatter",
                              overlap_param_sync=overlap)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    opt.bind_ddp(ddp, overlap_units=units)
    started = delay_param_receives(opt.gradient_path.comm) if seam else []
    record = []
    if probe:
        _probe(model, started, record)
    events = []  # "step": the local optimizer steps a chunk; "sync": a buffer's sync starts
    comm, real_sync = opt.gradient_path.comm, opt.gradient_path.comm.sync_buffer

    def sync_buffer(*args, **kwargs):
        events.append("sync")
        return real_sync(*args, **kwargs)

    comm.sync_buffer = sync_buffer
    real_unhooked = partition_module.unhooked_step  # how a partition gets its local optimizer's step, called per chunk

    def recorded_step(optimizer):
        step = real_unhooked(optimizer)

        def record_chunk(**kwargs):
            events.append("step")
            return step(**kwargs)

        return record_chunk

    partition_module.unhooked_step = recorded_step
    stale = []
    for step in range(STEPS):
        record.append(("step", step, 0))
        ddp(*_batch(step, rank))["loss"].backward()
        events.append("|")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if peek:  # read out_proj.weight without waiting, then after the wait
            before = model.blocks[0].attn.out_proj.weight.detach().clone()
            opt.wait_param_sync()
            stale.append(not torch.equal(before, model.blocks[0].attn.out_proj.weight))
    opt.wait_param_sync()
    partition_module.unhooked_step = real_unhooked
    return {
        "events": events,
        "params": [p.detach().clone() for p in model.parameters()],
        "overlap": opt.overlaps_param_sync,
        "delayed": len(started),
        "stale": stale,
        "record": record,
        "buckets": opt.gradient_path.ddp_buckets_planned(),
    }


def _train_kinds(rank, world_size, **kwargs):
    return {kind: _train(rank, world_size, kind=kind, **kwargs) for kind in KINDS}


@pytest.mark.timeout(200)
def test_overlap_with_delayed_receives_equals_no_overlap_bitwise():
    plain = run_ranks(_train_kinds, 2, overlap=False, seam=False, timeout=120)
    overlapped = run_ranks(_train_kinds, 2, overlap=True, seam=True, probe=True, timeout=120)
    for kind in KINDS:
        for rank in range(2):
            got, want = overlapped[rank][kind], plain[rank][kind]
            assert got["overlap"] and not want["overlap"]
            assert got["delayed"] > STEPS, (kind, got["buckets"])  # the seam was on the path, several buffers a step
            for g, w in zip(got["params"], want["params"]):
                assert torch.equal(g, w), kind
            # Nothing a forward reads was still in flight when it ran.
            assert all(stale == 0 for what, _, stale in got["record"] if what != "step"), (kind, got["record"])
        for g, w in zip(overlapped[0][kind]["params"], overlapped[1][kind]["params"]):
            assert torch.equal(g, w), kind


@pytest.mark.timeout(200)
def test_blocks_wait_only_for_their_own_syncs():
    """At each step's first block, the later blocks' syncs are still in flight (the seam
    completes a sync only at its wait); without units the root waits for every one."""
    per_rank = run_ranks(_train, 2, kind="mha", overlap=True, seam=True, probe=True, timeout=90)
    whole = run_ranks(_train, 2, kind="mha", overlap=True, seam=True, probe=True, units=None, timeout=90)
    for rank in range(2):
        steps = _by_step(per_rank[rank]["record"])
        # Once the buffers follow DDP's buckets (from the third step: before, one buffer
        # holds every param, the root's among them).
        assert len(steps) == STEPS and steps[1]["root"] == (0, 0), steps
        for step in steps[3:]:
            assert step["block0"][0] > 0 and step["block0"][0] > step[f"block{BLOCKS - 1}"][0], steps
            assert step[f"block{BLOCKS - 1}"][0] < step["root"][0], steps
        assert all(s == 0 for what, _, s in per_rank[rank]["record"] if what != "step")
        for step in _by_step(whole[rank]["record"])[3:]:
            assert step["root"][0] == 0 and step["block0"][0] == 0, step


def _by_step(record):
    """[{name: (syncs in flight, read params in flight)} per step], the first forward of each."""
    steps = []
    for what, a, b in record:
        if what == "step":
            steps.append({})
        else:
            steps[-1].setdefault(what, (a, b))
    return steps


@pytest.mark.timeout(200)
def test_pipelined_blocking_sync_with_delayed_receives_equals_plain_bitwise():
    """Without overlap, each buffer's sync starts as soon as this rank's pieces of it are
    stepped, while the next buffer's are stepped ([Note: pipelined sync]); the step waits
    for every receive before it returns."""
    plain = run_ranks(_train, 2, overlap=False, seam=False, timeout=90)
    delayed = run_ranks(_train, 2, overlap=False, seam=True, timeout=90)
    for rank in range(2):
        assert not delayed[rank]["overlap"]
        assert delayed[rank]["delayed"] > STEPS, delayed[rank]["buckets"]  # async, several buffers a step
        # Once the buffers follow DDP's buckets (from the third step: DDP rebuilds them
        # after its first iteration), every step starts a sync before its last chunk.
        steps = " ".join(delayed[rank]["events"]).split("|")[1:]
        assert len(steps) == STEPS and all(s.count("sync") > 1 for s in steps[2:]), steps
        assert all("sync step" in s for s in steps if s.count("sync") > 1), steps
        for got, want in zip(delayed[rank]["params"], plain[rank]["params"]):
            assert torch.equal(got, want)
    for got, want in zip(delayed[0]["params"], delayed[1]["params"]):
        assert torch.equal(got, want)


@pytest.mark.timeout(120)
def test_control_the_seam_leaves_unwaited_reads_stale():
    """Without a wait, out_proj.weight on the rank that does not own it holds the values
    from before the step: the read MHA makes without calling out_proj."""
    per_rank = run_ranks(_train, 2, overlap=True, seam=True, peek=True, timeout=90)
    assert any(any(r["stale"]) for r in per_rank), [r["stale"] for r in per_rank]


def test_units_are_checked_before_binding():
    from hf_zero._overlap import Units

    model = SeamLM("mha")
    assert Units(model, [Block]).holds(model.blocks[1]) and not Units(model, ["Block"]).holds(model)
    assert Units(model, [model.blocks[0]]).holds(model.blocks[0]) and not Units(model, [model.blocks[0]]).holds(
        model.blocks[1])
    with pytest.raises(ValueError, match="overlap_units: the Linear given is not a submodule"):
        Units(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="overlap_units: no submodule of the bound model is a GPT2Block"):
        Units(model, ["GPT2Block"])
    with pytest.raises(TypeError, match="overlap_units: expected modules, module classes or class names, got 3"):
        Units(model, [3])


def test_trainer_units_are_the_models_no_split_modules():
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from hf_zero.integrations import _compat

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=63, eos_token_id=63))
    assert _compat.block_classes(gpt2) == ["GPT2Block"]
    assert _compat.block_classes(SeamLM("tied")) == ["Block"]
    # A head class naming none inherits its base model's (as transformers collects them).
    bert = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=16))
    assert _compat.block_classes(bert) == ["BertEmbeddings", "BertLayer"]
    assert _compat.block_classes(nn.Sequential(nn.Linear(2, 2))) is None  # none: the whole sync at the root


# -- Trainer's path ------------------------------------------------------------------------------
class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 2 * BATCH * STEPS

    def __getitem__(self, i):
        ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": torch.roll(ids, 1)}


def _trainer_runs(rank, world_size, output_dir):
    import os

    from transformers import Trainer, TrainingArguments

    import hf_zero  # noqa: F401  (registers optim="zero_bucket")

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))

    class SeamTrainer(Trainer):
        seam, started, record, overlapped = False, [], [], None

        def create_optimizer(self, *args, **kwargs):
            opt = super().create_optimizer(*args, **kwargs)
            if self.seam:
                self.started = delay_param_receives(self.optimizer.gradient_path.comm)
            return opt

        def training_step(self, model, inputs, *args, **kwargs):
            if not self.record:  # after binding: the probe runs after the overlap's hooks
                _probe(self.model, self.started, self.record)
            self.record.append(("step", 0, 0))
            loss = super().training_step(model, inputs, *args, **kwargs)
            self.overlapped = self.optimizer.optimizer.overlaps_param_sync  # during the run (its end unbinds)
            return loss

    out = {}
    for kind in KINDS:
        for overlap in (False, True):
            model = SeamLM(kind)
            args = TrainingArguments(
                output_dir=f"{output_dir}/{kind}-{overlap}", per_device_train_batch_size=BATCH, max_steps=STEPS,
                learning_rate=1e-2, optim="zero_bucket", optim_args=f"overlap={str(overlap).lower()}",
                ddp_bucket_cap_mb=BUCKET_MB, train_sampling_strategy="sequential", logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
            trainer = SeamTrainer(model=model, args=args, train_dataset=_Tokens())
            trainer.seam, trainer.record = overlap, []
            trainer.train()
            out[kind, overlap] = {
                "params": [p.detach().clone() for p in model.parameters()],
                "overlap": trainer.overlapped, "delayed": len(trainer.started),
                "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                "record": trainer.record,
            }
    return out


@pytest.mark.slow  # six Trainer runs on 2 ranks (tests/conftest.py: the fast subset leaves Trainer runs out)
@pytest.mark.timeout(300)
def test_trainer_overlap_with_delayed_receives_equals_no_overlap_bitwise(tmp_path):
    per_rank = run_ranks(_trainer_runs, 2, str(tmp_path), timeout=240)
    for rank in range(2):
        for kind in KINDS:
            got, want = per_rank[rank][kind, True], per_rank[rank][kind, False]
            assert got["overlap"] and not want["overlap"] and got["delayed"] > STEPS, kind
            assert got["losses"] == want["losses"], kind
            # Per-block waits: later blocks' syncs in flight at the first block, none read.
            steps = _by_step(got["record"])
            # (from the third step; "added" changes its module tree at ADD_AT: that forward
            # waits for the whole sync)
            assert len(steps) == STEPS and all(s["block0"][0] > 0 for i, s in enumerate(steps)
                                               if i >= 3 and not (kind == "added" and i == ADD_AT)), (kind, steps)
            assert all(stale == 0 for what, _, stale in got["record"] if what != "step"), (kind, got["record"])
            for g, w in zip(got["params"], want["params"]):
                assert torch.equal(g, w), kind


# -- the bookkeeping alone, in one process (stand-in syncs) ----------------------------------------
class _Sync:
    def __init__(self):
        self.waited = False

    def wait(self, timeout_s=None):
        self.waited = True


def _launched(units=("Block",)):
    """An overlap over ``SeamLM("mha")`` with one stand-in sync per param (buffer = param
    index); a probe pre-hook on the root records which buffers were waited for by then."""
    from hf_zero._binding import Binding
    from hf_zero._overlap import ParamSyncOverlap, Units

    model = SeamLM("mha")
    reader = Reader(model.blocks[-1].attn.out_proj)  # built before any sync is in flight
    overlap = ParamSyncOverlap()
    overlap.attach(model, Units(model, units), Binding())
    params = list(model.parameters())
    order = overlap.launch_order(list(range(len(params))), {id(p): i for i, p in enumerate(params)})
    syncs = {b: _Sync() for b in order}
    overlap.launch(syncs)
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append({b for b, s in syncs.items() if s.waited}))
    names = [n for n, _ in model.named_parameters()]
    model.overlap = overlap  # held weakly by the hooks (the optimizer holds it in a run)
    return model, reader, order, syncs, seen, names


@pytest.mark.fast
def test_launch_order_and_what_the_root_waits_for():
    model, _, order, syncs, seen, names = _launched()
    outside = [i for i, n in enumerate(names) if not n.startswith("blocks.")]
    by_block = [[i for i, n in enumerate(names) if n.startswith(f"blocks.{k}.")] for k in range(BLOCKS)]
    assert order == sorted(outside) + [i for block in by_block for i in block]
    model(*_batch(0, 0))
    assert seen == [set(outside)]  # the root: only what lies outside every block
    assert all(s.waited for s in syncs.values())  # every block ran


def test_a_registration_or_a_tree_changed_behind_torchs_back_waits_for_everything():
    model, reader, _, syncs, _, _ = _launched()
    model.extra = nn.Identity()  # a registration: waits for every sync at once
    assert all(s.waited for s in syncs.values())
    model, reader, _, syncs, seen, _ = _launched()
    model._modules["late"] = reader  # no registration hook runs: the root's forward notices
    model(*_batch(0, 0))
    assert seen == [set(syncs)]
