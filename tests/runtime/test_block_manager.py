"""The block manager and the scheduler on their own (no model): prefix caching by chained block hashes,
reference counts, LRU eviction of cached blocks, copy-on-write after a fork, the SLOTS layout, chunked
prefill, admission by free blocks and preemption by recompute."""

from __future__ import annotations

import pytest

from llmlower.errors import GenerationError
from llmlower.runtime.block_manager import BlockManager, kv_pool_blocks
from llmlower.runtime.scheduler import Scheduler, Sequence

BLOCK = 4


def _run_to(manager: BlockManager, seq_id: int, tokens: list[int]) -> list[int]:
    """Admit a sequence and compute all its tokens (as steps would); returns its blocks."""
    cached = manager.admit(seq_id, tokens)
    assert cached is not None
    assert manager.allocate(seq_id, len(tokens))
    manager.commit(seq_id, tokens, len(tokens))
    return list(manager.block_table(seq_id))


def test_a_cached_prefix_is_found_block_by_block_and_leaves_the_last_token_to_compute():
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    first = _run_to(manager, 0, list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    assert len(first) == 3 and manager.prefix.hits == 0
    assert manager.admit(1, list(range(9)) + [99]) == 8  # two full blocks shared
    assert manager.block_table(1) == first[:2] and manager.refs[first[0]] == 2
    assert manager.admit(2, list(range(8))) == 4  # all 8 cached: the last block is recomputed
    assert manager.admit(3, [1, 2, 3, 4, 5]) == 0  # same tokens at other positions: no hit
    assert (manager.prefix.queries, manager.prefix.hits) == (10 + 10 + 8 + 5, 8 + 4)


def test_freed_cached_blocks_are_reused_until_evicted_tail_first():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    blocks = _run_to(manager, 0, list(range(13)))  # 4 blocks, 3 full
    manager.free(0)
    assert manager.num_free_blocks == 4
    assert manager.admit(1, list(range(9)) + [50]) == 8  # still cached after the sequence ended
    manager.free(1)
    assert manager.admit(2, [7] * 6) == 0 and manager.allocate(2, 6)  # two new blocks: the free one, then the tail
    assert manager.block_table(2) == [blocks[3], blocks[2]]
    manager.free(2)
    assert manager.admit(3, list(range(13)) + [60]) == 8  # the first two blocks are still cached, the third evicted


def test_fork_shares_blocks_and_copies_the_shared_partial_block_on_write():
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    parent = _run_to(manager, 0, list(range(6)))  # a full block and a partial one
    manager.fork(0, 1)
    assert manager.block_table(1) == parent and manager.refs[parent[1]] == 2
    assert manager.allocate(0, 7)  # the parent appends into the shared partial block: it gets a copy
    [(source, copy)] = manager.take_copies()
    assert source == parent[1] and manager.block_table(0) == [parent[0], copy]
    assert manager.allocate(1, 7) and manager.take_copies() == []  # the child now owns the original
    assert manager.block_table(1) == parent and manager.refs[parent[0]] == 2
    manager.free(0)
    manager.free(1)
    assert manager.num_free_blocks == 8 and set(manager.refs) == {0}


def test_allocation_is_all_or_nothing():
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    _run_to(manager, 0, list(range(8)))
    assert manager.admit(1, [9, 9]) == 0
    assert not manager.allocate(1, 9)  # needs 3 blocks, 1 is free
    assert manager.block_table(1) == [] and manager.num_free_blocks == 1


def test_slots_keep_a_sequence_contiguous_and_copy_prefixes_from_busy_slots():
    manager = BlockManager(num_blocks=12, block_size=BLOCK, blocks_per_slot=4)  # 3 slots of 16 positions
    first = _run_to(manager, 0, list(range(10)))
    assert first == [0, 1, 2]  # slot 0
    assert manager.admit(1, list(range(9)) + [70]) == 8  # slot 0 is busy: its blocks are copied into slot 1
    assert manager.block_table(1) == [4, 5] and manager.take_copies() == [(0, 4), (1, 5)]
    manager.free(0)
    assert manager.admit(2, list(range(9)) + [80]) == 8  # slot 0 is free again: used in place, no copy
    assert manager.block_table(2) == [0, 1] and manager.take_copies() == []
    with pytest.raises(GenerationError, match="outgrows its slot"):
        manager.allocate(2, 17)
    assert manager.admit(3, [5, 6, 7], width=2) is None  # an n = 2 request needs two free slots; one is left
    assert manager.admit(3, [5, 6, 7], width=1) == 0


def test_an_n_2_request_holds_its_forks_slot_from_admission():
    """The fork's slot is taken at admission: a request admitted after it cannot take it, and freeing the parent
    before the fork gives both slots back."""
    manager = BlockManager(num_blocks=12, block_size=BLOCK, blocks_per_slot=4)  # 3 slots
    assert manager.admit(0, [5, 6, 7], width=2) == 0 and manager.allocate(0, 3)
    assert manager.num_free_blocks == 4  # one slot left
    assert manager.admit(1, [8, 9]) == 0 and manager.allocate(1, 2)
    assert manager.admit(2, [10]) is None  # the third slot is the fork's
    manager.fork(0, 3)
    assert manager.block_table(3)[0] not in (manager.block_table(0)[0], manager.block_table(1)[0])
    for seq_id in (0, 1, 3):
        manager.free(seq_id)
    assert manager.num_free_blocks == 12
    assert manager.admit(4, [5], width=3) == 0
    manager.free(4)  # never forked: its forks' slots come back too
    assert manager.num_free_blocks == 12


def test_paged_blocks_hand_out_a_recurrent_state_row_per_sequence():
    """PAGED with a hybrid model's states: a sequence gets a state row beside its blocks (admission waits for one,
    an n = 2 request takes its fork's too), a fork's row starts as a copy of its parent's, and freeing gives the
    rows back, the fork's unused one too."""
    manager = BlockManager(num_blocks=32, block_size=BLOCK, state_slots=3)
    assert manager.admit(0, [5, 6, 7], width=2) == 0 and manager.allocate(0, 3)
    assert manager.admit(1, [8, 9]) == 0 and manager.allocate(1, 2)
    assert manager.admit(2, [10]) is None  # blocks are free, state rows are not: the third is the fork's
    manager.fork(0, 3)
    rows = [manager.slot_of(seq_id) for seq_id in (0, 1, 3)]
    assert sorted(rows) == [0, 1, 2]
    assert manager.block_table(3) == manager.block_table(0)  # the blocks are shared, not copied
    assert manager.take_state_copies() == [(rows[0], rows[2])] and manager.take_state_copies() == []
    for seq_id in (0, 1, 3):
        manager.free(seq_id)
    assert len(manager.free_slots) == 3 and manager.num_free_blocks == 32
    assert manager.admit(4, [5], width=3) == 0
    manager.free(4)  # never forked: its forks' rows come back too
    assert len(manager.free_slots) == 3


def test_a_fork_slot_forgets_the_prefix_it_held_before_the_fork_writes_into_it():
    """A slot taken for a fork may hold another request's cached blocks; the fork rewrites them all, so none of
    them may still be found as a cached prefix (found by the soak: a later prompt got the fork's KV as its own,
    and a forgotten block's missing name then stopped the engine)."""
    manager = BlockManager(num_blocks=12, block_size=BLOCK, blocks_per_slot=4)  # 3 slots of 16 positions
    _run_to(manager, 0, [1, 2, 3, 4, 9])  # slot 0 names the block [1, 2, 3, 4]; it keeps running
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    _run_to(manager, 1, prompt)  # slot 1: its first block copied from slot 0, then [5..8] and [9..12] named
    manager.free(1)
    assert manager.admit(2, [20, 21], width=2) == 0 and manager.allocate(2, 2)  # slot 2, fork slot 1
    manager.fork(2, 3)
    child = [20, 21, 30, 31, 32, 33, 34, 35, 36, 37]
    assert manager.allocate(3, len(child))
    manager.commit(3, child, len(child))  # the fork writes slot 1's second block with its own tokens
    manager.free(2)
    assert manager.admit(4, prompt) == 4  # only slot 0's first block still holds this prompt's prefix
    manager.commit(4, prompt, 4)


def test_pool_size_from_memory_and_a_pool_larger_than_the_machine_is_refused():
    assert kv_pool_blocks(1024, 16, max_num_seqs=4, max_context=100) == 4 * 7
    assert kv_pool_blocks(1024, 16, 4, 100, kv_cache_memory=16 * 1024 * 10) == 10
    with pytest.raises(GenerationError, match="holds 96 tokens, less than one sequence's context of 300"):
        kv_pool_blocks(1024, 16, 4, 300, num_blocks=6)
    with pytest.raises(GenerationError, match="holds 0 tokens, less than one sequence's context of 100"):
        kv_pool_blocks(2**20, 16, 4, 100, kv_cache_memory=10**6)
    with pytest.raises(GenerationError, match=r"needs .* GiB; this machine has .* available"):
        kv_pool_blocks(2**30, 16, 4, 100, num_blocks=2**20)
    with pytest.raises(GenerationError, match="not both"):
        kv_pool_blocks(1024, 16, 4, 100, num_blocks=3, kv_cache_memory=10**6)


def test_a_recurrent_state_is_sized_with_the_pool():
    """A hybrid model's state (a sequence's, whatever its length) is shared out over the blocks of a sequence of
    max_context tokens: a state as large as that sequence's KV halves what the same memory holds."""
    sequence_kv = 1024 * 16 * 7  # 100 tokens in 7 blocks of 16
    assert kv_pool_blocks(1024, 16, 4, 100, kv_cache_memory=16 * 1024 * 14, state_bytes=sequence_kv) == 7
    with pytest.raises(GenerationError, match=r"needs .* GiB; this machine has .* available"):
        kv_pool_blocks(1, 16, 4, 16, num_blocks=2**20, state_bytes=2**30)


def _sequences(lengths: list[int]) -> list[Sequence]:
    return [Sequence(i, list(range(100 * i, 100 * i + n)), n) for i, n in enumerate(lengths)]


def _steps(scheduler: Scheduler, count: int, decoding: list[Sequence]) -> list[list[tuple[int, int]]]:
    """Run `count` schedules as steps would (each scheduled sequence computes its tokens; `decoding` ones then
    get an output token); the (seq_id, tokens) of each step."""
    steps = []
    for _ in range(count):
        step = scheduler.schedule()
        steps.append([(s.sequence.seq_id, s.num_tokens) for s in step])
        for item in step:
            item.sequence.num_computed += item.num_tokens
        for sequence in decoding:
            sequence.token_ids.append(7)
    return steps


def test_chunked_prefill_runs_beside_the_decodes():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=4, max_num_batched_tokens=8)
    short, long = _sequences([3, 20])
    scheduler.add(short)
    [only] = scheduler.schedule()
    only.sequence.num_computed += only.num_tokens
    short.token_ids.append(7)  # its first output token
    scheduler.add(long)
    counts = _steps(scheduler, 3, [short])
    assert counts == [[(0, 1), (1, 7)], [(0, 1), (1, 7)], [(0, 1), (1, 6)]]  # one decode + a chunk in each step


