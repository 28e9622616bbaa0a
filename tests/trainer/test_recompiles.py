"""No recompile cliff: over ten steps whose micro-batch widths (10 to 120 tokens) and row counts all differ,
dynamo compiles the trainer's blocks, and torchtitan's compiled flex attention, for the first shapes and then
never again (a dimension that changed becomes symbolic); ten distinct widths are more than the recompile
limit (8), so a graph per width would have shown. Should the limit ever be reached, it fails loudly instead
of running flex attention eagerly (``reflow.trainer.parallelize.refuse_eager_fallback``)."""

import json

from tests.conftest import run_torchrun


def test_varying_widths_compile_a_bounded_number_of_graphs(tmp_path):
    out = tmp_path / "recompiles.json"
    run_torchrun(1, ["tests/trainer/scripts/recompiles.py", str(out)])
    rep = json.loads(out.read_text())
    for key in ("train_graphs", "flex_logprob_graphs"):
        graphs = rep[key]
        # the first three steps see every kind of shape change (width, rows, a one-row micro-batch); from then
        # on each new width reuses a graph
        assert len(set(graphs[2:])) == 1, (key, graphs)
    assert rep["fail_on_recompile_limit_hit"]
    assert 10 > rep["recompile_limit"]  # ten distinct widths: one graph each would have hit the limit
