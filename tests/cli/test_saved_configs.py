"""Configs saved before the regrouping of the code (issue 29) still load and re-run. `tests/support/saved_configs/`
holds the `config.yaml` that Relax at commit 1c2c0fc (the last before the move) wrote for each example, and the
quickstart with DAPO's built-in filter: every setting loads as it did, the built-in plugins they name by their old
module paths (`relax.engine...`) load from where they live now, and the quickstart's re-runs."""

from __future__ import annotations

import logging

import pytest
import yaml

from relax.cli.args import parse_config
from relax.core.rollout_parts import build_dynamic_sampling, load_generate_function
from relax.rollout.agentic.env import load_env_builder
from relax.telemetry.metrics_file import read_metrics
from relax.utils.dotted_path import current_module_name
from tests.support.runs import ROOT, run_relax

SAVED = ROOT / "tests" / "support" / "saved_configs"
CONFIGS = sorted(SAVED.glob("*.yaml"))


# The examples with a config.yaml at commit 1c2c0fc; those added after the move (multi_agent_relay, search_r1, ...)
# could not be saved before it, and their own tests load their configs (tests/examples/).
EXAMPLES_BEFORE_THE_MOVE = {"agentic_calculator", "agentic_zoom", "quickstart", "shapes", "tones", "video"}


def test_there_is_a_saved_config_of_every_example_from_before_the_move():
    examples = {path.parent.name for path in (ROOT / "examples").rglob("config.yaml")}
    assert EXAMPLES_BEFORE_THE_MOVE <= examples  # none of them was removed or renamed
    assert EXAMPLES_BEFORE_THE_MOVE <= {path.stem for path in CONFIGS}


@pytest.mark.parametrize("saved", CONFIGS, ids=lambda path: path.stem)
def test_a_config_saved_before_the_move_loads_with_every_setting(saved, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)
    cfg = parse_config(["--config", str(saved), "--output-dir", str(tmp_path / "run")])
    written = yaml.safe_load(saved.read_text())
    for name, value in written.items():
        if name != "output_dir":
            assert getattr(cfg, name) == value or (isinstance(value, list) and list(getattr(cfg, name)) == value), name
    with caplog.at_level(logging.WARNING, logger="relax"):
        if cfg.rollout_interaction_env_path and cfg.rollout_interaction_env_path.startswith("relax."):
            assert callable(load_env_builder(cfg.rollout_interaction_env_path))
            assert load_generate_function(cfg) is not None
        build_dynamic_sampling(cfg)
    moved = [record.getMessage() for record in caplog.records if "is now relax." in record.getMessage()]
    old_paths = [value for value in written.values() if isinstance(value, str) and value.startswith("relax.engine")]
    assert len(moved) >= len(old_paths)  # each old path loaded from its new home, and said so


def test_old_module_paths_map_to_their_new_homes():
    assert current_module_name("relax.engine.agentic.tool_env") == "relax.rollout.agentic.tool_env"
    assert current_module_name("relax.engine.filters.dynamic_sampling") == "relax.rollout.filters.dynamic_sampling"
    assert current_module_name("relax.engine.rollout.generate") == "relax.rollout.generation.generate"
    assert current_module_name("relax.engineering") == "relax.engineering"  # a prefix of a name, not a module
    assert current_module_name("examples.agentic_zoom.env_zoom") == "examples.agentic_zoom.env_zoom"


def test_the_quickstart_saved_with_dapos_filter_before_the_move_reruns(tmp_path):
    run_dir = tmp_path / "run"
    result = run_relax("train", "--config", str(SAVED / "quickstart_dapo.yaml"), "--output-dir", str(run_dir),
                       "--num-rollout", "2", "--skip-eval-before-train", "--eval-interval", "1000",
                       "--no-use-tensorboard", "--save-interval", "1000", "--dump-samples", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert "relax.engine.filters.dynamic_sampling is now relax.rollout.filters.dynamic_sampling" in \
        (run_dir / "run.log").read_text()
