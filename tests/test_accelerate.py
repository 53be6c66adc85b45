"""Accelerate integration: prepare() with ZeroBucketOptimizer, accumulate/clip/backward,
save_state/load_state with bucket views, and fp16 GradScaler overflow on every rank.

The loops make no hf_zero call besides building the optimizer (the accelerator is wired
when it prepares it, in either order with the model; ``save_state`` then writes each
rank's optimizer state, no gather); the plain-file and explicitly sharded runs call
``prepare_accelerator(..., sharded_checkpoints=False / True)``.
"""

import os

import pytest
import torch

import hf_zero
from tests._dist import run_ranks
from tests.hf_trainer_cases import TokenDataset, tiny_bert

pytestmark = pytest.mark.filterwarnings("ignore")

ACC_STEPS, PER_DEVICE, STEPS, MAX_NORM, LR = 2, 2, 5, 0.5, 1e-2
FROZEN_AT_PREPARE = "bert.encoder.layer.1."
# optimizer step -> {name prefix: requires_grad}, applied before that step's forward
SCHEDULE = {1: {FROZEN_AT_PREPARE: True}, 2: {"bert.embeddings.": False}, 4: {"bert.embeddings.": True}}


def _apply(model, step):
    for name, p in model.named_parameters():
        for prefix, flag in SCHEDULE.get(step, {}).items():
            if name.startswith(prefix):
                p.requires_grad_(flag)


def _model():
    model = tiny_bert()
    for name, p in model.named_parameters():
        if name.startswith(FROZEN_AT_PREPARE):
            p.requires_grad_(False)
    return model


def _groups(model):
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0},
    ]


def _accelerator(**kwargs):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    # Freezing a param DDP reduces needs find_unused_parameters=True (docs/architecture.md, field facts).
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    return Accelerator(cpu=True, kwargs_handlers=handlers, **kwargs)


def _accelerate_run(rank, world_size, *, build_before_prepare, save_dir, sharded_checkpoints=None):
    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    accelerator = _accelerator(gradient_accumulation_steps=ACC_STEPS)
    model = _model()
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=PER_DEVICE, shuffle=False)
    if build_before_prepare:
        optimizer = hf_zero.ZeroBucketOptimizer(_groups(model), torch.optim.AdamW, lr=LR)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model = accelerator.prepare(model)
        optimizer = hf_zero.ZeroBucketOptimizer(_groups(model.module), torch.optim.AdamW, lr=LR)
        optimizer, loader = accelerator.prepare(optimizer, loader)
    if sharded_checkpoints is not None:
        hf_zero.prepare_accelerator(accelerator, sharded_checkpoints=sharded_checkpoints)
    # Otherwise no hf_zero call at all: preparing a ZeroBucketOptimizer wires the accelerator.
    batches = list(loader)

    def train(first_step, last_step):
        for step in range(first_step, last_step):
            _apply(model.module, step)
            for micro in range(ACC_STEPS):
                with accelerator.accumulate(model):
                    loss = model(**batches[(step * ACC_STEPS + micro) % len(batches)]).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    optimizer.step()
                    optimizer.zero_grad()

    def params():
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}

    train(0, 3)
    inner = optimizer.optimizer
    storages = {p.untyped_storage().data_ptr() for p in model.module.parameters() if p.requires_grad}
    buffers = len(inner.gradient_path.layout.buffers)
    at_save = params()
    accelerator.save_state(save_dir)
    train(3, STEPS)
    uninterrupted = params()

    accelerator.save_model(model, os.path.join(save_dir, "model"))
    accelerator.load_state(save_dir)
    after_load = params()
    _apply(model.module, 2)  # the trainable set at the save
    train(3, STEPS)
    return {
        "final": uninterrupted,
        "at_save": at_save,
        "after_load": after_load,
        "replayed": params(),
        "shared_storages": len(storages),
        "buffers": buffers,
        "rebuilds": inner.rebuilds,
        "grad_reduce": inner.grad_reduce,
    }


