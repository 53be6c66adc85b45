"""docs/benchmarks.md and the README's results table are what ``python -m benchmarks.render``
makes of benchmarks/results/*.json: a figure typed by hand, or a result replaced without
rendering again, fails here."""

import json

from benchmarks import render


def test_benchmarks_page_is_rendered_from_the_results():
    assert render.PAGE.read_text() == render.page(), "docs/benchmarks.md is stale: run python -m benchmarks.render"


def test_readme_results_table_is_rendered_from_the_results():
    text = render.README.read_text()
    assert render.README_BEGIN in text and render.README_END in text
    assert text == render.readme_with_table(text), "README.md's results table is stale: run python -m benchmarks.render"


def test_every_result_says_how_and_where_it_was_made():
    used = {stem for stems in render.RESULTS.values() for stem in stems}
    on_disk = {p.stem for p in render.RESULTS_DIR.glob("*.json")}
    assert used == on_disk, f"results no table reads: {sorted(on_disk - used)}; tables without a file: {sorted(used - on_disk)}"
    for stem in used:
        env = json.loads((render.RESULTS_DIR / f"{stem}.json").read_text())["env"]
        for key in ("command", "cpu", "cpu_count", "python", "torch", "transformers", "git"):
            assert env.get(key) not in (None, ""), f"{stem}.json: env[{key!r}] missing"


def test_a_changed_figure_changes_the_page(monkeypatch):
    real = render.load

    def load(stem):
        res = real(stem)
        if stem == "memory_raw_n2":
            res["memory"]["raw_stage2"]["above_baseline_per_rank"] = [1234 * render.MIB, 1 * render.MIB]
        return res

    monkeypatch.setattr(render, "load", load)
    assert "| hf_zero stage 2, fp32 | 1234 (" in render.page()
    assert "| 1234 MiB |" in render.readme_table()


def test_check_mode_reports_stale_files(tmp_path, monkeypatch, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text("typed by hand\n")
    monkeypatch.setattr(render, "PAGE", page)
    assert render.main(["--check"]) == 1
    assert "stale:" in capsys.readouterr().err
    assert page.read_text() == "typed by hand\n"


def test_readme_tables_say_what_they_measure_against_which_baseline():
    table = render.readme_table()
    memory, time = table.split("Iteration time under Trainer")
    # host memory of CPU runs, never to be read as GPU memory
    assert "Peak host memory (RSS) per rank of CPU processes, not GPU memory" in memory
    # the memory rows come from plain loops: their baseline is not Trainer's default
    assert "Trainer's default" not in memory and "| weights | DDP + AdamW |" in memory
    assert "| weights | `adamw_torch_fused` (Trainer's default) |" in time
    # the bf16 rows say why stage 1 can hold more than the baseline (it keeps fp32 moments and masters)
    assert "(bf16 moments, no masters)" in memory and "(fp32 moments and masters)" in memory
    assert "`master_weights=False` keeps bf16 moments" in memory
    # one short line on how it was made; the full commands (row ids and all) live on docs/benchmarks.md
    assert "--rows" not in table and "[docs/benchmarks.md](docs/benchmarks.md)" in table
    assert all(len(line) < 400 for line in table.splitlines())