def test_a_new_prompt_waits_a_step_rather_than_start_with_a_sliver():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=4, max_num_batched_tokens=12)
    running, first, second, long = _sequences([3, 8, 8, 30])
    scheduler.add(running)
    _steps(scheduler, 1, [running])
    for sequence in (first, second):
        scheduler.add(sequence)
    # 11 tokens of room after the decode: the first prompt fits; 3 more would be a sliver of the second's 8
    assert _steps(scheduler, 2, [running, first]) == [[(0, 1), (1, 8)], [(0, 1), (1, 1), (2, 8)]]
    second.token_ids.append(7)  # its first output token
    scheduler.add(long)  # longer than any step: it starts with the 9 tokens left after three decodes
    assert _steps(scheduler, 1, [running, first, second]) == [[(0, 1), (1, 1), (2, 1), (3, 9)]]


def test_preemption_frees_the_newest_sequence_and_requeues_it_first():
    blocks = BlockManager(5, BLOCK)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    older, newer = _sequences([4, 4])
    scheduler.add(older)
    scheduler.add(newer)
    assert [s.num_tokens for s in scheduler.schedule()] == [4, 4]
    for sequence in (older, newer):
        sequence.num_computed = 4
        blocks.commit(sequence.seq_id, sequence.token_ids, 4)
        sequence.token_ids.append(1)  # its first output token
    for _ in range(5):  # both decode until the pool runs out
        for item in scheduler.schedule():
            item.sequence.num_computed += 1
            item.sequence.token_ids.append(1)
    assert scheduler.preemptions == 1 and scheduler.waiting[0] is newer and newer.num_computed == 0
    assert scheduler.running == [older]


def test_a_step_budget_below_the_sequence_cap_is_refused():
    with pytest.raises(GenerationError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        Scheduler(BlockManager(8, BLOCK), max_num_seqs=8, max_num_batched_tokens=4)
