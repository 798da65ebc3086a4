"""Two real `accelerate launch` processes (DDP over gloo on CPU), each with its own generation worker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_two_processes_train_whole_groups_with_bounded_staleness(tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "recipes/accelerate_configs/multi_cpu_2proc.yaml"),
        "--main_process_port", "29517",
        str(ROOT / "tests/scripts/ddp_train.py"), str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert [s["step"] for s in rank["seen"]] == [0, 1, 2]
        for s in rank["seen"]:
            assert s["prompts"] == 4  # one whole group of 4 completions per process per step
            assert all(0 <= s["step"] - v <= 1 for v in s["versions"])
    assert ranks[0]["weights"] == ranks[1]["weights"], "DDP keeps the replicas identical"
    logs = [h for h in ranks[0]["logs"] if "loss" in h]
    assert logs and all("off_policy/staleness_max" in h for h in logs)
