"""The bad-input battery: every kind of bad input is one line on stderr naming the file and the key (or field),
and exit code 2, before any rank starts. Run through ``reflow.train.main`` as torchrun's ranks and the
launchers' ``--check`` run it (in process: nothing here starts a rank), and once through the shipped launcher."""

import json
import os
import subprocess
import sys

import pytest

from reflow.train import main
from tests.conftest import ROOT

TINY = os.path.join(ROOT, "train_configs", "tiny.toml")
HF = os.path.join(ROOT, "assets", "tiny-qwen3")


def check(capsys, monkeypatch, argv: list[str], world: int = 2) -> tuple[int, list[str]]:
    """``--check`` with torchrun's WORLD_SIZE: the exit code and the lines printed on stderr."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    code = main(["--check", *argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip() and "WARNING" not in line]


def one_error(capsys, monkeypatch, argv, *expected: str, world: int = 2) -> str:
    code, lines = check(capsys, monkeypatch, argv, world)
    assert code == 2, lines
    assert len(lines) == 1, lines
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def config_file(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def data_file(tmp_path, content: bytes, name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def test_good_input_passes_and_names_the_placement(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--check", "--config", TINY, f"--job.dump_folder={tmp_path}/run"]) == 0
    assert "OK for 2 ranks" in capsys.readouterr().out


# ---------------------------------------------------------------- the config


def test_malformed_toml(tmp_path, capsys, monkeypatch):
    path = config_file(tmp_path, "[training\nlr = 1\n")
    one_error(capsys, monkeypatch, ["--config", path], path, "invalid TOML")


def test_unknown_key_in_the_file_and_on_the_command_line(tmp_path, capsys, monkeypatch):
    path = config_file(tmp_path, "[training]\nlearning_rate = 1e-4\n")
    one_error(capsys, monkeypatch, ["--config", path], path, "training.learning_rate")
    one_error(capsys, monkeypatch, ["--config", TINY, "--rollout.temprature=0.5"], "command line", "rollout.temprature")
    one_error(capsys, monkeypatch, ["--config", TINY, "--nosuch.key=1"], "command line", "[nosuch]")


def test_wrong_types_including_list_elements(tmp_path, capsys, monkeypatch):
    path = config_file(tmp_path, '[training]\nlr = "fast"\n')
    one_error(capsys, monkeypatch, ["--config", path], path, "training.lr", "expected a number")
    one_error(capsys, monkeypatch, ["--config", TINY, '--training.betas=["a",1]'], "training.betas'[0]", "expected a number")
    one_error(capsys, monkeypatch, ["--config", TINY, "--training.betas=0.9"], "training.betas", "expected a list")
    one_error(capsys, monkeypatch, ["--config", TINY, "--training.steps=ten"], "training.steps", "expected int")
    path = config_file(tmp_path, "[placement]\nschedule = [10]\n")
    one_error(capsys, monkeypatch, ["--config", path], path, "placement.schedule'[0]", "expected a string")


def test_overrides_with_hyphens_mean_the_same_key(tmp_path, capsys, monkeypatch):
    from reflow.config import ConfigManager

    manager = ConfigManager()
    cfg = manager.parse_args(["--config", TINY, "--training.max-norm=0.5", "--rollout.max-new-tokens", "12"])
    assert cfg.training.max_norm == 0.5 and cfg.rollout.max_new_tokens == 12
    assert manager.where("training.max_norm") == "command line"
    code, _ = check(capsys, monkeypatch, ["--config", TINY, "--training.max-norm=0.5", f"--job.dump_folder={tmp_path}/run"])
    assert code == 0


def test_impossible_placements(capsys, monkeypatch):
    one_error(capsys, monkeypatch, ["--config", TINY, "--placement.num_rollout_ranks=2"], "placement", world=2)
    one_error(capsys, monkeypatch, ["--config", TINY, "--placement.trainer_replicate_degree=3"], "placement", world=2)


# ---------------------------------------------------------------- the data


@pytest.mark.parametrize(
    "content,expected",
    [
        (b"", "task data file is empty"),
        (b'{"id": 1, "prompt": "1+1=", "answer": "2"}\n{"id": 2, "answer": "3"}\n', ":2: row has no prompt"),
        (b'{"id": 1, "prompt": "", "answer": "2"}\n', ":1: row has no prompt"),
        (b'{"id": 1, "prompt": "1+1="}\n', ":1: row has no 'answer' field"),
        (b'{"id": 1, "prompt": "1+\xff=", "answer": "2"}\n', ":1: not UTF-8"),
        (b'{"id": 1, "prompt": "1+1=", "answer": "2"\n', ":1: not a JSON object"),
        (b'[1, 2]\n', ":1: expected a JSON object"),
    ],
    ids=["empty", "no-prompt", "empty-prompt", "no-answer", "not-utf8", "broken-json", "not-an-object"],
)
def test_bad_data_files_name_the_key_file_and_line(tmp_path, capsys, monkeypatch, content, expected):
    path = data_file(tmp_path, content)
    one_error(capsys, monkeypatch, ["--config", TINY, f"--task.train_file={path}"], "task.train_file", path, expected)


def test_missing_data_file_names_the_config_file_it_came_from(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "nowhere.jsonl")
    path = config_file(tmp_path, open(TINY).read().replace("assets/data/chain_sum_eval.jsonl", missing))
    one_error(capsys, monkeypatch, ["--config", path], path, "task.eval_file", "not found", missing)


# ---------------------------------------------------------------- the model folder and the checkpoint


@pytest.mark.parametrize("drop,expected", [("model.safetensors", "no .safetensors weights"), ("tokenizer", "no tokenizer")])
def test_hf_folder_without_weights_or_tokenizer(tmp_path, capsys, monkeypatch, drop, expected):
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in os.listdir(HF):
        if name == drop or (drop == "tokenizer" and name.startswith("tokenizer")):
            continue
        os.symlink(os.path.join(HF, name), folder / name)
    one_error(capsys, monkeypatch, ["--config", TINY, f"--model.hf_checkpoint={folder}"], "model.hf_checkpoint", expected)


def test_missing_checkpoint_step(tmp_path, capsys, monkeypatch):
    one_error(
        capsys, monkeypatch,
        ["--config", TINY, "--checkpoint.enable=true", "--checkpoint.load_step=5", f"--job.dump_folder={tmp_path}"],
        "checkpoint.load_step = 5", "no complete checkpoint",
    )


def test_corrupt_checkpoint(tmp_path, capsys, monkeypatch):
    step = tmp_path / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"\x00not a pickle")
    one_error(
        capsys, monkeypatch, ["--config", TINY, "--checkpoint.enable=true", f"--job.dump_folder={tmp_path}"],
        "checkpoint", str(step), "unreadable",
    )


# ---------------------------------------------------------------- through the launcher


def test_the_launcher_stops_bad_input_before_torchrun_starts(tmp_path):
    env = dict(os.environ, NPROC="2", CONFIG=TINY, PYTHON=sys.executable)
    run = subprocess.run(
        ["bash", os.path.join(ROOT, "torchrun_scripts", "run_train.sh"), f"--task.train_file={tmp_path / 'gone.jsonl'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and "task.train_file" in lines[0] and "gone.jsonl" in lines[0], run.stderr
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr


def test_row_ids_default_to_file_and_line(tmp_path):
    from reflow.tasks import load_problems

    path = data_file(tmp_path, json.dumps({"prompt": "1+1=", "answer": "2"}).encode() + b"\n")
    assert load_problems(path)[0].uid == "data.jsonl:1"


def test_check_without_torchrun_takes_the_world_the_placement_plans(tmp_path, capsys, monkeypatch):
    """On a login node (no WORLD_SIZE) ``--check`` of a multi-rank config checks the placement it plans, as
    ``--dry-run`` does, instead of refusing it for a world of 1."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    elastic = os.path.join(ROOT, "train_configs", "tiny_elastic.toml")
    assert main(["--check", "--config", elastic, f"--job.dump_folder={tmp_path}/run"]) == 0
    assert "OK for 4 ranks" in capsys.readouterr().out


