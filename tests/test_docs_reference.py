"""The reference pages against the code they describe, so that neither moves alone:

- docs/reference/optim_args.md: every key, value and default against Trainer's ``optim_args``
  parser (a key added to the parser without a row here fails, and a row without a key), and
  the Python signature against ``ZeroBucketOptimizer``'s;
- docs/reference/cli.md: every flag, choice and default against ``hf-zero <command> --help``,
  whose text names no private module and no Sphinx role;
- docs/planner.md: the schema string and the keys of the JSON report against ``hf-zero plan
  --json``, and every example output (``$ hf-zero plan ...`` in a text block) against the
  command's output now (``...`` stands for lines left out).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```", re.M | re.S)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = re.compile(r"^#{1,%d} " % heading.count("#", 0, heading.index(" ")), re.M).search(text, start + len(heading))
    return text[start : end.start() if end else len(text)]


def _rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in ``text``, as lists of cells."""
    lines = text.splitlines()
    separator = re.compile(r"^\|[-| ]+\|$")
    return [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line, after in zip(lines, lines[1:] + [""])
            if line.startswith("|") and not separator.match(line) and not separator.match(after)]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# -- optim_args ----------------------------------------------------------------------------------
OPTIM_ARGS = (DOCS / "reference" / "optim_args.md").read_text()


def _key_rows() -> dict[str, list[str]]:
    return {_ticked(r[0])[0]: r for r in _rows(_section(OPTIM_ARGS, "## hf_zero's keys"))}


def _inner_rows() -> dict[str, list[str]]:
    return {_ticked(r[0])[0]: r for r in _rows(_section(OPTIM_ARGS, "## The inner optimizer and its keys"))}


def test_every_optim_args_key_is_documented_and_every_documented_key_exists():
    from hf_zero.integrations import transformers as hf

    assert set(_key_rows()) == set(hf._COMMON_KEYS)
    inner = _inner_rows()
    assert set(inner) == set(hf._INNER)
    for name, row in inner.items():
        extras = _ticked(row[2])
        assert set(extras) == set(hf._INNER[name][3]), f"inner={name}: documented {extras}"
        for group, kind in re.findall(r"((?:`\w+`(?:, )?)+) \((numbers|booleans?)\)", row[2]):
            for key in _ticked(group):
                assert (key in hf._FLOAT_KEYS) == (kind == "numbers"), f"inner={name}: {key} is not {kind}"
    assert [n for n, r in inner.items() if "(default)" in r[0]] == [hf.DEFAULT_INNER]


def test_optim_args_values_are_the_parser_s():
    from hf_zero.integrations import transformers as hf

    choices = {"inner": set(hf._INNER), "stage": set(hf._STAGES), "grad_accum_dtype": set(hf._GRAD_ACCUM_DTYPES),
               "master_weights": set(hf._MASTER_WEIGHTS), "shard": set(hf._SHARDS),
               "grad_reduce": set(hf._GRAD_REDUCE)}
    for key, row in _key_rows().items():
        if key in choices:
            assert set(_ticked(row[1])) == choices[key], key
        else:
            assert row[1] == "boolean", key
            hf.parse_optim_args({key: "yes", **({"stage": "2"} if key == "local_accumulation" else {})})
    said = re.search(r"Booleans are (.*?)\. ", OPTIM_ARGS.replace("\n", " ")).group(1)
    assert set(_ticked(said)) == set(hf._BOOL)


def test_optim_args_defaults_are_the_parser_s():
    """Giving a key its documented default changes nothing the optimizer is built with."""
    from hf_zero import ZeroBucketOptimizer
    from hf_zero.integrations import transformers as hf

    built = {n: p.default for n, p in inspect.signature(ZeroBucketOptimizer).parameters.items()
             if p.default is not inspect.Parameter.empty}

    def effective(args: dict) -> dict:
        return {**built, **hf.parse_optim_args(args)}

    checked = []
    for key, row in _key_rows().items():
        if key == "sharded_checkpoints":  # decided by the callback from the world size, not by the parser
            assert hf.sharded_checkpoints_requested(type("Args", (), {"optim_args": None})()) is None
            continue
        default = _ticked(row[2])[0]
        base = {"stage": "2"} if "stage 2 only" in row[3] else {}
        assert effective({**base, key: default}) == effective(base), f"{key}: documented default {default!r}"
        checked.append(key)
    assert len(checked) >= 8


def test_python_signature_is_the_constructor_s():
    from hf_zero import ZeroBucketOptimizer

    block = _FENCE.search(_section(OPTIM_ARGS, "## The same options in Python")).group("code")
    shown = " ".join(block.split())
    parts = []
    for p in inspect.signature(ZeroBucketOptimizer).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}".replace("'", '"'))
    assert shown == f"ZeroBucketOptimizer({', '.join(parts)})"


# -- the CLI -------------------------------------------------------------------------------------
CLI = (DOCS / "reference" / "cli.md").read_text()


