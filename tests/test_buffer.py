"""EpisodeBuffer: bounded with backpressure, FIFO, stale batches dropped and counted."""

import pytest

from rlray.episodes.buffer import BufferedBatch, EpisodeBuffer


def batch(version: int, size: int = 4, batch_id: int = 0) -> BufferedBatch:
    return BufferedBatch(
        ref=[f"ref-{batch_id}"],
        policy_version=version,
        num_episodes=size,
        first_prompt_index=batch_id * 10,
        batch_id=batch_id,
    )


def test_reservations_count_against_capacity():
    buffer = EpisodeBuffer(capacity_episodes=8, max_staleness=0)
    assert buffer.reserve(4)
    assert buffer.reserve(4)
    assert not buffer.reserve(1)  # in-flight episodes fill it: the producer waits
    buffer.add(batch(0, batch_id=0))
    assert not buffer.reserve(1)
    taken = buffer.take(4, learner_version=0)
    assert [b.batch_id for b in taken.batches] == [0]
    assert buffer.reserve(4)


def test_a_reservation_for_several_batches_takes_those_that_fit_in_order():
    buffer = EpisodeBuffer(capacity_episodes=10, max_staleness=0)
    assert buffer.reserve_batches([4, 4, 4, 1]) == 2  # the fourth would fit, but in order
    assert buffer.reserve_batches([]) == 0
    assert buffer.stats()["buffer_reserved"] == 8
    buffer.add_batches([(batch(0, size=3, batch_id=0), 4), (batch(0, batch_id=1), 4)])
    assert buffer.stats()["buffer_reserved"] == 0 and buffer.stats()["buffer_depth"] == 7
    assert [b.batch_id for b in buffer.take(7, learner_version=0).batches] == [0, 1]


def test_add_without_reservation_is_refused():
    buffer = EpisodeBuffer(capacity_episodes=8, max_staleness=0)
    with pytest.raises(OverflowError, match="against a reservation of 4"):
        buffer.add(batch(0))


def test_an_agent_batch_may_hold_more_episodes_than_its_traces_reserved():
    buffer = EpisodeBuffer(capacity_episodes=8, max_staleness=0)
    assert buffer.reserve(4)
    buffer.add(batch(0, size=7, batch_id=0), reserved=4)  # 4 traces, 7 model calls
    assert buffer.stats()["buffer_reserved"] == 0
    assert not buffer.reserve(2)  # 7 held: no room for 2 until the learner takes them
    assert [b.batch_id for b in buffer.take(4, learner_version=0).batches] == [0]
    assert buffer.reserve(8)


def test_a_batch_thinned_by_dynamic_sampling_gives_back_its_whole_reservation():
    buffer = EpisodeBuffer(capacity_episodes=8, max_staleness=0)
    assert buffer.reserve(4) and buffer.reserve(4)
    buffer.add(batch(0, size=1, batch_id=0), reserved=4)  # 3 of 4 episodes split off
    buffer.add(batch(0, size=0, batch_id=1), reserved=4)  # every group uniform
    assert buffer.stats()["buffer_reserved"] == 0
    assert buffer.stats()["buffer_depth"] == 1
    assert buffer.take(1, learner_version=0).batches[0].batch_id == 0


def test_take_returns_oldest_batches_and_waits_for_enough():
    buffer = EpisodeBuffer(capacity_episodes=16, max_staleness=1)
    for i in range(3):
        buffer.reserve(4)
        buffer.add(batch(0, batch_id=i))
    assert buffer.take(16, learner_version=0) is None
    taken = buffer.take(8, learner_version=0)
    assert [b.batch_id for b in taken.batches] == [0, 1]
    assert buffer.stats()["buffer_depth"] == 4
    assert buffer.oldest_prompt_index() == 20


def test_stale_episodes_are_dropped_and_counted():
    buffer = EpisodeBuffer(capacity_episodes=16, max_staleness=1)
    for i, version in enumerate([0, 1, 2]):
        buffer.reserve(4)
        buffer.add(batch(version, batch_id=i))
    # Learner at version 2: version 0 is 2 behind (> K=1) and goes; version 1 stays.
    taken = buffer.take(8, learner_version=2)
    assert [b.batch_id for b in taken.batches] == [1, 2]
    assert [b.batch_id for b in taken.dropped] == [0]
    assert buffer.stats()["dropped_stale"] == 4
    assert buffer.stats()["buffer_depth"] == 0
    # The take says the same, so a learner step's figures need no call of their own.
    assert (taken.dropped_stale_episodes, taken.depth_episodes) == (4, 0)
    buffer.reserve(4)
    buffer.add(batch(2, batch_id=3))
    buffer.reserve(4)
    buffer.add(batch(2, batch_id=4))
    taken = buffer.take(4, learner_version=2)
    assert (taken.dropped_stale_episodes, taken.depth_episodes) == (4, 4)


