"""hf_zero.integrations._compat: each shim's private names exist in the installed libraries.

These tests are meant to fail first, and loudly, when a torch / transformers / accelerate
release moves something a shim relies on. CI runs them on the newest and on the oldest
transformers and accelerate setup.cfg allows.
"""

import dataclasses
import enum
import importlib.util
import inspect
import warnings
from pathlib import Path

import pytest
import torch
import transformers
import transformers.trainer
from transformers import Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

import hf_zero
from hf_zero.integrations import _compat
from hf_zero.integrations import transformers as hf_tr
from tests.hf_trainer_cases import enable_activation_checkpointing, tiny_bert

pytestmark = pytest.mark.filterwarnings("ignore")

VERSION = _compat._transformers_version()
TABLE = _compat.has_optimizer_handler_table()


def _args(tmp_path, **kw):
    return TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **kw)


ROOT = Path(__file__).resolve().parent.parent


def _requirement(name: str):
    """setup.cfg's install_requires entry for ``name`` (the source, not the installed metadata)."""
    import configparser

    from packaging.requirements import Requirement

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]
    return next(r for r in map(Requirement, lines) if r.name == name)


@pytest.mark.parametrize("library", ["transformers", "accelerate"])
def test_tested_range_is_setup_cfgs_lower_bound_and_cis_pin(library):
    """[Note: the tested range]: setup.cfg's lower bound is the low end CI tests (.ci/floor installs it), there is
    no upper bound (a newer release installs, and hf_zero warns), .ci/constraints.txt pins the high end .ci/run
    installs, and the installed version is one CI tests (this test runs in both)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    low, high = _compat.TESTED[library]
    spec = _requirement(library).specifier
    assert [(s.operator, s.version) for s in spec] == [(">=", low)], str(spec)
    pins = [Requirement(line) for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert [str(r.specifier) for r in pins if r.name == library] == [f"=={high}"]
    if library == "transformers":  # the range the troubleshooting page quotes
        assert f"tested with transformers {low} to {high}" in (ROOT / "docs" / "troubleshooting.md").read_text()
    installed = __import__(library).__version__
    assert Version(low) <= Version(installed) <= Version(high), (
        f"{library} {installed} is outside the range CI tests ({low} to {high}): run the suite on it, then move "
        "_compat.TESTED and .ci/constraints.txt (or setup.cfg's lower bound) together")


def test_a_newer_release_warns_once_naming_the_tested_range(monkeypatch, tmp_path):
    import accelerate

    monkeypatch.setattr(_compat, "_WARNED", set())
    monkeypatch.setattr(transformers, "__version__", "9.1.0")
    monkeypatch.setattr(accelerate, "__version__", _compat.TESTED["accelerate"][1])  # whatever is installed
    low, high = _compat.TESTED["transformers"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two Trainers building zero_bucket in one process: one warning
            Trainer(model=tiny_bert(), args=_args(tmp_path, optim="zero_bucket")).create_optimizer()
        _compat.warn_untested()
    untested = [w for w in caught if issubclass(w.category, _compat.UntestedVersionWarning)]
    assert len(untested) == 1, [str(w.message) for w in untested]
    message = str(untested[0].message)
    assert f"tested with transformers {low} to {high}, not 9.1.0" in message
    assert f"pip install 'transformers>={low},<={high}'" in message
    # accelerate, within its range, is not named; out of it, it warns once too
    monkeypatch.setattr(accelerate, "__version__", "9.0.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compat.warn_untested()
        _compat.warn_untested()
    assert [str(w.message).split(",")[0] for w in caught] == [
        f"hf_zero was tested with accelerate {' to '.join(_compat.TESTED['accelerate'])}"]


def _changed_targets():
    """(shim, a call that meets a changed target) for every shim that patches or reads a library's internals."""
    from types import SimpleNamespace

    class Old:
        def create_optimizer(self):
            pass

        def _load_optimizer_and_scheduler(self, path):  # renamed parameter
            pass

        def _save_optimizer_and_scheduler(self, output_dir):
            pass

        def prepare(self, objects):  # not *args
            pass

        def prepare_model(self, module, device_placement=None):  # renamed, and no evaluation_mode
            pass

        def prepare_optimizer(self, optimizer):
            pass

    class NoEvaluationMode:
        def prepare_model(self, model, device_placement=None):
            pass

    class OldScaler(torch.amp.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf):
            pass

    return [
        ("watch_trainer", lambda mp: _compat.watch_trainer(Old)),
        ("before_optimizer_save", lambda mp: _compat.before_optimizer_save(type("T", (), {}), print)),
        ("after_failed_train", lambda mp: _compat.after_failed_train(type("T", (), {"train": lambda self: None}), print)),
        ("before_prepare", lambda mp: _compat.before_prepare(Old, print)),
        ("after_prepare", lambda mp: _compat.after_prepare(Old, print)),
        ("prepare_without_ddp", lambda mp: _compat.prepare_without_ddp(NoEvaluationMode, print)),
        ("prepared_optimizers", lambda mp: _compat.prepared_optimizers(SimpleNamespace(_optimizers=()))),
        ("prepared_models", lambda mp: _compat.prepared_models(SimpleNamespace())),
        ("route_unscale", lambda mp: _compat.route_unscale(OldScaler("cpu"), print)),
        ("add_optimizer_name", lambda mp: (mp.setattr(OptimizerNames, "_member_names_", ()),
                                           _compat.add_optimizer_name("zero_bucket_2", member_name="ZERO_BUCKET_2"))),
        ("register_optimizer", _changed_optimizer_dispatch),
        ("logged_entry", _changed_trainer_log),
        ("ddp_find_unused_parameters", _changed_checkpointing_flag),
    ]


