"""``--optim zero_bucket`` with hf_zero merely installed: processes that never import hf_zero.

Every run here is a fresh subprocess, as a user would start it: an unmodified
``HfArgumentParser`` script under ``torchrun`` (command line and JSON args), the
``trl sft`` CLI (whose ``accelerate launch`` children parse again), and a process that
unpickles a checkpoint's ``training_args.bin``. ``zero_bucket`` runs must equal the same
command with ``adamw_torch_fused`` (Trainer's default) bitwise (logged losses and final weights). Needs hf_zero
installed (``pip install -e .`` or ``pip install .``): the start-up hook is the
``hf_zero_autoload.pth`` file that install writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests._procs import Result, Run, start, wait_all

SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORLD = 2
# Every run here ends its process group (train_any.py destroys it; trl's sft script calls
# trainer.end()), so every run must exit 0: an abort or a hang at exit fails the test.
# (A plain ending is measured against a plain DDP + AdamW control in tests/test_exit.py.)
# A run still alive EXIT_GRACE_S (tests/_procs.py) after its outputs were complete is killed and fails.

pytestmark = pytest.mark.filterwarnings("ignore")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_ZERO_AUTOLOAD"}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def _start(cmd: list[str], cwd: Path, outputs_complete: Callable[[str], bool] | None = None, **env: str) -> Run:
    """Start ``cmd`` in a session of its own (tests/_procs.py), in :func:`_env` plus ``env``."""
    return start(cmd, cwd, _env(**env), outputs_complete)


_wait = wait_all


def _run(cmd: list[str], cwd: Path, timeout: float, **env: str) -> tuple[int, str]:
    result = _wait({"run": _start(cmd, cwd, **env)}, timeout)["run"]
    return result.rc, result.out


def _assert_finished(result: Result, what: str) -> None:
    """The run did all its work and exited 0 (no abort, no hang at exit)."""
    if result.outputs_complete and result.rc == 0:
        return
    how = "hung at exit (killed)" if result.rc is None else f"exit code {result.rc}"
    pytest.fail(f"{what}: {how}, outputs complete: {result.outputs_complete}; output tail:\n{result.out[-6000:]}")


def _assert_finished_or_stack_hang(result: Result, optim: str, what: str) -> None:
    """As :func:`_assert_finished`, except that the plain-torch control (``adamw_torch_fused``) may
    hang at exit once its outputs are complete: torch's own deadlock ([Note: exit after a
    last gather] in hf_zero/integrations/transformers.py), reported; its outputs
    are still compared. hf_zero's runs get no such allowance."""
    if optim == "adamw_torch_fused" and result.rc is None and result.outputs_complete:
        print(f"{what}: the plain-torch control hung at exit (torch's deadlock): reported, outputs compared")
        return
    _assert_finished(result, what)


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a), load_file(b)
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# -- an unmodified HfArgumentParser script under torchrun --------------------------------------
TRAIN_ARGS = dict(max_steps=6, save_steps=3, logging_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
                  weight_decay=0.1, warmup_steps=2, seed=0, report_to="none", disable_tqdm=True)


def _cli(args: dict) -> list[str]:
    return [item for key, value in args.items() for item in (f"--{key}", str(value))]


def _train_any(script_args: list[str], output_dir: Path, cwd: Path) -> Run:
    """``train_any.py`` under torchrun on WORLD gloo processes; complete once every rank wrote ``done-<rank>``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(SCRIPTS / "train_any.py"), *script_args]
    return _start(cmd, cwd, lambda _: all((output_dir / f"done-{rank}").exists() for rank in range(WORLD)))


def _history(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / "log_history.json").read_text())


def _losses(output_dir: Path) -> list[tuple]:
    """(step, loss, learning rate) of each logged step."""
    return [(e["step"], e["loss"], e["learning_rate"]) for e in _history(output_dir) if "loss" in e]


def _grad_norms(output_dir: Path) -> list[float]:
    return [e["grad_norm"] for e in _history(output_dir) if "loss" in e]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Runs ``train_any.py`` on 2 gloo processes from the command line, with zero_bucket
    and with adamw_torch_fused, at the same time. Returns {optim: output dir}."""
    root = tmp_path_factory.mktemp("train_any")
    dirs = {optim: root / optim for optim in ("zero_bucket", "adamw_torch_fused")}
    runs = {optim: _train_any(_cli({**TRAIN_ARGS, "output_dir": d, "optim": optim}), d, root)
            for optim, d in dirs.items()}
    for optim, result in _wait(runs, timeout=170).items():
        _assert_finished_or_stack_hang(result, optim, f"train_any.py --optim {optim}")
    return dirs


