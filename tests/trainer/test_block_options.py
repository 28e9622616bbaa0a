"""Per-block trainer options change how the blocks run, nothing else: training.activation_checkpointing = 'full'
recomputes blocks in the backward pass (bitwise alike), training.compile runs them as Inductor kernels (alike
to float rounding); both keep the state-dict names that checkpoints, the HF adapter and the weight sync use."""

import json

from tests.conftest import run_torchrun


def _report(tmp_path, option: str) -> dict:
    out = tmp_path / "report.json"
    run_torchrun(2, ["tests/trainer/scripts/block_options.py", str(out), option])
    return json.loads(out.read_text())


def test_activation_checkpointing_trains_bitwise_alike_through_a_resize(tmp_path):
    rep = _report(tmp_path, "activation_checkpointing")
    assert rep["wrapped"] == {"none": 0, "full": 4}  # every block of the tiny model recomputes
    assert rep["same_keys"] and not rep["wrapper_in_keys"]
    assert rep["bitwise_equal"]


def test_compiled_blocks_train_alike_through_a_resize(tmp_path):
    rep = _report(tmp_path, "compile")
    assert rep["wrapped"] == {"False": 0, "True": 4}  # every block of the tiny model compiled, in place
    assert rep["same_keys"] and not rep["wrapper_in_keys"]
    # Inductor's fused kernels round differently: the first step's loss and gradient norm agree to float32
    # rounding; after AdamW steps at lr 2e-3 (whose first update is about lr x sign(gradient), so a rounding of
    # a near-zero gradient can move an element by up to 2 lr) the shards stay within half an update
    (loss, grad_norm), (compiled_loss, compiled_grad_norm) = rep["first_step"]["False"], rep["first_step"]["True"]
    assert abs(compiled_loss - loss) <= 1e-5 * max(abs(loss), 1e-3)
    assert abs(compiled_grad_norm - grad_norm) <= 1e-5 * grad_norm
    assert rep["max_abs_diff"] < 1e-3