def _changed_optimizer_dispatch(mp):
    if TABLE:
        import transformers.trainer_optimizer as trainer_optimizer

        mp.setattr(trainer_optimizer, "OptimizerContext", type("OptimizerContext", (), {"__annotations__": {}}))
    else:
        mp.setattr(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(lambda options, model=None: None))
    _compat.register_optimizer(hf_tr.OPTIM_NAME, hf_tr._handler)


def _changed_trainer_log(mp):
    mp.setattr(Trainer, "log", lambda self, entries, start_time=None: None)
    _compat.check_trainer_log.cache_clear()
    try:
        _compat.logged_entry(transformers.TrainerState(), {})
    finally:
        mp.undo()
        _compat.check_trainer_log.cache_clear()


def _changed_checkpointing_flag(mp):
    name = "is_activation_checkpointing" if VERSION >= _compat.ACTIVATION_CHECKPOINTING_SINCE else "is_gradient_checkpointing"
    mp.delattr(transformers.PreTrainedModel, name)
    _compat.ddp_find_unused_parameters(_args("unused"), tiny_bert())


@pytest.mark.parametrize("shim, call", _changed_targets(), ids=[shim for shim, _ in _changed_targets()])
def test_a_shim_whose_target_changed_refuses_naming_itself_the_version_and_the_fix(monkeypatch, shim, call):
    library = "torch" if shim == "route_unscale" else "accelerate" if "prepare" in shim else "transformers"
    version = __import__(library).__version__
    with pytest.raises(_compat.CompatError) as caught:
        call(monkeypatch)
    message = str(caught.value)
    assert message.startswith(f"hf_zero ({shim}): {library} {version} "), message
    if library != "torch":
        low, high = _compat.TESTED[library]
        assert f"pip install '{library}>={low},<={high}'" in message, message


