"""A run keeps what produced it (run.json: resolved config, versions, command), a new run refuses a folder that
holds another run, and a resume refuses a config that changes what is trained unless told
(``reflow.run_record``). In process: nothing here starts a rank."""

import json
import os

import pytest

from reflow.config import ConfigError, ConfigManager
from reflow.run_record import RUN_FILE, changed_keys, check_dump_folder, write_record
from reflow.train import main
from tests.conftest import ROOT

TINY = os.path.join(ROOT, "train_configs", "tiny.toml")


def config(folder, *overrides):
    return ConfigManager().parse_args(["--config", TINY, f"--job.dump_folder={folder}", *overrides])


def test_a_new_run_records_its_config_and_versions(tmp_path):
    cfg = config(tmp_path / "run", "--training.lr=1e-4")
    assert check_dump_folder(cfg, resumes=False) is None  # a folder never used
    write_record(cfg, None, None)
    record = json.load(open(tmp_path / "run" / RUN_FILE))
    assert record["config"]["training"]["lr"] == 1e-4 and record["resumes"] == []
    assert "torch" in record["versions"] and record["started"]


def test_a_new_run_refuses_a_folder_that_holds_another_run(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"job.dump_folder: .*holds an earlier run \(a metrics.jsonl\)"):
        check_dump_folder(config(folder), resumes=False)
    write_record(config(folder), None, None)
    with pytest.raises(ConfigError, match=r"holds an earlier run \(run.json from "):
        check_dump_folder(config(folder), resumes=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarting the same run: its own folder
    check_dump_folder(config(folder), resumes=False)


def test_a_resume_refuses_a_changed_config_naming_the_keys_and_records_an_allowed_change(tmp_path):
    folder = tmp_path / "run"
    write_record(config(folder), None, None)
    # what to run and where may change: the steps, checkpoints, metrics, placement
    free = config(folder, "--training.steps=200", "--checkpoint.interval=7", "--metrics.log_freq=5",
                  "--placement.num_rollout_ranks=1", "--training.mode=sync")
    assert check_dump_folder(free, resumes=True) is not None
    changed = config(folder, "--training.lr=1e-4", "--training.mode=reflow", "--placement.num_rollout_ranks=1")
    with pytest.raises(ConfigError) as error:
        check_dump_folder(changed, resumes=True)
    (line,) = str(error.value).splitlines()
    assert "training.lr 0.0003 -> 0.0001" in line and "training.mode 'sync' -> 'reflow'" in line
    assert "job.allow_config_change" in line and "placement" not in line
    allowed = config(folder, "--training.lr=1e-4", "--job.allow_config_change=true")
    record = check_dump_folder(allowed, resumes=True)
    write_record(allowed, record, resumed_step=50)
    saved = json.load(open(folder / RUN_FILE))
    assert saved["resumes"][0]["from_step"] == 50
    assert saved["resumes"][0]["changed"] == [{"key": "training.lr", "from": 3e-4, "to": 1e-4}]
    assert saved["config"]["training"]["lr"] == 1e-4  # the next resume compares with the config now in force
    assert changed_keys(saved["config"], json.loads(json.dumps(saved["config"]))) == []


def test_check_refuses_a_used_folder_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["--check", "--config", TINY, f"--job.dump_folder={folder}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and "job.dump_folder" in lines[0] and "holds an earlier run" in lines[0]