@pytest.mark.timeout(200)
def test_unmodified_script_zero_bucket_trains_and_checkpoints_as_adamw_torch_fused(trained):
    zero, adamw = trained["zero_bucket"], trained["adamw_torch_fused"]
    assert len(_losses(zero)) == TRAIN_ARGS["max_steps"]
    assert _losses(zero) == _losses(adamw)
    # hf_zero's gradient path sums the norm per owned shard (docs/gradient_path.md): equal to
    # the last bits of float64; below max_grad_norm (1.0), so clipping changes nothing.
    assert _grad_norms(zero) == pytest.approx(_grad_norms(adamw), rel=1e-12, abs=0)
    assert max(_grad_norms(adamw)) < 1.0
    _same_weights(zero / "model.safetensors", adamw / "model.safetensors")
    # hf_zero really trained it: its callback's facts, sharded over both ranks
    facts = [e for e in _history(zero) if "zero_trainable_elements_per_rank" in e]
    assert facts and len(facts[0]["zero_trainable_elements_per_rank"]) == WORLD
    assert not any("zero_rebuilds" in e for e in _history(adamw))
    for step in (3, 6):
        assert (zero / f"checkpoint-{step}" / "optimizer.pt").is_file()


@pytest.mark.timeout(200)
def test_json_args_file_resumes_exactly(trained, tmp_path):
    """The JSON way (``script.py args.json``), resuming the zero_bucket run from step 3."""
    first = trained["zero_bucket"]
    out = tmp_path / "resumed"
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({**TRAIN_ARGS, "output_dir": str(out), "optim": "zero_bucket",
                                     "resume_from_checkpoint": str(first / "checkpoint-3")}))
    done = _wait({
        "resume": _train_any([str(args_file)], out, tmp_path),
        # meanwhile, a fresh process that never imports hf_zero loads the checkpoint's args
        "load": _start([sys.executable, "-c", _LOAD_ARGS, str(first / "checkpoint-3" / "training_args.bin")],
                       tmp_path),
    }, timeout=150)
    _assert_finished(done["resume"], "train_any.py args.json")
    assert _losses(out) == _losses(first)
    assert _grad_norms(out) == _grad_norms(first)
    _same_weights(out / "model.safetensors", first / "model.safetensors")

    load = done["load"]
    assert load.rc == 0, load.out
    assert load.out.splitlines()[-1] == "optim: zero_bucket, hf_zero imported before loading: False"


_LOAD_ARGS = """
import sys
import torch
before = "hf_zero" in sys.modules
args = torch.load(sys.argv[1], weights_only=False)
print(f"optim: {args.optim.value}, hf_zero imported before loading: {before}")
"""


# -- turned off ----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_autoload_off_refuses_zero_bucket_and_import_hf_zero_still_registers(tmp_path):
    script = [str(SCRIPTS / "train_any.py"), "--output_dir", str(tmp_path / "out"), "--optim", "zero_bucket",
              "--max_steps", "2", "--report_to", "none"]
    done = _wait({
        "off": _start([sys.executable, *script], tmp_path, HF_ZERO_AUTOLOAD="0"),
        # the documented way when the start-up hook cannot run: import hf_zero, then run the script
        "explicit": _start([sys.executable, "-c", _IMPORT_THEN_RUN, *script], tmp_path, HF_ZERO_AUTOLOAD="0"),
    }, timeout=100)
    off, explicit = done["off"], done["explicit"]
    assert off.rc == 2 and "argument --optim: invalid choice: 'zero_bucket'" in off.out, off.out[-3000:]
    # ... and says why, before the parser's refusal
    assert "HF_ZERO_AUTOLOAD=0 has switched off hf_zero's start-up hook" in off.out, off.out[-3000:]
    assert explicit.rc == 0, explicit.out[-3000:]
    assert (tmp_path / "out" / "done-0").exists()


