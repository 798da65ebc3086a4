"""Every recipe YAML parses into real configs and the quickstart notebook runs, so neither can rot; the demo runs end
to end (slow tier)."""

from pathlib import Path

import pytest
import yaml
from peft import LoraConfig

from trl_async import AsyncGRPOConfig

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").rglob("config_*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_builds_its_configs(path, tmp_path):
    text = path.read_text()
    assert "python -m trl_async" in text.split("\n\n")[0] or "accelerate launch" in text.split("\n\n")[0], (
        "the launch command goes at the top of every recipe"
    )
    recipe = yaml.safe_load(text)
    training = {**recipe["training"], "output_dir": str(tmp_path)}
    args = AsyncGRPOConfig(**training)
    assert args.max_staleness >= 0
    if "lora" in recipe:
        LoraConfig(**recipe["lora"])


def test_boxed_format_reward_pays_only_one_final_box():
    from trl_async.demo import boxed_format

    completions = [
        "3 + 4 = 7, so \\boxed{7}",
        "\\boxed{7}.",
        "\\boxed{7} \\boxed{7}",  # many boxes: the reward hack earlier probes saw
        "The answer is \\boxed{7} because ...",  # box not final
        "7",
        [{"role": "assistant", "content": "\\boxed{12}"}],
    ]
    assert boxed_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.slow
def test_demo_runs_and_writes_its_curve(tmp_path):
    from trl_async.demo import main

    main(["--max-steps", "2", "--output-dir", str(tmp_path)])
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    rows = (tmp_path / "rewards.csv").read_text().strip().splitlines()
    assert rows[0].startswith("step,") and len(rows) == 3


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    """The notebook's code cells, in order, for 2 steps instead of 40 (its learning setting is the one the slow tier's
    stale-data learning test checks), so the notebook cannot rot."""
    import json

    cells = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert code.count("max_steps=40") == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code.replace("max_steps=40", "max_steps=2"), "quickstart.ipynb", "exec"), namespace)
    logs = [h for h in namespace["trainer"].state.log_history if "reward" in h]
    assert len(logs) == 2 and all(0.0 <= h["reward"] <= 1.0 for h in logs)
    assert not namespace["model"].get_input_embeddings().weight.requires_grad