def _subparsers() -> dict:
    import argparse

    from hf_zero.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["plan", "consolidate", "inspect"])
def test_cli_page_lists_every_flag_choice_and_default(command):
    parser = _subparsers()[command]
    rows = {_ticked(r[0])[0].split()[0]: r for r in _rows(_section(CLI, f"## `hf-zero {command}`"))}
    actions = [a for a in parser._actions if a.dest != "help"]
    names = {(a.option_strings[-1] if a.option_strings else a.dest) for a in actions}
    if command == "inspect":  # one positional, described in prose
        assert names == {"checkpoint"} and "`CHECKPOINT`" in _section(CLI, "## `hf-zero inspect`")
        return
    assert set(rows) == names, f"hf-zero {command}: page {sorted(rows)}, --help {sorted(names)}"
    for a in actions:
        row = " | ".join(rows[a.option_strings[-1] if a.option_strings else a.dest])
        for choice in a.choices or ():
            assert f"`{choice}`" in row, f"{a.option_strings}: choice {choice!r} not on the page"
        if a.default not in (None, False):
            assert f"`{a.default}` (default" in row, f"{a.option_strings}: default {a.default!r} not on the page"


@pytest.mark.parametrize("command", ["plan", "consolidate", "inspect"])
def test_cli_help_is_for_users(command):
    text = _subparsers()[command].format_help()
    assert not re.search(r":(class|func|mod|meth|data):|``|hf_zero\._|_[a-z]+\.py\b", text), text


# -- the planner -----------------------------------------------------------------------------------
PLANNER = (DOCS / "planner.md").read_text()


def _plan(argv: list[str], cwd: Path | None = None) -> str:
    import os

    from hf_zero.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(old)
    return (out.getvalue() + err.getvalue()).rstrip("\n") if code in (0, 2) else f"exit {code}"


def test_schema_named_in_the_docs_is_the_planner_s():
    from hf_zero._planner import SCHEMA

    named = {m for p in [ROOT / "README.md", *DOCS.rglob("*.md")] for m in re.findall(r"hf_zero\.plan/\d+", p.read_text())}
    assert named == {SCHEMA}
    assert f"## JSON report (`--json`), schema `{SCHEMA}`" in PLANNER


def test_schema_block_names_every_key_of_the_report():
    block = _FENCE.search(_section(PLANNER, "## JSON report")).group("code")
    keys: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                keys.add(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for argv in (["--model", "gpt2", "--world-size", "2"],
                 ["--model", "gpt2", "--world-size", "2", "--dtype", "bfloat16", "--stage", "2", "--device-memory",
                  "16GiB", "--activation-memory", "1GiB"]):
        walk(json.loads(_plan(["plan", *argv, "--json"])))
    quoted = set(re.findall(r'"(\w+)"', block))
    assert keys <= quoted, f"report keys missing from the schema block: {sorted(keys - quoted)}"
    declared = set(re.findall(r'"(\w+)":', block))
    assert declared <= keys, f"schema block keys the report does not have: {sorted(declared - keys)}"


# all-MiniLM-L6-v2's config as sentence-transformers publishes it (the folder planner.md plans)
_MINILM = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6,
           "num_attention_heads": 12, "intermediate_size": 1536, "vocab_size": 30522, "max_position_embeddings": 512,
           "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12}


def _examples() -> list[tuple[str, list[str]]]:
    out = []
    for m in _FENCE.finditer(PLANNER):
        if m.group("lang") != "text":
            continue
        command, shown = None, []
        for line in m.group("code").splitlines():
            if line.startswith("$ "):
                if command:
                    out.append((command, shown))
                command, shown = line[2:], []
            elif command:
                shown.append(line)
        if command:
            out.append((command, shown))
    return out


@pytest.mark.parametrize("command,shown", _examples(), ids=[c for c, _ in _examples()])
def test_planner_examples_are_what_the_cli_prints(command, shown, tmp_path):
    (tmp_path / "MiniLM-L6-v2").mkdir()
    (tmp_path / "MiniLM-L6-v2" / "config.json").write_text(json.dumps(_MINILM))
    words = shlex.split(command)
    assert words[:2] == ["hf-zero", "plan"]
    actual = [line.rstrip() for line in _plan(words[1:], cwd=tmp_path).splitlines()]
    chunks, chunk = [], []
    for line in shown:
        if line == "...":
            chunks.append(chunk)
            chunk = []
        else:
            chunk.append(line.rstrip())
    chunks.append(chunk)
    at = 0
    for chunk in chunks:
        found = next((i for i in range(at, len(actual) - len(chunk) + 1) if actual[i : i + len(chunk)] == chunk), None)
        assert found is not None, (f"docs/planner.md: `{command}` now prints (paste it over the example):\n"
                                   + "\n".join(actual))
        at = found + len(chunk)
    assert shown[-1] == "..." or at == len(actual), "the example leaves out the end: end it with ..."
    assert shown[0] == "..." or chunks[0] == actual[: len(chunks[0])], "the example leaves out the start"