def _reference():
    """The same loop in one process: torch AdamW, global batch, plain clipping."""
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model), lr=LR)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=PER_DEVICE * 2, shuffle=False)
    batches = list(loader)
    for step in range(STEPS):
        _apply(model, step)
        for micro in range(ACC_STEPS):
            loss = model(**batches[(step * ACC_STEPS + micro) % len(batches)]).loss / ACC_STEPS
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fp16_overflow_run(rank, world_size, *, overflow_step):
    """fp16 autocast with a real GradScaler (CPU), an inf grad on rank 1 only, in a param
    DDP does not reduce (frozen at prepare, unfrozen before the overflow step)."""
    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    accelerator = _accelerator(mixed_precision="fp16")
    # Accelerate creates no GradScaler on CPU; give it the CPU one so its fp16 code path runs.
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = _model().float()
    optimizer = hf_zero.ZeroBucketOptimizer(_groups(model), torch.optim.AdamW, lr=LR)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    target = model.module.bert.encoder.layer[1].output.dense.weight
    log = []
    for step, batch in enumerate(loader):
        if step == 1:
            _apply(model.module, 1)  # unfreeze the layer DDP does not reduce
        handle = None
        if step == overflow_step and rank == 1:
            handle = target.register_hook(lambda g: torch.full_like(g, float("inf")))
        before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        with accelerator.autocast():
            loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        if handle is not None:
            handle.remove()
        changed = any(not torch.equal(before[n], p) for n, p in model.module.named_parameters())
        log.append((accelerator.optimizer_step_was_skipped, changed, accelerator.scaler.get_scale()))
        if step == 3:
            break
    return log, {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.timeout(300)
def test_accelerate_loop_equals_one_process_and_save_load_state_is_exact(tmp_path):
    (runs0, error0), (runs1, error1) = run_ranks(_accelerate_many, 2, str(tmp_path), timeout=280)
    runs = [runs0, runs1]
    assert error0 == error1
    assert error0.startswith("hf_zero: bert.embeddings.word_embeddings.weight") and "find_unused_parameters=True" in error0
    reference = _reference()
    for rank_results in zip(*runs):  # built before prepare, built after prepare
        r0, r1 = rank_results
        for n in reference:
            assert torch.equal(r0["final"][n], r1["final"][n]), f"replicas differ: {n}"
            torch.testing.assert_close(r0["final"][n], reference[n], rtol=0, atol=1e-12, msg=lambda m: f"{n}: {m}")
            # load_state restored the saved weights exactly; replaying the steps is exact.
            assert torch.equal(r0["after_load"][n], r0["at_save"][n]), f"load_state: {n}"
            assert torch.equal(r0["replayed"][n], r0["final"][n]), f"replay after load_state: {n}"
        # Bucket views: trainable params lived in hf_zero's buffers (one per DDP bucket with
        # the gradient path) when save_state ran.
        assert r0["shared_storages"] == r0["buffers"] < 5
        assert r0["rebuilds"] >= 4
        assert r0["grad_reduce"] == "reduce_scatter"  # Accelerate's default path, clipping routed
    from safetensors.torch import load_file

    for saved in ("before/model.safetensors", "after/model.safetensors", "before/model/model.safetensors"):
        assert len(load_file(str(tmp_path / saved))) == len(reference), saved  # nothing dropped for sharing storage
    final = load_file(str(tmp_path / "before" / "model" / "model.safetensors"))  # accelerator.save_model
    for n in reference:
        assert torch.equal(final[n], runs0[0]["final"][n]), n
    # By default each rank saved its own optimizer state (optimizer.bin refers to it); with
    # sharded_checkpoints=False optimizer.bin is the plain state dict, streamed from those files.
    from hf_zero import _offline

    assert os.path.getsize(tmp_path / "before" / "optimizer.bin") < 2000
    sharded = _offline.consolidate_checkpoint(tmp_path / "before" / "hf_zero_optimizer")
    assert not os.path.exists(tmp_path / "after" / "hf_zero_optimizer")
    plain = torch.load(tmp_path / "after" / "optimizer.bin", weights_only=True)
    assert plain["state"].keys() == sharded["state"].keys() and len(plain["state"]) == len(reference)
    for i, st in sharded["state"].items():
        assert plain["state"][i].keys() == st.keys()
        for k, v in st.items():
            torch.testing.assert_close(plain["state"][i][k], v, rtol=0, atol=1e-12)


def _freeze_without_find_unused(rank, world_size):
    """Accelerate's default DDP (find_unused_parameters=False) and a freeze: a clear error."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_bert()
    optimizer = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = next(iter(torch.utils.data.DataLoader(TokenDataset(), batch_size=PER_DEVICE)))
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    model.module.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    try:
        model(**batch)
    except ValueError as e:
        return str(e)
    return "no error"


def _accelerate_many(rank, world_size, root):
    return [
        _accelerate_run(rank, world_size, build_before_prepare=True, save_dir=os.path.join(root, "before")),
        _accelerate_run(rank, world_size, build_before_prepare=False, save_dir=os.path.join(root, "after"),
                        sharded_checkpoints=False),
    ], _freeze_without_find_unused(rank, world_size)


@pytest.mark.reliability("fp16: inf grad on rank 1 only, in a param DDP does not reduce", "every rank skips the step and halves the loss scale; no hang")
@pytest.mark.timeout(200)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    (log0, params0), (log1, params1) = run_ranks(_fp16_overflow_run, 2, overflow_step=2, timeout=180)
    assert log0 == log1
    skipped = [s for s, _, _ in log0]
    assert skipped == [False, False, True, False]
    assert [changed for _, changed, _ in log0] == [True, True, False, True]
    assert log0[2][2] == log0[1][2] / 2  # the scale backed off once, on both ranks
    for n in params0:
        assert torch.equal(params0[n], params1[n]), n


def test_prepare_accelerator_needs_a_prepared_zero_optimizer():
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"no ZeroBucketOptimizer .* call it after accelerator.prepare"):
        hf_zero.prepare_accelerator(accelerator)

    # Refused when prepared, before any training: hf_zero wires every Accelerator by itself.
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=True))
    with pytest.raises(ValueError, match="save_on_each_node=True"):
        accelerator.prepare(model, hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW))


def _sharded_save_state_run(rank, world_size, root):
    return _accelerate_run(rank, world_size, build_before_prepare=True, save_dir=os.path.join(root, "sharded"),
                           sharded_checkpoints=True)


@pytest.mark.reliability("Accelerate save_state/load_state with prepare_accelerator(sharded_checkpoints=True), 2 ranks", "each rank writes its own state; optimizer.bin is a tiny reference; load_state then the same steps is exact")
@pytest.mark.timeout(150)
def test_sharded_save_state_load_state_round_trip_is_exact(tmp_path):
    from hf_zero import _offline, _sharded

    r0, r1 = run_ranks(_sharded_save_state_run, 2, str(tmp_path), timeout=130)
    reference_params = _reference()
    for n in reference_params:
        assert torch.equal(r0["final"][n], r1["final"][n]), f"replicas differ: {n}"
        torch.testing.assert_close(r0["final"][n], reference_params[n], rtol=0, atol=1e-12, msg=lambda m: f"{n}: {m}")
        assert torch.equal(r0["after_load"][n], r0["at_save"][n]), f"load_state: {n}"
        assert torch.equal(r0["replayed"][n], r0["final"][n]), f"replay after load_state: {n}"
    saved = tmp_path / "sharded"
    shards = str(saved / "hf_zero_optimizer")
    assert _sharded.is_sharded_checkpoint(shards)
    assert sum(name.endswith("-of-00002.safetensors") for name in os.listdir(shards)) == 2
    marker = torch.load(str(saved / "optimizer.bin"), weights_only=True)
    assert marker["state"] == {} and marker[_sharded.REFERENCE_KEY]["token"] == _sharded.token_at(shards)
    assert os.path.getsize(saved / "optimizer.bin") < 2000
    assert len(_offline.consolidate_checkpoint(shards)["state"]) == len(reference_params)


@pytest.mark.reliability("accelerator.prepare(model, ZeroBucketOptimizer) under FSDP, DeepSpeed, Megatron-LM, tensor/context parallelism",
                         "`ValueError` before Accelerate touches anything, naming the engine")
def test_prepare_refuses_engines_that_shard_or_split_params(monkeypatch):
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    cases = [(DistributedType.DEEPSPEED, None, r"DeepSpeed \(distributed_type=DEEPSPEED\)"),
             (DistributedType.MEGATRON_LM, None, r"Megatron-LM"),
             (DistributedType.FSDP, None, r"FSDP \(distributed_type=FSDP\)")]
    if hasattr(accelerate, "ParallelismConfig"):  # Accelerate >= 1.10
        cases += [(DistributedType.MULTI_CPU, accelerate.ParallelismConfig(tp_size=2),
                   r"tensor parallelism \(parallelism_config.tp_size=2\)"),
                  (DistributedType.MULTI_CPU, accelerate.ParallelismConfig(dp_shard_size=2), r"FSDP \(dp_shard_size\)")]
    for kind, config, message in cases:
        monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self, kind=kind: kind))
        monkeypatch.setattr(Accelerator, "parallelism_config", property(lambda self, config=config: config),
                            raising=False)
        for objects in ((model, opt), (opt,)):
            with pytest.raises(ValueError, match=rf"Accelerator.prepare: ZeroBucketOptimizer cannot run under {message}"):
                accelerator.prepare(*objects)
        assert accelerator._optimizers == [] and accelerator._models == []
    monkeypatch.undo()
    # Plain data parallelism (here one process) is fine.
    accelerator.prepare(model, opt)