def test_unversioned_shims_find_what_they_rely_on(tmp_path):
    """The names the torch / accelerate / Trainer shims reach, checked as each shim checks them."""
    from accelerate import Accelerator

    assert hasattr(torch.autograd.Variable._execution_engine, "queue_callback")  # hf_zero/_engine.py
    assert callable(torch._C._will_engine_execute_node)  # hf_zero/_engine.py (stage 2)
    assert torch._C._autograd._profiler_enabled() is False  # hf_zero/_engine.py (the step's labels)
    assert callable(torch.distributed._broadcast_coalesced)  # hf_zero/_engine.py (stage 2's buffers)
    assert callable(torch._C._current_graph_task_id) and callable(torch._C._current_autograd_node)  # stage 2
    assert callable(torch.autograd._is_checkpoint_valid) and callable(torch._C._functorch.peek_interpreter_stack)
    _autograd_grad_is_told_apart()  # hf_zero/_engine.py: accumulates / will_accumulate (stage 2)
    for name in ("prepare_model", "prepare_optimizer"):
        assert callable(getattr(Accelerator, name)), name
    accelerator = Accelerator(cpu=True)
    assert _compat.prepared_optimizers(accelerator) == [] and _compat.prepared_models(accelerator) == []
    assert list(inspect.signature(Trainer._load_optimizer_and_scheduler).parameters)[:2] == ["self", "checkpoint"]

    class HeadDecayOnly(Trainer):
        def get_decay_parameter_names(self, model):
            return ["classifier.weight"]

    # The factory reaches the Trainer that is creating it (creating_trainer), so its rules apply.
    opt = HeadDecayOnly(model=tiny_bert(), args=_args(tmp_path, optim="zero_bucket")).create_optimizer()
    assert opt.param_groups[0]["param_names"] == ["classifier.weight"]
    assert _compat.creating_trainer() is None


