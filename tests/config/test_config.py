"""Config loading, overrides and the errors a user sees."""

import glob
import os

import pytest

from reflow.config import ConfigError, ConfigManager
from reflow.config.validate import parse_schedule, validate, validate_world
from tests.conftest import ROOT


def write(tmp_path, text: str) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_toml_and_override(tmp_path):
    path = write(tmp_path, "[training]\nlr = 3e-4\nsteps = 7\n[rollout]\ntemperature = 0.7\n")
    m = ConfigManager()
    cfg = m.parse_args(["--config", path, "--training.steps=9", "--rollout.max_new_tokens", "12"])
    assert cfg.training.lr == 3e-4
    assert cfg.training.steps == 9
    assert cfg.rollout.max_new_tokens == 12
    assert cfg.rollout.temperature == 0.7
    assert m.where("training.steps") == "command line"
    assert m.where("training.lr") == path


def test_int_promotes_to_float(tmp_path):
    cfg = ConfigManager().parse_args(["--config", write(tmp_path, "[training]\nlr = 1\n")])
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "[training]\nlearning_rate = 1e-4\n")
    with pytest.raises(ConfigError) as e:
        ConfigManager().parse_args(["--config", path])
    assert "training.learning_rate" in str(e.value) and path in str(e.value)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[optimizer\]"):
        ConfigManager().parse_args(["--config", write(tmp_path, "[optimizer]\nlr = 1\n")])


def test_wrong_type_names_key(tmp_path):
    path = write(tmp_path, '[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"'training.steps'.*integer"):
        ConfigManager().parse_args(["--config", path])
    with pytest.raises(ConfigError, match=r"command line.*'training.steps'"):
        ConfigManager().parse_args(["--training.steps=1.5"])
    with pytest.raises(ConfigError, match=r"'metrics.enable_tensorboard'.*boolean"):
        ConfigManager().parse_args(["--metrics.enable_tensorboard=maybe"])


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid TOML"):
        ConfigManager().parse_args(["--config", write(tmp_path, "[training\n")])
    with pytest.raises(ConfigError, match="not found"):
        ConfigManager().parse_args(["--config", str(tmp_path / "nope.toml")])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="cannot parse"):
        ConfigManager().parse_args(["lr=3"])


def test_validate_ranges_name_source(tmp_path):
    path = write(tmp_path, "[training]\ngroup_size = 0\n")
    m = ConfigManager()
    cfg = m.parse_args(["--config", path])
    with pytest.raises(ConfigError) as e:
        validate(cfg, m.where)
    assert "training.group_size" in str(e.value) and path in str(e.value)


def test_sync_mode_needs_interval_one():
    m = ConfigManager()
    cfg = m.parse_args(["--weight_sync.interval=2"])
    with pytest.raises(ConfigError, match="weight_sync.interval"):
        validate(cfg, m.where)


def test_a_kv_cache_too_small_for_one_request_of_max_model_len():
    """vLLM keeps one of num_kv_blocks back and refuses, on every rank at start-up, a cache that cannot hold one
    request of max_model_len tokens: one config error before ranks start instead."""
    m = ConfigManager()
    args = ["--rollout.kv_block_size=32", "--rollout.max_model_len=256"]
    with pytest.raises(ConfigError, match=r"'rollout.num_kv_blocks' = 6 blocks .* hold 160 tokens.*use at least 9 blocks"):
        validate(m.parse_args([*args, "--rollout.num_kv_blocks=6"]), m.where)
    with pytest.raises(ConfigError, match="rollout.num_kv_blocks"):
        validate(m.parse_args([*args, "--rollout.num_kv_blocks=8"]), m.where)  # 224 tokens
    validate(m.parse_args([*args, "--rollout.num_kv_blocks=9"]), m.where)  # 256: exactly one request
    validate(m.parse_args(["--config", "train_configs/bench_rollout_bound.toml"]), m.where)  # 7 blocks, 192: one request


