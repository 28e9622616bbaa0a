"""The documented evaluation and export commands end in one line and exit code 2 on bad input (the working paths
run in tests/test_train_e2e.py)."""

from reflow.bench.evaluate import main as evaluate_main
from reflow.export import main as export_main


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_evaluate_names_a_bad_hf_folder_in_one_line(tmp_path, capsys):
    assert evaluate_main(["--config", "train_configs/tiny.toml", "--hf", str(tmp_path / "nowhere")]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("reflow.bench.evaluate: --hf: Hugging Face checkpoint folder not found")
    (tmp_path / "empty").mkdir()
    assert evaluate_main(["--config", "train_configs/tiny.toml", "--hf", str(tmp_path / "empty")]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert "no .safetensors weights" in line


def test_export_without_a_checkpoint_says_where_it_looked(tmp_path, capsys):
    argv = ["--config", "train_configs/tiny.toml", f"--job.dump_folder={tmp_path}"]
    assert export_main(argv) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("reflow.export: checkpoint.folder: no complete checkpoint in") and str(tmp_path) in line
    assert export_main(["--config", "train_configs/tiny.toml", "--training.lr=abc"]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert "training.lr" in line