def test_strict_on_policy_is_staleness_zero_on_the_same_path():
    buffer = EpisodeBuffer(capacity_episodes=16, max_staleness=0)
    for i, version in enumerate([0, 1]):
        buffer.reserve(4)
        buffer.add(batch(version, batch_id=i))
    taken = buffer.take(4, learner_version=1)
    assert [b.batch_id for b in taken.batches] == [1]
    assert buffer.stats()["dropped_stale"] == 4


def test_a_restarted_buffer_restored_by_its_producer_continues_where_it_stopped():
    buffer = EpisodeBuffer(capacity_episodes=12, max_staleness=0)
    assert buffer.reserve(4) and buffer.reserve(4) and buffer.reserve(4)
    buffer.add(batch(0, batch_id=0))
    buffer.add(batch(0, batch_id=1))
    restarted = EpisodeBuffer(capacity_episodes=12, max_staleness=0)
    restarted.restore([batch(0, batch_id=0), batch(0, batch_id=1)], reserved_episodes=4)
    assert not restarted.reserve(1)  # the batch still in flight keeps its room
    restarted.add(batch(0, batch_id=2))
    taken = restarted.take(12, learner_version=0)
    assert [b.batch_id for b in taken.batches] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="freshly started"):
        buffer.restore([], 0)


def grouped(version: int, sizes: list[int], batch_id: int) -> BufferedBatch:
    made = batch(version, size=sum(sizes), batch_id=batch_id)
    made.group_sizes = sizes
    return made


def test_a_step_never_takes_more_than_it_asks_for_a_batch_is_split_between_groups():
    """Agent batches hold more episodes than they reserved (a model call's episode each):
    a step takes the groups that fit, and the rest of the batch waits for the next."""
    buffer = EpisodeBuffer(capacity_episodes=64, max_staleness=1)
    for batch_id, sizes in enumerate(([3, 5, 2], [4, 4])):
        assert buffer.reserve(4)
        buffer.add(grouped(0, sizes, batch_id), reserved=4)

    first = buffer.take(8, learner_version=0)  # 3 + 5 fit, 2 + 4 + 4 wait
    (head,) = first.batches
    assert (head.ref, head.num_episodes, head.group_sizes) == (["ref-0", 0, 2], 8, [3, 5])
    assert (first.rest.ref, first.rest.num_episodes) == (["ref-0", 2, 3], 2)
    assert first.depth_episodes == 10

    second = buffer.take(8, learner_version=0)  # 2 + 4 fit; the last group waits
    assert [b.ref for b in second.batches] == [["ref-0", 2, 3], ["ref-1", 0, 1]]
    assert sum(b.num_episodes for b in second.batches) == 6
    assert second.rest.ref == ["ref-1", 1, 2] and second.depth_episodes == 4
    assert buffer.take(8, learner_version=0) is None  # 4 left: too few for a step


def test_a_first_group_bigger_than_the_step_is_taken_alone():
    buffer = EpisodeBuffer(capacity_episodes=64, max_staleness=1)
    assert buffer.reserve(4)
    buffer.add(grouped(0, [9, 1], 0), reserved=4)
    taken = buffer.take(8, learner_version=0)
    assert [(b.ref, b.num_episodes) for b in taken.batches] == [(["ref-0", 0, 1], 9)]
    assert taken.rest.num_episodes == 1


def test_batches_of_whole_groups_that_fit_are_taken_whole():
    buffer = EpisodeBuffer(capacity_episodes=64, max_staleness=0)
    for batch_id in range(3):
        assert buffer.reserve(4)
        buffer.add(grouped(0, [2, 2], batch_id))
    taken = buffer.take(8, learner_version=0)
    assert [b.ref for b in taken.batches] == [["ref-0"], ["ref-1"]]
    assert taken.rest is None and taken.depth_episodes == 4


def test_the_rest_of_a_split_batch_that_the_next_step_would_find_stale_is_dropped_now():
    """Strictly on-policy, what a step leaves of an agent batch would be stale at the
    next: it is dropped with this take, counted, so that the producer's count of what
    the buffer will train stays true (a later take would drop it, and report it only if
    it could fill a step)."""
    buffer = EpisodeBuffer(capacity_episodes=64, max_staleness=0)
    for batch_id, sizes in enumerate(([4] * 7, [4] * 6)):
        assert buffer.reserve(16)
        buffer.add(grouped(0, sizes, batch_id), reserved=16)
    taken = buffer.take(32, learner_version=0)
    assert sum(b.num_episodes for b in taken.batches) == 32
    assert taken.rest is None and taken.depth_episodes == 0
    assert [(b.ref, b.num_episodes) for b in taken.dropped] == [(["ref-1", 1, 6], 20)]
    assert buffer.stats()["dropped_stale"] == 20


def test_batches_without_group_sizes_are_taken_whole():
    """Rollout batches are sized to the step: taken whole, as they always were."""
    buffer = EpisodeBuffer(capacity_episodes=512, max_staleness=0)
    for batch_id, size in enumerate((140, 256)):
        assert buffer.reserve(256)
        buffer.add(batch(0, size=size, batch_id=batch_id), reserved=256)
    taken = buffer.take(256, learner_version=0)
    assert [b.num_episodes for b in taken.batches] == [140, 256] and taken.rest is None
