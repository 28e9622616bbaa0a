import pytest

from reflow.distributed.placement import build_placement


def test_colocated():
    p = build_placement(2, 1, -1, 0)
    assert p.colocated and p.trainer_ranks == [0, 1] and p.rollout_ranks == [0, 1]
    assert p.shard_degree == 2


def test_hsdp_with_rollout_ranks():
    p = build_placement(7, 2, -1, 3)
    assert (p.replicate_degree, p.shard_degree) == (2, 2)
    assert p.trainer_ranks == [0, 1, 2, 3] and p.rollout_ranks == [4, 5, 6]
    assert p.is_trainer(3) and not p.is_rollout(3) and p.is_rollout(4)


@pytest.mark.parametrize(
    "args, key",
    [
        ((4, 1, 3, 0), "does not match the world size"),
        ((4, 3, -1, 0), "not divisible"),
        ((4, 1, -1, 4), "num_rollout_ranks"),
        ((4, 0, -1, 0), "trainer_replicate_degree"),
    ],
)
def test_errors(args, key):
    with pytest.raises(ValueError, match=key):
        build_placement(*args)


def test_feasible_placements():
    from reflow.distributed.placement import feasible_placements

    assert [p.name for p in feasible_placements(4, 1, colocated=False)] == ["T1x1+R3", "T2x1+R2", "T3x1+R1"]
    assert [p.name for p in feasible_placements(7, 2, colocated=False)] == ["T1x2+R5", "T2x2+R3", "T3x2+R1"]
    assert [p.name for p in feasible_placements(4, 2, colocated=True)] == ["T2x2+R0"]
    assert feasible_placements(3, 2, colocated=True) == []
    assert all(p.num_trainer_ranks + p.num_rollout_ranks == 7 for p in feasible_placements(7, 2, colocated=False))


def test_rollout_tensor_parallel_placements_move_whole_engines():
    from reflow.distributed.placement import feasible_placements

    p = build_placement(8, 2, 1, 6, rollout_tp=2)
    assert p.name == "T2x1+R3x2" and p.rollout_ranks == [2, 3, 4, 5, 6, 7]
    assert p.rollout_workers == [2, 4, 6] and p.tp_block(5) == [4, 5]
    # rollout pools are whole engines of 2 ranks: 6, 4 or 2 of the 8 ranks
    assert [q.name for q in feasible_placements(8, 1, colocated=False, rollout_tp=2)] == ["T2x1+R3x2", "T4x1+R2x2", "T6x1+R1x2"]
    assert [q.name for q in feasible_placements(8, 2, colocated=False, rollout_tp=4)] == ["T2x2+R1x4"]
    assert build_placement(4, 1, 1, 3).rollout_workers == [1, 2, 3]  # without TP every rollout rank is a worker
    for world, rollout in ((6, 3), (5, 2)):
        with pytest.raises(ValueError, match="must be multiples of it"):
            build_placement(world, 1, -1, rollout, rollout_tp=2)


def test_a_placement_name_reads_back_as_it_was_written():
    from reflow.distributed.placement import parse_placement_name, placement_name

    for replicas, shard, rollout, tp in [(2, 1, 2, 1), (1, 2, 0, 1), (3, 8, 5, 1), (2, 1, 4, 2)]:
        parsed = parse_placement_name(placement_name(replicas, shard, rollout, tp))
        assert ((parsed.replicate_degree, parsed.shard_degree, parsed.num_rollout_ranks, parsed.rollout_tp)
                == (replicas, shard, rollout, tp))
        assert parsed.name == placement_name(replicas, shard, rollout, tp)
    assert parse_placement_name("T3x8+R5").num_trainer_ranks == 24
    assert parse_placement_name("T1x2+R0").world_size == 2 and parse_placement_name("T2x1+R2").world_size == 4
    with pytest.raises(ValueError, match="not a placement name"):
        parse_placement_name("3x8+5")