# ---------------------------------------------------------------- agent tasks

AGENT = os.path.join(ROOT, "train_configs", "tiny_agent.toml")


def test_the_agent_config_passes(tmp_path, capsys, monkeypatch):
    code, lines = check(capsys, monkeypatch, ["--config", AGENT, f"--job.dump_folder={tmp_path}/run"])
    assert code == 0, lines


@pytest.mark.parametrize(
    "override,expected",
    [
        ("--task.agent=", "must name the agent as 'module:function'"),
        ("--task.agent=no_colon", "write it as 'module:function'"),
        ("--task.agent=reflow.no_such_module:solve", "cannot import 'reflow.no_such_module'"),
        ("--task.agent=reflow.examples.calculator_agent:nothing", "has no 'nothing'"),
        ("--task.agent=reflow.examples.calculator_agent:calculator", "must be an async function"),
    ],
    ids=["empty", "no-colon", "no-module", "no-function", "not-async"],
)
def test_a_bad_agent_is_named_before_ranks_start(tmp_path, capsys, monkeypatch, override, expected):
    one_error(capsys, monkeypatch, ["--config", AGENT, override, f"--job.dump_folder={tmp_path}/run"], "task.agent",
              expected)


def test_an_agent_with_a_built_in_task_or_a_moving_placement(tmp_path, capsys, monkeypatch):
    one_error(capsys, monkeypatch, ["--config", AGENT, "--task.name=chain_sum_calculator",
                                    f"--job.dump_folder={tmp_path}/run"], "'task.agent'", "task.name = 'agent' only")
    one_error(capsys, monkeypatch, ["--config", AGENT, "--scheduler.adaptive_placement=true",
                                    f"--job.dump_folder={tmp_path}/run"], "'task.name'", "fixed placement")


