"""A resumed run regenerates exactly the prompts its checkpoint left unfinished, in runs
of consecutive prompts, then goes on from the cursor (rlray.driver.prompt_queue)."""

from rlray.driver.prompt_queue import PromptQueue


def hand_out_all(queue: PromptQueue, size: int, batches: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(batches):
        [(first, count)] = queue.next_batches(size, 1)
        queue.hand_out(first, count)
        out.append((first, count))
    return out


def test_a_fresh_queue_hands_out_the_stream_in_whole_batches():
    assert hand_out_all(PromptQueue(0), 8, 3) == [(0, 8), (8, 8), (16, 8)]


def test_a_resumed_queue_replays_its_unfinished_prompts_in_consecutive_runs_first():
    # In flight 40-47, carried 18 and 21, buffered 24-31: cursor 48.
    replay = [*range(40, 48), 18, 21, *range(24, 32)]
    queue = PromptQueue(48, replay)
    batches = hand_out_all(queue, 4, 7)
    assert batches == [(18, 1), (21, 1), (24, 4), (28, 4), (40, 4), (44, 4), (48, 4)]
    handed = [p for first, count in batches for p in range(first, first + count)]
    assert len(handed) == len(set(handed))  # none twice
    assert set(handed) == set(replay) | set(range(48, 52))


def test_next_batches_hand_out_nothing_until_told():
    queue = PromptQueue(8, [3, 4])
    assert queue.next_batches(8, 1) == queue.next_batches(8, 1) == [(3, 2)]
    queue.hand_out(3, 2)
    assert queue.next_batches(8, 1) == [(8, 8)] and queue.cursor == 8


def test_batches_looked_ahead_are_those_handed_out_one_at_a_time():
    replay = [*range(40, 48), 18, 21, *range(24, 32)]
    ahead = PromptQueue(48, replay).next_batches(4, 9)
    assert ahead == hand_out_all(PromptQueue(48, replay), 4, 9)
    assert ahead[-4:] == [(44, 4), (48, 4), (52, 4), (56, 4)]  # the stream goes on after the replay