def test_a_micro_batch_token_budget_below_the_longest_row():
    m = ConfigManager()
    cfg = m.parse_args(["--training.micro_batch_tokens=100", "--rollout.max_model_len=256"])
    with pytest.raises(ConfigError, match="'training.micro_batch_tokens' = 100 is below rollout.max_model_len"):
        validate(cfg, m.where)
    validate(m.parse_args(["--training.micro_batch_tokens=256", "--rollout.max_model_len=256"]), m.where)
    validate(m.parse_args(["--training.micro_batch_tokens=0"]), m.where)  # off: micro_batch_size rows a pass


def test_unknown_mode():
    m = ConfigManager()
    cfg = m.parse_args(["--training.mode=fast"])
    with pytest.raises(ConfigError, match="training.mode"):
        validate(cfg, m.where)


def test_world_size_mismatch():
    m = ConfigManager()
    cfg = m.parse_args(["--placement.trainer_shard_degree=2", "--placement.trainer_replicate_degree=2"])
    with pytest.raises(ConfigError, match="does not match the world size"):
        validate_world(cfg, 3, m.where)
    assert validate_world(cfg, 4, m.where).num_trainer_ranks == 4


def test_prompts_divisible_by_world():
    m = ConfigManager()
    cfg = m.parse_args(["--training.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="training.prompts_per_step"):
        validate_world(cfg, 2, m.where)


def test_help_lists_field_docs(capsys):
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--loss.clip_low" in out and "the ratio is clipped" in out


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "train_configs", "*.toml"))))
def test_every_shipped_config_parses_and_validates(path):
    m = ConfigManager()
    cfg = m.parse_args(["--config", path])
    validate(cfg, m.where)