@pytest.mark.parametrize("override,expected", [
    ("--lora.rank=-1", ("lora.rank", ">= 0")),
    ("--lora.alpha=0", ("lora.alpha", "> 0")),
    ("--lora.dropout=1.0", ("lora.dropout",)),
    ('--lora.target_modules=["q_proj", "qkv"]', ("lora.target_modules", "'qkv'", "q_proj")),
    ("--lora.target_modules=[]", ("lora.target_modules", "empty")),
], ids=["rank", "alpha", "dropout", "unknown-target", "no-target"])
def test_bad_lora_settings_are_one_line_naming_the_key(capsys, monkeypatch, override, expected):
    one_error(capsys, monkeypatch, ["--config", TINY, "--lora.rank=8", override], *expected)


def test_lora_on_tied_embeddings_trains_both_or_neither(tmp_path, capsys, monkeypatch):
    one_error(capsys, monkeypatch, ["--config", os.path.join(ROOT, "train_configs", "qwen3_4b.toml"), "--lora.rank=8",
                                    "--lora.train_head=true"], "lora.train_head", "ties", world=8)


def _adapter_folder(tmp_path, rank: int = 8, alpha: float = 16.0, targets=("q_proj", "v_proj"), width: int = 128) -> str:
    """A peft folder for the tiny model (q_proj and v_proj of its 4 layers), or of another width."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / f"adapter-r{rank}-w{width}"
    folder.mkdir()
    tensors = {}
    for layer in range(4):
        for name, out in (("q_proj", 128), ("v_proj", 64)):
            module = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{module}.lora_A.weight"] = torch.zeros(rank, width)
            tensors[f"{module}.lora_B.weight"] = torch.zeros(out, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                            "target_modules": list(targets)}))
    return str(folder)


LORA_ON = ["--lora.rank=8", "--lora.alpha=16", '--lora.target_modules=["q_proj", "v_proj"]']


def test_a_matching_adapter_folder_passes(tmp_path, capsys, monkeypatch):
    code, lines = check(capsys, monkeypatch, ["--config", TINY, *LORA_ON, f"--lora.adapter={_adapter_folder(tmp_path)}"])
    assert code == 0, lines


@pytest.mark.parametrize("folder_args,expected", [
    ({"rank": 4}, ("lora.adapter", "r = 4")),
    ({"alpha": 32.0}, ("lora.adapter", "lora_alpha")),
    ({"targets": ("q_proj",)}, ("lora.adapter", "adapts")),
    ({"width": 256}, ("lora.adapter", "shape", "another base model")),
], ids=["rank", "alpha", "targets", "another-model"])
def test_an_adapter_folder_that_does_not_match_is_one_line(tmp_path, capsys, monkeypatch, folder_args, expected):
    folder = _adapter_folder(tmp_path, **folder_args)
    one_error(capsys, monkeypatch, ["--config", TINY, *LORA_ON, f"--lora.adapter={folder}"], *expected)


def test_an_adapter_folder_that_is_not_one_is_one_line(tmp_path, capsys, monkeypatch):
    one_error(capsys, monkeypatch, ["--config", TINY, *LORA_ON, f"--lora.adapter={tmp_path}"], "lora.adapter",
              "not a peft adapter folder")
    one_error(capsys, monkeypatch, ["--config", TINY, f"--lora.adapter={tmp_path}"], "lora.adapter", "lora.rank")