_IMPORT_THEN_RUN = """
import runpy, sys
import hf_zero
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# -- the trl sft CLI -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    """A tiny GPT-2 with its own word-level tokenizer and a 16-line text dataset, on disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny_lm")
    words = [f"w{i}" for i in range(20)]
    vocab = {token: i for i, token in enumerate(["<unk>", "<pad>", "<eos>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(root / "model")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    GPT2LMHeadModel(config).save_pretrained(root / "model")
    g = torch.Generator().manual_seed(1)
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w") as f:
        for _ in range(16):
            picks = torch.randint(0, len(words), (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
            f.write(json.dumps({"text": " ".join(words[i] for i in picks.tolist())}) + "\n")
    return root


def _console_script(name: str) -> str:
    """The console script ``name`` of this Python's environment (as a user runs it)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"no {name!r} command next to {sys.executable} or on PATH"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _printed_logs(out: str) -> list[str]:
    """The loss lines the Trainer printed (rank 0), ZeRO facts removed."""
    return [re.sub(r", 'zero_\w+': [^,}]+", "", line) for line in out.splitlines() if line.startswith("{'loss'")]


@pytest.mark.timeout(480)
def test_trl_sft_cli_zero_bucket_equals_adamw_torch_fused(tiny_lm, tmp_path):
    """``trl sft`` parses in the parent, then ``accelerate launch`` starts 2 children that
    parse again: no process imports hf_zero. The zero_bucket runs (stage 1, and stage 2 with
    ``--optim_args stage=2``: no DDP wrap) must exit 0. The plain
    torch control can hang at exit in torch itself ([Note: exit after a last gather] in
    hf_zero/integrations/transformers.py: 6 of 48 ``adamw_torch`` runs here; ``zero_bucket``
    1 of 30 before the 50 ms at train end, 0 of 18 after: too few runs to tell apart); such a hang, with its outputs complete, is
    reported as the stack's, and its outputs are still compared. Any other failure of either
    fails. The runs go one after the other; the printed logs are rounded, so the final
    weights carry the bitwise comparison."""
    logs = {}
    # run -> (optim, optim_args): stage 2 takes gradient synchronisation over from DDP (docs/stage2.md)
    runs = {"zero_bucket": ("zero_bucket", []), "zero_bucket_stage2": ("zero_bucket", ["--optim_args", "stage=2"]),
            "adamw_torch_fused": ("adamw_torch_fused", [])}
    for name, (optim, extra) in runs.items():
        cmd = [_console_script("trl"), "sft", "--model_name_or_path", str(tiny_lm / "model"), "--dataset_name",
               str(tiny_lm / "data"), "--output_dir", str(tmp_path / name), "--optim", optim, *extra, "--max_steps", "4",
               "--per_device_train_batch_size", "2", "--logging_steps", "1", "--save_strategy", "no",
               "--report_to", "none", "--learning_rate", "1e-2", "--max_length", "16", "--seed", "0",
               "--disable_tqdm", "true", "--use_cpu", "true", "--bf16", "false",
               # no clipping (grad norms reach 1.25): hf_zero's sharded norm may differ in the last bit
               "--max_grad_norm", "10",
               "--num_processes", str(WORLD), "--multi_gpu", "--main_process_port", str(_free_port())]
        # the script's last outputs: the model, then this line (rank 0)
        run = _start(cmd, tmp_path, lambda out: "Model saved to" in out, HF_DATASETS_CACHE=str(tmp_path / f"cache-{name}"))
        result = _wait({name: run}, timeout=150)[name]
        _assert_finished_or_stack_hang(result, name, f"trl sft --optim {optim} {' '.join(extra)}")
        logs[name] = result.out
    assert "'zero_balance'" in logs["zero_bucket"] and "'zero_balance'" not in logs["adamw_torch_fused"]
    for name in ("zero_bucket", "zero_bucket_stage2"):
        assert len(_printed_logs(logs[name])) == 4
        assert _printed_logs(logs[name]) == _printed_logs(logs["adamw_torch_fused"]), name
        _same_weights(tmp_path / name / "model.safetensors", tmp_path / "adamw_torch_fused" / "model.safetensors")


# -- the start-up hook and its packaging -----------------------------------------------------
def test_install_again_is_idempotent():
    import _hf_zero_autoload
    import transformers.trainer
    from transformers.training_args import OptimizerNames

    import hf_zero

    before = ([m.value for m in OptimizerNames], list(transformers.trainer.DEFAULT_CALLBACKS))
    _hf_zero_autoload.install()
    _hf_zero_autoload.install()
    assert ([m.value for m in OptimizerNames], list(transformers.trainer.DEFAULT_CALLBACKS)) == before
    assert before[0].count("zero_bucket") == 1 and before[1].count(hf_zero.ZeroBucketCallback) == 1
    assert sum(type(f).__module__ == "_hf_zero_autoload" for f in sys.meta_path) <= 1


_STARTUP = """
import sys
print(sorted(m for m in sys.modules if m.split(".")[0] in ("hf_zero", "_hf_zero_autoload", "torch", "transformers")))
print(sum(type(f).__module__ == "_hf_zero_autoload" for f in sys.meta_path))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("autoload, finders", [(None, "1"), ("0", "0")])
def test_interpreter_start_imports_only_the_hook(tmp_path, autoload, finders):
    env = {} if autoload is None else {"HF_ZERO_AUTOLOAD": autoload}
    rc, out = _run([sys.executable, "-c", _STARTUP], tmp_path, timeout=30, **env)
    assert rc == 0, out
    assert out.splitlines() == ["['_hf_zero_autoload']", finders], (
        f"{out}\nIs hf_zero installed (pip install -e .)? Its hf_zero_autoload.pth runs the hook.")


@pytest.mark.timeout(60)
def test_autoload_off_says_so_only_when_the_command_line_names_zero_bucket(tmp_path):
    import _hf_zero_autoload

    from hf_zero.integrations import OPTIM_NAME

    assert _hf_zero_autoload.OPTIM_NAME == OPTIM_NAME
    rc, named = _run([sys.executable, "-c", "pass", "--optim", "zero_bucket"], tmp_path, timeout=30, HF_ZERO_AUTOLOAD="off")
    assert rc == 0 and "HF_ZERO_AUTOLOAD=off has switched off hf_zero's start-up hook" in named, named
    rc, other = _run([sys.executable, "-c", "pass", "--optim", "adamw_torch"], tmp_path, timeout=30, HF_ZERO_AUTOLOAD="0")
    assert rc == 0 and "hf_zero" not in other, other
    rc, on = _run([sys.executable, "-c", "pass", "--optim", "zero_bucket"], tmp_path, timeout=30)
    assert rc == 0 and "hf_zero" not in on, on


def _wheel_files(wheel: Path) -> dict[str, bytes]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        return {name: z.read(name) for name in z.namelist()}


@pytest.mark.timeout(120)
def test_regular_and_editable_wheels_carry_the_pth_file(tmp_path):
    """Built from a copy of the sources, as pip builds them (PEP 517 / PEP 660 hooks)."""
    import base64
    import hashlib

    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "_hf_zero_autoload.py"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "hf_zero", src / "hf_zero", ignore=shutil.ignore_patterns("__pycache__"))
    # (build_meta rewrites sys.argv: read the output directory first)
    build = ("import sys; from setuptools import build_meta as b; out = sys.argv[1]; "
             "print('built', b.build_wheel(out)); print('built', b.build_editable(out))")
    rc, out = _run([sys.executable, "-c", build, str(tmp_path / "dist")], src, timeout=100)
    assert rc == 0, out[-4000:]
    regular, editable = (tmp_path / "dist" / line.split()[1] for line in out.splitlines() if line.startswith("built "))
    assert ".editable-" in editable.name
    for wheel in (regular, editable):
        files = _wheel_files(wheel)
        pth = files["hf_zero_autoload.pth"]
        assert pth == b"import _hf_zero_autoload; _hf_zero_autoload.start()\n"
        (record,) = [files[n].decode() for n in files if n.endswith(".dist-info/RECORD")]
        digest = base64.urlsafe_b64encode(hashlib.sha256(pth).digest()).rstrip(b"=").decode()
        assert f"hf_zero_autoload.pth,sha256={digest},{len(pth)}" in record.splitlines(), wheel.name
    assert "_hf_zero_autoload.py" in _wheel_files(regular)
    finder = [v for n, v in _wheel_files(editable).items() if n.endswith("_finder.py")]
    assert finder and b"'_hf_zero_autoload'" in finder[0]


# -- the start-up hook's failure handling --------------------------------------------------------
_FAILING_REGISTRATION = """
import sys, threading, time, types
import _hf_zero_autoload as hook

calls, inside, most = [], [0], [0]
fake = types.ModuleType("fake_target")
def optim_name():
    calls.append("optim_name")
def trainer():
    inside[0] += 1
    most[0] = max(most[0], inside[0])
    time.sleep(0.2)
    calls.append("trainer")
    inside[0] -= 1
    if calls.count("trainer") == 1:
        raise RuntimeError("boom")
def accelerator():
    calls.append("accelerator")
fake.optim_name, fake.trainer, fake.accelerator = optim_name, trainer, accelerator
sys.modules["fake_target"] = fake
hook.TARGET = "fake_target"
import transformers.trainer  # the registration fails: a warning (stderr under -W error), no error
print("after failure:", sorted(hook._pending))
threads = [threading.Thread(target=hook.install) for _ in range(3)]  # retried, concurrently
for t in threads:
    t.start()
for t in threads:
    t.join()
print("after retry:", sorted(hook._pending), calls.count("trainer"), "at most", most[0], "at once")
"""


@pytest.mark.reliability("Start-up hook: a registration that fails, under python -W error, retried from 3 threads",
                         "the import succeeds, the failure is reported and kept pending, one retry succeeds, never two at once")
@pytest.mark.timeout(120)
def test_failed_registration_never_breaks_the_import_and_is_retried(tmp_path):
    rc, out = _run([sys.executable, "-W", "error", "-c", _FAILING_REGISTRATION], tmp_path, timeout=100)
    assert rc == 0, out[-3000:]
    assert "hf_zero could not register with transformers.trainer (RuntimeError: boom)" in out
    lines = out.splitlines()
    assert "after failure: ['transformers.trainer']" in lines, out[-3000:]
    # accelerate.accelerator (watched by install) is already imported by transformers.trainer
    assert "after retry: [] 2 at most 1 at once" in lines, out[-3000:]


_ROLLBACK = """
import transformers.trainer
from transformers import TrainingArguments
from transformers.training_args import OptimizerNames
from hf_zero.integrations import _compat, transformers as hf_tr

def registered():
    return ("zero_bucket" in [m.value for m in OptimizerNames], _compat.optimizer_registered("zero_bucket"),
            hf_tr.ZeroBucketCallback in transformers.trainer.DEFAULT_CALLBACKS)

print("before", registered())
_compat.unregister_optimizer("zero_bucket")
_compat.remove_optimizer_name("zero_bucket")
transformers.trainer.DEFAULT_CALLBACKS.remove(hf_tr.ZeroBucketCallback)
print("removed", registered())
watch = _compat.watch_trainer
def broken(*args):
    raise RuntimeError("a changed Trainer")
_compat.watch_trainer = broken
try:
    hf_tr.register()
except RuntimeError as e:
    print("failed:", e)
print("rolled back", registered())
_compat.watch_trainer = watch
hf_tr.register()
print("again", registered(), TrainingArguments("out", use_cpu=True, optim="zero_bucket", report_to=[]).optim.value)
"""


@pytest.mark.reliability("Trainer registration failing half-way (after the optimizer name and handler)",
                         "rolled back: no zero_bucket name, handler or callback; a later registration succeeds")
@pytest.mark.timeout(120)
def test_partial_registration_is_rolled_back(tmp_path):
    rc, out = _run([sys.executable, "-c", _ROLLBACK], tmp_path, timeout=100)
    assert rc == 0, out[-3000:]
    lines = out.splitlines()
    assert lines[-5:] == ["before (True, True, True)", "removed (False, False, False)", "failed: a changed Trainer",
                          "rolled back (False, False, False)", "again (True, True, True) zero_bucket"], out[-3000:]