@pytest.mark.parametrize(
    "override, key",
    [
        ("--training.group_size=1", "training.group_size"),
        ("--rollout.top_p=0.9", "rollout.top_p"),
        ("--checkpoint.load_step=5", "checkpoint.load_step"),
        ("--rollout.temperature=0", "rollout.temperature"),
    ],
)
def test_combinations_rejected(override, key):
    m = ConfigManager()
    cfg = m.parse_args([override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, m.where)


def test_sync_mode_rejects_rollout_only_ranks():
    m = ConfigManager()
    cfg = m.parse_args(["--placement.num_rollout_ranks=1"])
    with pytest.raises(ConfigError, match="num_rollout_ranks"):
        validate_world(cfg, 3, m.where)


def test_decoupled_delta_must_cover_the_sync_interval():
    m = ConfigManager()
    cfg = m.parse_args(["--training.mode=reflow", "--placement.num_rollout_ranks=1", "--replay.delta=1",
                        "--weight_sync.interval=2"])
    validate(cfg, m.where)
    with pytest.raises(ConfigError, match="replay.delta"):
        validate_world(cfg, 2, m.where)


def test_decoupled_needs_rollout_ranks():
    m = ConfigManager()
    cfg = m.parse_args(["--training.mode=async"])
    with pytest.raises(ConfigError, match="num_rollout_ranks"):
        validate_world(cfg, 2, m.where)


@pytest.mark.parametrize(
    "overrides, world, key, words",
    [
        # b_max is reflow's per-step rule; the baselines bound the work ahead instead
        (["--training.mode=async", "--rollout.b_max=512"], 2, "rollout.b_max", "'reflow' mode only"),
        (["--training.mode=reflow", "--rollout.b_max=100"], 2, "rollout.b_max", "multiple of"),
        (["--training.mode=reflow", "--rollout.b_max=128"], 2, "rollout.b_max", ">= the batch"),
        # each of 2 trainer shards trains whole groups
        (["--training.mode=reflow", "--training.prompts_per_step=3"], 3, "training.prompts_per_step", "multiple of the 2"),
        # rollout ranks admit whole groups
        (["--training.mode=async", "--rollout.max_num_seqs=4"], 2, "rollout.max_num_seqs", ">= training.group_size = 8"),
        # one_step_off: an engine admits its share of two batches at once (2 x 32 x 8 = 512 samples)
        (["--training.mode=one_step_off", "--rollout.max_num_seqs=256"], 2, "rollout.max_num_seqs", ">= 512"),
        # 2 prompts per step make a window of 4 groups: 5 rollout ranks could not all generate
        (
            ["--training.mode=async", "--training.prompts_per_step=2", "--placement.num_rollout_ranks=5",
             "--replay.delta=1"],
            6, "placement.num_rollout_ranks", "(4 groups): some engines would never generate",
        ),
    ],
)
def test_decoupled_dispatch_rule_rejections(overrides, world, key, words):
    m = ConfigManager()
    cfg = m.parse_args(["--placement.num_rollout_ranks=1", *overrides])
    validate(cfg, m.where)
    with pytest.raises(ConfigError) as err:
        validate_world(cfg, world, m.where)
    assert f"'{key}'" in str(err.value)
    assert words in str(err.value)


def test_decoupled_dispatch_rules_resolved_per_mode():
    from reflow.config.mode_settings import resolve_settings

    m = ConfigManager()
    base = ["--placement.num_rollout_ranks=1", "--training.prompts_per_step=4", "--training.group_size=4"]
    one = resolve_settings(m.parse_args([*base, "--training.mode=one_step_off", "--weight_sync.interval=3"]))
    assert (one.delta, one.interval, one.min_staleness, one.dispatch.window, one.dispatch.per_step) == (1, 1, 1, 32, 0)
    asy = resolve_settings(m.parse_args([*base, "--training.mode=async", "--replay.delta=3", "--weight_sync.interval=2"]))
    assert (asy.steps_ahead, asy.dispatch.window, asy.dispatch.per_step) == (2, 48, 0)  # delta - k + 1 = 2
    assert (asy.anchor, asy.max_head_lag) == ("finish", 6)  # from the finish; tokens within 2 x delta train
    ref = resolve_settings(m.parse_args([*base, "--training.mode=reflow"]))
    # delta 2, k 1: async's window, 3 batches; B_max defaults to the batch
    assert (ref.dispatch.window, ref.dispatch.per_step) == (48, 16)
    strict = resolve_settings(m.parse_args([*base, "--training.mode=reflow", "--replay.strict_window=true"]))
    # the strict window: 2 batches ahead plus the 12 fresh samples (sigma 0.25) a step retires at the least, in
    # whole groups of 4
    assert (strict.dispatch.window, strict.dispatch.per_step) == (44, 16)
    assert (one.anchor, one.max_head_lag) == ("start", None)  # one_step_off: exactly one version from the start
    ref = resolve_settings(m.parse_args([*base, "--training.mode=reflow", "--replay.staleness_from=start",
                                         "--replay.max_head_lag=5"]))
    assert (ref.anchor, ref.max_head_lag) == ("start", 5)


@pytest.mark.parametrize("flag,words", [
    ("--replay.staleness_from=middle", "must be 'finish' or 'start'"),
    ("--replay.max_head_lag=1", "must be 0 (2 x delta) or >= replay.delta = 2"),
    ("--replay.max_head_lag=-1", "must be 0 (2 x delta)"),
])
def test_replay_anchor_and_head_lag_errors_name_the_key(flag, words):
    from reflow.config.validate import validate

    m = ConfigManager()
    cfg = m.parse_args(["--training.mode=reflow", "--placement.num_rollout_ranks=1", flag])
    with pytest.raises(ConfigError) as err:
        validate(cfg, m.where)
    assert f"'{flag[2:].split('=')[0]}'" in str(err.value) and words in str(err.value)
    assert "command line" in str(err.value)


def test_keys_the_mode_does_not_read_are_reported_not_rewritten():
    from reflow.config.validate import mode_warnings

    m = ConfigManager()
    cfg = m.parse_args(["--training.mode=one_step_off", "--replay.delta=3", "--weight_sync.interval=2"])
    said = mode_warnings(cfg, m.where)
    assert any("'replay.delta' is not used in 'one_step_off'" in w for w in said)
    assert any("'weight_sync.interval' is not used in 'one_step_off'" in w for w in said)
    assert cfg.replay.delta == 3 and cfg.weight_sync.interval == 2
    assert mode_warnings(m.parse_args(["--training.mode=reflow", "--replay.sigma=0.5"]), m.where) == []


@pytest.mark.parametrize(
    "schedule, words",
    [
        ('["4:0"]', "leave no rollout rank or no trainer"),  # an empty trainer pool
        ('["4:4"]', "leave no rollout rank or no trainer"),  # an empty rollout pool
        ('["3:1"]', "not a weight-sync step"),
        ('["4:2"]', "already has 2 replicas"),
        ('["8:1", "4:2"]', "steps must increase"),
        ('["4"]', '"STEP:REPLICAS"'),
        ('["200:1"]', "below training.steps"),
        # 1 trainer shard of 1 rank and 3 rollout ranks: B_max = 2 groups cannot feed 3 rollout ranks
        ('["4:1"]', "T1x1+R3"),
    ],
)
def test_bad_placement_schedules_are_rejected_before_ranks_start(schedule, words):
    m = ConfigManager()
    args = [
        "--training.mode=reflow", "--placement.trainer_replicate_degree=2", "--placement.trainer_shard_degree=1",
        "--placement.num_rollout_ranks=2", "--weight_sync.interval=2", f"--placement.schedule={schedule}",
        "--training.steps=100",
    ]
    if words == "T1x1+R3":
        args.append("--training.prompts_per_step=2")
    cfg = m.parse_args(args)
    validate(cfg, m.where)
    with pytest.raises(ConfigError) as err:
        parse_schedule(cfg, validate_world(cfg, 4, m.where), m.where)
    assert "'placement.schedule'" in str(err.value) and words in str(err.value), str(err.value)


def test_placement_schedule_needs_reflow_mode():
    base = ["--placement.num_rollout_ranks=2", "--placement.trainer_replicate_degree=2", '--placement.schedule=["2:1"]',
            "--weight_sync.interval=1"]
    cfg = ConfigManager().parse_args(["--training.mode=async", *base])
    with pytest.raises(ConfigError, match="'reflow' mode only"):
        parse_schedule(cfg, validate_world(cfg, 4))
    m = ConfigManager()
    cfg = m.parse_args(["--training.mode=reflow", "--checkpoint.enable=true", *base])
    assert parse_schedule(cfg, validate_world(cfg, 4, m.where)) == [(2, 1)]


def test_a_ratio_based_policy_with_one_update_per_batch_is_said_to_be_plain_ppo_clip():
    from reflow.config.validate import mode_warnings

    m = ConfigManager()
    (said,) = mode_warnings(m.parse_args(["--loss.policy=gspo"]), m.where)
    assert "loss.policy = 'gspo'" in said and "exactly 1" in said and "num_minibatches > 1" in said
    assert mode_warnings(m.parse_args(["--loss.policy=gspo", "--training.num_minibatches=4"]), m.where) == []
    assert mode_warnings(m.parse_args(["--loss.policy=ppo_clip"]), m.where) == []
    assert mode_warnings(m.parse_args(["--loss.policy=cispo", "--training.ppo_epochs=2"]), m.where) == []


def test_docs_algorithms_names_every_key_a_published_recipe_sets():
    import tomllib

    doc = open(os.path.join(ROOT, "docs", "algorithms.md")).read()
    for recipe in ("grpo", "dr_grpo", "dapo", "gspo"):
        with open(os.path.join(ROOT, "train_configs", f"{recipe}_qwen3_8b_math.toml"), "rb") as f:
            keys = [f"{section}.{key}" for section, table in tomllib.load(f).items() for key in table]
        assert [key for key in keys if f"`{key}`" not in doc] == [], recipe