def test_an_unhooked_step_is_the_step_without_torchs_wrapper():
    """hf_zero/_engine.py's unhooked_step: torch wraps each Optimizer subclass's ``step`` (``hooked``,
    ``__wrapped__``) in the hooks and the profiler label; unwrapped, the same update runs and no step hook fires."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from hf_zero._engine import unhooked_step

    params = [torch.nn.Parameter(torch.arange(4.0)) for _ in range(2)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in params + copies:
        p.grad = torch.full((4,), 0.5)
    hooked, unhooked = torch.optim.AdamW(params, lr=0.1), torch.optim.AdamW(copies, lr=0.1)
    # the first instance of a class wraps its step
    assert getattr(torch.optim.AdamW.step, "hooked", False) and callable(torch.optim.AdamW.step.__wrapped__)
    fired = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: fired.append(opt))
    try:
        hooked.step()
        unhooked_step(unhooked)()
    finally:
        handle.remove()
    assert fired == [hooked]
    assert all(torch.equal(a, b) for a, b in zip(params, copies))
    assert all(torch.equal(hooked.state[a]["exp_avg"], unhooked.state[b]["exp_avg"]) for a, b in zip(params, copies))

    class NotTorch:  # no wrapper: its own step
        def step(self):
            return "stepped"

    assert unhooked_step(NotTorch())() == "stepped"


def test_version_gates_agree_with_what_is_installed():
    has_table = importlib.util.find_spec("transformers.trainer_optimizer") is not None
    assert has_table == TABLE, f"transformers {transformers.__version__}: trainer_optimizer present={has_table}"
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if VERSION >= _compat.ACTIVATION_CHECKPOINTING_SINCE:
        assert "activation_checkpointing" in fields
        assert isinstance(inspect.getattr_static(transformers.PreTrainedModel, "is_activation_checkpointing"), property)
    else:
        assert isinstance(inspect.getattr_static(transformers.PreTrainedModel, "is_gradient_checkpointing"), property)
        if VERSION >= _compat.CHECKPOINTING_ARG_SINCE:
            assert "gradient_checkpointing" in fields


def test_optimizer_names_is_the_str_enum_add_optimizer_name_extends():
    assert issubclass(OptimizerNames, str) and issubclass(OptimizerNames, enum.Enum)
    for name in ("_value2member_map_", "_member_map_"):
        assert isinstance(getattr(OptimizerNames, name), dict), name
    assert isinstance(OptimizerNames._member_names_, list)
    # TrainingArguments validates optim through the enum (the reason for the shim).
    assert "OptimizerNames(self.optim)" in inspect.getsource(TrainingArguments.__post_init__)
    member = OptimizerNames(hf_tr.OPTIM_NAME)
    assert member is OptimizerNames.ZERO_BUCKET and member in list(OptimizerNames)


def test_optimizer_dispatch_the_shim_relies_on():
    create = inspect.getsource(Trainer.create_optimizer)
    assert "self.get_optimizer_cls_and_kwargs(self.args, opt_model)" in create
    if TABLE:
        import transformers.trainer_optimizer as trainer_optimizer

        assert isinstance(trainer_optimizer._OPTIMIZER_HANDLERS, dict)
        assert all(isinstance(k, OptimizerNames) for k in trainer_optimizer._OPTIMIZER_HANDLERS)
        assert trainer_optimizer._OPTIMIZER_HANDLERS[OptimizerNames.ZERO_BUCKET] is hf_tr._handler
        assert "_OPTIMIZER_HANDLERS.get(args.optim)" in inspect.getsource(Trainer.get_optimizer_cls_and_kwargs)
        assert trainer_optimizer.is_optimizer_factory(hf_tr.ZeroBucketFactory)
        assert "optimizer_cls()(opt_model, **optimizer_kwargs)" in create
    else:
        assert isinstance(Trainer.__dict__["get_optimizer_cls_and_kwargs"], staticmethod)
        assert getattr(Trainer.get_optimizer_cls_and_kwargs, _compat._ORIGINAL) is not None
        assert 'optimizer_grouped_parameters = optimizer_kwargs.pop("model")' in create


def test_registered_name_dispatches_to_the_factory_and_others_are_untouched(tmp_path):
    model = tiny_bert()
    args = _args(tmp_path, optim="zero_bucket", learning_rate=3e-3, adam_beta1=0.8, weight_decay=0.05,
                 optim_args="inner=adam,shard=param")
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if TABLE:
        assert cls is hf_tr.ZeroBucketFactory and "model" not in kwargs
    else:
        assert isinstance(cls, hf_tr.ZeroBucketFactory) and kwargs.pop("model") is model
    assert kwargs["optimizer_class"] is torch.optim.Adam and kwargs["shard"] == "param"
    assert (kwargs["lr"], kwargs["betas"][0], kwargs["weight_decay"]) == (3e-3, 0.8, 0.05)
    assert isinstance(Trainer(model=model, args=args).create_optimizer(), hf_zero.ZeroBucketOptimizer)
    for name, want in (("adamw_torch", torch.optim.AdamW), ("sgd", torch.optim.SGD), ("adafactor", hf_tr.Adafactor)):
        got, _ = Trainer.get_optimizer_cls_and_kwargs(_args(tmp_path, optim=name), model)
        assert got is want, name


def test_registering_again_changes_nothing():
    dispatch = Trainer.__dict__["get_optimizer_cls_and_kwargs"]
    table = None
    if TABLE:
        import transformers.trainer_optimizer as trainer_optimizer

        table = dict(trainer_optimizer._OPTIMIZER_HANDLERS)
    members = list(OptimizerNames)
    hf_tr.register()
    hf_tr.register()
    assert Trainer.__dict__["get_optimizer_cls_and_kwargs"] is dispatch
    assert list(OptimizerNames) == members
    if TABLE:
        assert dict(trainer_optimizer._OPTIMIZER_HANDLERS) == table


def test_ddp_find_unused_parameters_follows_trainers_rule_for_this_version(tmp_path):
    source = inspect.getsource(transformers.trainer)
    if VERSION >= _compat.ACTIVATION_CHECKPOINTING_SINCE:
        rule = "not (self.model.is_activation_checkpointing or self.args.activation_checkpointing)"
    elif VERSION >= _compat.CHECKPOINTING_ARG_SINCE:
        rule = "not (self.model.is_gradient_checkpointing or self.args.gradient_checkpointing)"
    else:
        rule = "not model.is_gradient_checkpointing"
    assert rule in source, f"transformers {transformers.__version__} changed how Trainer picks find_unused_parameters"

    model = tiny_bert()
    assert _compat.ddp_find_unused_parameters(_args(tmp_path), model) is True
    assert _compat.ddp_find_unused_parameters(_args(tmp_path, ddp_find_unused_parameters=False), model) is False
    assert _compat.ddp_find_unused_parameters(_args(tmp_path), torch.nn.Linear(2, 2)) is True
    enable_activation_checkpointing(model, use_reentrant=False)
    assert _compat.ddp_find_unused_parameters(_args(tmp_path), model) is False
    assert _compat.ddp_find_unused_parameters(_args(tmp_path, ddp_find_unused_parameters=True), model) is True


def test_optimizer_save_hook_wraps_where_trainer_writes_the_optimizer():
    """hf_zero consolidates in Trainer._save_optimizer_and_scheduler (before_optimizer_save):
    Trainer must still write optimizer.pt there, from _save_checkpoint, on every rank."""
    original = inspect.unwrap(Trainer._save_optimizer_and_scheduler)
    assert getattr(Trainer._save_optimizer_and_scheduler, _compat._TRAINER_WRAPPED, False)
    assert list(inspect.signature(original).parameters) == ["self", "output_dir"]
    assert "torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))" in inspect.getsource(original)
    assert "self._save_optimizer_and_scheduler(output_dir)" in inspect.getsource(Trainer._save_checkpoint)
    wrapped = Trainer._save_optimizer_and_scheduler
    _compat.before_optimizer_save(Trainer, hf_tr._before_optimizer_save)
    assert Trainer._save_optimizer_and_scheduler is wrapped  # idempotent


def test_prepare_hook_runs_before_accelerate_dispatches_engines():
    """Engines with their own prepare paths (DeepSpeed, Megatron-LM, FSDP2) are refused in
    a wrapper of Accelerator.prepare (before_prepare), before that dispatch."""
    from accelerate import Accelerator

    assert getattr(Accelerator.prepare, _compat._BEFORE_PREPARE, False)
    source = inspect.getsource(inspect.unwrap(Accelerator.prepare))
    for path in ("self._prepare_deepspeed(", "self._prepare_megatron_lm("):
        assert path in source, path


def test_prepare_without_ddp_relies_on_evaluation_mode_skipping_only_the_ddp_wrap():
    """Stage 2's shim: ``prepare_model(..., evaluation_mode=True)`` must skip the DDP wrap and
    nothing else (autocast before it, ``torch.compile`` after it)."""
    from accelerate import Accelerator

    from hf_zero.integrations import accelerate as hf_acc

    hf_acc.install(Accelerator)
    assert getattr(Accelerator.prepare_model, _compat._WITHOUT_DDP, False)
    original = inspect.unwrap(Accelerator.prepare_model)
    assert "evaluation_mode" in inspect.signature(original).parameters
    lines = inspect.getsource(original).splitlines()
    gate = next(i for i, line in enumerate(lines) if line.strip() == "if not evaluation_mode:")
    indent = len(lines[gate]) - len(lines[gate].lstrip())
    end = next(i for i in range(gate + 1, len(lines))
               if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent)
    ddp = [i for i, line in enumerate(lines) if "DistributedDataParallel(" in line]
    assert ddp and all(gate < i < end for i in ddp), "DDP built outside the evaluation_mode gate"
    assert any("get_mixed_precision_context_manager" in line for line in lines[:gate]), "autocast not before it"
    assert any("torch.compile(" in line for line in lines[end:]), "torch.compile not after it"


def test_accelerate_marks_a_prepared_model_and_leaves_a_marked_one_alone():
    """The binding removes Accelerate's mark from a stage-2 model at its end (``_compat.prepared_mark``):
    Accelerate must still mark the model it returns and, where prepare_model reads the mark, return a
    marked model unprepared (the lowest Accelerate setup.cfg allows marks it without reading it)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert _compat.prepared_mark(model) == _compat.PREPARED_MARK
    # Accelerate 1.15 returns a marked model unprepared (why the binding removes the mark); 1.3 never reads it there
    source = inspect.getsource(inspect.unwrap(Accelerator.prepare_model))
    assert ("Ensure we can't double wrap a model" in source) == (_compat.PREPARED_MARK in source)
    assert _compat.prepared_mark(torch.nn.Linear(2, 2)) is None


def test_route_unscale_is_what_gradscaler_reads_grads_through():
    """hf_zero/integrations/amp.py relies on torch's GradScaler finding an optimizer's grads only
    through ``_unscale_grads_`` (in ``unscale_`` and in ``step`` without one), and on ``step``
    (skip) and ``update`` (back off) reading only the record it returns."""
    import copy
    import pickle

    params = inspect.signature(torch.amp.GradScaler._unscale_grads_).parameters
    assert tuple(params) == _compat.UNSCALE_GRADS_PARAMS
    seen = []

    class Stepper(torch.optim.SGD):  # a stand-in for a stage-2 optimizer: its grads are not in p.grad
        pass

    def route(optimizer, inv_scale, found_inf, allow_fp16):
        if not isinstance(optimizer, Stepper):
            return None
        seen.append((inv_scale.item(), allow_fp16))
        found_inf.fill_(float(len(seen) == 2))  # the second iteration overflows
        return {found_inf.device: found_inf}

    p = torch.nn.Parameter(torch.ones(2))
    opt = Stepper([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    _compat.route_unscale(scaler, route)
    _compat.route_unscale(scaler, route)  # idempotent
    for explicit in (True, False):  # unscale_ then step; step alone
        scaler.scale(torch.ones(()))  # (the scale tensor is made at the first scale())
        p.grad = torch.ones(2)  # what torch itself would unscale (it must not, here)
        if explicit:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert seen == [(1 / 8, False), (1 / 8, False)]
    assert torch.equal(p.detach(), torch.zeros(2))  # stepped once (grad 1 as given, not unscaled), then skipped
    assert scaler.get_scale() == 4.0  # the overflow of the second iteration backed the scale off
    # Another optimizer goes to torch's own method.
    q = torch.nn.Parameter(torch.ones(2))
    plain = torch.optim.SGD([q], lr=1.0)
    q.grad = torch.full((2,), 4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(plain)
    assert torch.equal(q.grad, torch.ones(2))
    scaler.step(plain)
    scaler.update()
    # A routed scaler still pickles and copies (Accelerate's objects may be), and the copy is routed
    # to itself (hf_zero's route: a module-level function; the test's local one does not pickle).
    routed = hf_zero.prepare_grad_scaler(torch.amp.GradScaler("cpu"))
    for clone in (pickle.loads(pickle.dumps(routed)), copy.deepcopy(routed)):
        assert vars(clone)["_unscale_grads_"].scaler is clone
        assert vars(clone)["_unscale_grads_"].route is vars(routed)["_unscale_grads_"].route


def _autograd_grad_is_told_apart():
    """What stage 2's arming reads of the engine: a whole backward, one restricted to ``inputs=``, and
    ``torch.autograd.grad`` of a leaf (whose question torch refuses with a message naming autograd.grad)."""
    from hf_zero._engine import accumulates, grad_accumulator

    w = torch.nn.Parameter(torch.ones(2))
    node = grad_accumulator(w)
    out = (w * 2).sum()
    seen = []
    out.grad_fn.register_prehook(lambda grads: seen.append(accumulates(lambda: [node])))
    torch.autograd.grad(out, w, retain_graph=True)
    out.backward(inputs=[w], retain_graph=True)
    out.backward()
    assert seen == [False, True, True]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_train_that_raises_reaches_the_failure_hook_and_unbinds(tmp_path, error):
    """Trainer's callbacks get no event when train() raises (on_train_end comes only from the inner loop's
    normal end): after_failed_train wraps Trainer.train, and what it calls unbinds the optimizer before the
    exception goes on (an interrupt or an error in a callback; a stage-2 binding is the one that shows)."""
    from transformers import TrainerCallback

    from tests.hf_trainer_cases import TokenDataset

    assert getattr(Trainer.train, _compat._TRAINER_WRAPPED, False)
    wrapped = Trainer.train
    _compat.after_failed_train(Trainer, hf_tr._unbind_after_failure)
    assert Trainer.train is wrapped  # idempotent

    class Raise(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise error("stop")

    from accelerate import Accelerator

    # Accelerate marks a prepared model; the binding removes the mark where prepare_model reads it (1.15), and
    # the lowest Accelerate setup.cfg allows marks it at the end of prepare() and never reads it there (1.3)
    reads = _compat.PREPARED_MARK in inspect.getsource(inspect.unwrap(Accelerator.prepare_model))
    ignored = set() if reads else {_compat.PREPARED_MARK}
    model = tiny_bert()
    never = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks),
              sorted(set(m.__dict__) - ignored)) for m in tiny_bert().modules()]
    trainer = Trainer(model=model, train_dataset=TokenDataset(), callbacks=[Raise()],
                      args=_args(tmp_path, optim="zero_bucket", optim_args="stage=2", max_steps=3,
                                 per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True))
    with pytest.raises(error, match="stop"):
        trainer.train()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks),
             sorted(set(m.__dict__) - ignored)) for m in model.modules()] == never
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
