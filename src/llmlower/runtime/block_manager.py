"""The KV-cache block manager: which blocks of the pool each sequence's positions live in.

Blocks hold `block_size` positions; a block is referenced by every sequence whose table names it and returns
to the pool when the last one lets go. Prefix caching: a full block is named by a hash of its tokens chained
with its predecessor's hash, so equal hashes mean equal prefixes; a new sequence starts from the cached blocks
of its longest cached prefix instead of recomputing them. Unreferenced cached blocks stay in the pool until a
new block is needed, evicted least recently freed first (a sequence's tail before its head). A sequence about
to append into a block it shares (the prompt's last, partial block after an n > 1 fork) gets its own copy
first (copy-on-write); the copies to make are handed to the executor with each step.

In the SLOTS layout (an executor that keeps each sequence contiguous, such as ONNX Runtime's
GroupQueryAttention on the CPU) the pool is cut into slots of `blocks_per_slot` blocks: a sequence owns a
slot and its i-th block is the slot's i-th block. A cached prefix is then used in place when its slot is free,
and copied into the new sequence's slot when another sequence still owns it.

A hybrid model's recurrent states are one row per sequence: in SLOTS a sequence's slot is its row; in PAGED the
manager hands out `state_slots` rows beside the blocks (admission waits for one, an n > 1 request takes its forks'
at admission too), and a fork's row starts as a copy of its parent's (`take_state_copies`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import GenerationError


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash naming a full block: its tokens chained with the hash of the block before it (b"" for the
    first). 128-bit BLAKE2, so that two different prefixes never share a name in practice."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass
class PrefixStats:
    """Prompt tokens looked up in the prefix cache, and how many of them were found (vLLM's counters)."""

    queries: int = 0
    hits: int = 0


@dataclass
class _Table:
    """One sequence's blocks, in position order, and the hashes of its full blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    slot: int = -1  # its slot (SLOTS) or its recurrent-state row (PAGED, hybrid models); -1 when it has none
    fork_slots: list[int] = field(default_factory=list)  # held from admission for its n > 1 forks
    salt: bytes = b""  # the root of its hashes (admit's salt)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        blocks_per_slot: int | None = None,
        state_slots: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise GenerationError(f"the KV cache needs at least one block of at least one token, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks_per_slot = blocks_per_slot
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding that prefix
        self.unused: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recent first
        self.tables: dict[int, _Table] = {}
        self.copies: list[tuple[int, int]] = []  # (source, destination) block copies the executor still has to make
        self.prefix = PrefixStats()
        self.state_copies: list[tuple[int, int]] = []  # (source, destination) state rows to copy (PAGED forks)
        self.num_slots = 0
        if blocks_per_slot is not None:
            self.num_slots = num_blocks // blocks_per_slot
            if self.num_slots < 1:
                raise GenerationError(f"{num_blocks} blocks do not fill one slot of {blocks_per_slot} blocks")
        elif state_slots:
            self.num_slots = state_slots
        self.free_slots: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_slots))

    # ---------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (free, or cached but unreferenced)."""
        if self.blocks_per_slot is not None:
            return len(self.free_slots) * self.blocks_per_slot
        return len(self.unused) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of the pool held by sequences, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id].blocks

    def slot_of(self, seq_id: int) -> int:
        """The sequence's slot (SLOTS) or recurrent-state row (PAGED with state slots); -1 without either."""
        return self.tables[seq_id].slot

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---------------------------------------------------------------- admission

    def admit(
        self, seq_id: int, token_ids: Sequence[int], reserve: int = 0, width: int = 1, salt: bytes = b""
    ) -> int | None:
        """Start a sequence: find its cached prefix and make sure its prompt can be placed. Returns how many of
        its tokens are already cached (its KV need not be computed), or None when the pool cannot take it now
        while keeping `reserve` blocks free for the running sequences (nothing is held then). `width`: the
        sequences it will fork into (an n > 1 request), each needing a slot of its own in the SLOTS layout: those
        are taken now, so a fork never finds the slots gone to later requests. `salt`: the root of its blocks'
        hashes (b"": the base model's; a LoRA adapter's own), so only KV computed the same way is shared."""
        if seq_id in self.tables:
            raise GenerationError(f"sequence {seq_id} already holds blocks")
        hits = self._cached_prefix(token_ids, salt)
        if self.blocks_per_slot is not None:
            if len(self.free_slots) < width:
                return None
            cached = self._admit_to_slot(seq_id, token_ids, hits)
            self.tables[seq_id].salt = salt
            self.tables[seq_id].fork_slots = [self.free_slots.popitem(last=False)[0] for _ in range(width - 1)]
            return cached
        new_blocks = self.blocks_needed(len(token_ids)) - len(hits)  # room for the whole prompt
        reusable = sum(1 for block in hits if self.refs[block] == 0)  # cached, unreferenced: counted as free
        if self.num_free_blocks - reusable < new_blocks + reserve:
            return None
        if self.num_slots and len(self.free_slots) < width:  # a recurrent-state row for it and each fork
            return None
        table = self.tables[seq_id] = _Table(salt=salt)
        if self.num_slots:  # a recurrent-state row for it and each of its forks
            table.slot, *table.fork_slots = (self.free_slots.popitem(last=False)[0] for _ in range(width))
        for block in hits:
            self._reference(block)
            table.blocks.append(block)
            table.hashes.append(self.hash_of[block])
        self._count_lookup(len(token_ids), len(hits))
        return len(hits) * self.block_size

    def cached_tokens(self, token_ids: Sequence[int], salt: bytes = b"") -> int:
        """How many of token_ids' first tokens the cache holds now (admit would start after them); changes nothing."""
        return len(self._cached_prefix(token_ids, salt)) * self.block_size

    def _cached_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> list[int]:
        """Blocks holding the longest cached prefix of token_ids, leaving at least one token to compute (its
        logits are the ones sampled)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], salt
        for start in range(0, len(token_ids) - self.block_size, self.block_size):
            parent = block_hash(parent, token_ids[start : start + self.block_size])
            block = self.cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def _count_lookup(self, tokens: int, hit_blocks: int) -> None:
        if self.enable_prefix_caching:
            self.prefix.queries += tokens
            self.prefix.hits += hit_blocks * self.block_size

    def _admit_to_slot(self, seq_id: int, token_ids: Sequence[int], hits: list[int]) -> int | None:
        """SLOTS layout: the free slot holding the longest run of the hits in place, else the least recently
        freed one; hits that live elsewhere are copied into the slot."""
        if not self.free_slots:
            return None
        per_slot = self.blocks_per_slot
        if self.blocks_needed(len(token_ids)) > per_slot:
            raise GenerationError(f"{len(token_ids)} tokens do not fit a slot of {per_slot * self.block_size}")

        def in_place(slot: int) -> int:
            return next((i for i, block in enumerate(hits) if block != slot * per_slot + i), len(hits))

        slot = max(self.free_slots, key=in_place) if hits else next(iter(self.free_slots))
        del self.free_slots[slot]
        table = self.tables[seq_id] = _Table(slot=slot)
        for index in range(per_slot):  # what the slot held beyond the prefix it keeps is overwritten: forget it
            block = slot * per_slot + index
            if index >= len(hits) or hits[index] != block:
                self._forget(block)
        for index, source in enumerate(hits):
            block = slot * per_slot + index
            if source != block:  # another slot holds it: copy it (the copy stays unnamed, the source keeps the name)
                self.copies.append((source, block))
            self._reference(block)
            table.blocks.append(block)
            table.hashes.append(self.hash_of[source])
        self._count_lookup(len(token_ids), len(hits))
        return len(hits) * self.block_size

    # ---------------------------------------------------------------- growth

    def allocate(self, seq_id: int, total_tokens: int) -> bool:
        """Make the sequence's table cover `total_tokens` positions, copying a shared block it will write into
        first. All or nothing: False (nothing changed) when the pool has too few free blocks."""
        table = self.tables[seq_id]
        new = max(0, self.blocks_needed(total_tokens) - len(table.blocks))
        if self.blocks_per_slot is not None:
            if len(table.blocks) + new > self.blocks_per_slot:
                raise GenerationError(f"sequence {seq_id} outgrows its slot of {self.blocks_per_slot} blocks")
            for _ in range(new):
                block = table.slot * self.blocks_per_slot + len(table.blocks)
                self._reference(block)
                table.blocks.append(block)
            return True
        partial = len(table.blocks) > len(table.hashes)  # its last block is not full: the next token goes there
        shared_tail = partial and self.refs[table.blocks[-1]] > 1
        if new + shared_tail > self.num_free_blocks:
            return False
        if shared_tail:
            source = table.blocks[-1]
            copy = self._take_block()
            self.copies.append((source, copy))
            self.refs[source] -= 1
            table.blocks[-1] = copy
        for _ in range(new):
            table.blocks.append(self._take_block())
        return True

    def commit(self, seq_id: int, token_ids: Sequence[int], computed: int) -> None:
        """Record that the first `computed` tokens' KV is in the sequence's blocks: each block filled by now is
        hashed and offered to the prefix cache."""
        table = self.tables[seq_id]
        while (len(table.hashes) + 1) * self.block_size <= computed:
            start = len(table.hashes) * self.block_size
            parent = table.hashes[-1] if table.hashes else table.salt
            digest = block_hash(parent, token_ids[start : start + self.block_size])
            table.hashes.append(digest)
            if self.enable_prefix_caching:
                self._register(table.blocks[len(table.hashes) - 1], digest)

    def truncate(self, seq_id: int, total_tokens: int) -> None:
        """Give back the blocks beyond the first `total_tokens` positions (those rejected speculative tokens
        were written to); they were never committed, so no cached prefix is lost."""
        table = self.tables[seq_id]
        keep = max(self.blocks_needed(total_tokens), len(table.hashes))
        while len(table.blocks) > keep:
            block = table.blocks.pop()
            self.refs[block] -= 1
            if self.blocks_per_slot is None and self.refs[block] == 0:
                self._forget(block)
                self.unused.append(block)

    def fork(self, parent: int, child: int) -> None:
        """The child starts with the parent's blocks, shared (the parent's partial last block too: whichever
        writes into it first gets a copy)."""
        if child in self.tables:
            raise GenerationError(f"sequence {child} already holds blocks")
        source = self.tables[parent]
        if self.blocks_per_slot is not None:  # a slot is one sequence's: the child gets its own and a copy
            if not source.fork_slots:
                raise GenerationError(f"sequence {parent} was admitted without a KV slot for another completion")
            slot = source.fork_slots.pop()
            table = self.tables[child] = _Table(slot=slot, hashes=list(source.hashes), salt=source.salt)
            for index in range(self.blocks_per_slot):  # the child rewrites the whole slot: its old prefix is gone
                self._forget(slot * self.blocks_per_slot + index)
            for index, block in enumerate(source.blocks):
                copy = slot * self.blocks_per_slot + index
                self.copies.append((block, copy))
                self._reference(copy)
                table.blocks.append(copy)
            return
        for block in source.blocks:
            self.refs[block] += 1
        table = self.tables[child] = _Table(list(source.blocks), list(source.hashes), salt=source.salt)
        if self.num_slots:  # its recurrent state starts as the parent's
            if not source.fork_slots:
                raise GenerationError(f"sequence {parent} was admitted without a state row for another completion")
            table.slot = source.fork_slots.pop()
            self.state_copies.append((source.slot, table.slot))

    def free(self, seq_id: int) -> None:
        """Let go of the sequence's blocks; cached ones stay findable until evicted, its tail first."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0 and self.blocks_per_slot is None:
                if self.hash_of[block] is not None:
                    self.evictable[block] = None
                else:
                    self.unused.append(block)
        if self.num_slots:
            for slot in (table.slot, *table.fork_slots):
                self.free_slots[slot] = None  # most recently freed last: reused last
        if self.blocks_per_slot is not None:
            for block in table.blocks[len(table.hashes) :]:
                self._forget(block)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies to make before the next step, in order; cleared."""
        copies, self.copies = self.copies, []
        return copies

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The recurrent-state row copies to make before the next step (PAGED forks), in order; cleared."""
        copies, self.state_copies = self.state_copies, []
        return copies

    # ---------------------------------------------------------------- internals

    def _reference(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def _take_block(self) -> int:
        """An unreferenced block: a free one, else the least recently freed cached one (evicted)."""
        if self.unused:
            block = self.unused.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._forget(block)
        self.refs[block] = 1
        return block

    def _register(self, block: int, digest: bytes | None) -> None:
        """Offer a full block to the prefix cache (the first block with a given prefix keeps the name)."""
        if digest is not None and digest not in self.cached:
            self.cached[digest] = block
            self.hash_of[block] = digest

    def _forget(self, block: int) -> None:
        """The block's contents are about to change: it no longer holds its cached prefix."""
        digest = self.hash_of[block]
        if digest is not None:
            self.hash_of[block] = None
            if self.cached.get(digest) == block:
                del self.cached[digest]


def available_memory() -> int | None:
    """Bytes of memory the system can still give this process (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_pool_blocks(
    bytes_per_token: int,
    block_size: int,
    max_num_seqs: int,
    max_context: int,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    on_host: bool = True,
    state_bytes: int = 0,
) -> int:
    """The KV pool's size in blocks: `num_blocks`, or as many as `kv_cache_memory` bytes hold, or by default
    enough for max_num_seqs sequences of max_context tokens. A hybrid model's recurrent state (`state_bytes` a
    sequence, whatever its length) is sized with the pool: each block carries its share of the state of a sequence
    of max_context tokens. A pool that cannot hold one sequence of max_context tokens, or one in host memory larger
    than the memory still available, is refused here with the numbers (rather than a sequence that never fits, or
    the OOM killer, later)."""
    if num_blocks is not None and kv_cache_memory is not None:
        raise GenerationError("give --num-blocks or --kv-cache-memory, not both")
    block_bytes = bytes_per_token * block_size + -(-state_bytes // -(-max_context // block_size))
    if num_blocks is not None:
        blocks = num_blocks
    elif kv_cache_memory is not None:
        blocks = kv_cache_memory // block_bytes
    else:
        blocks = max_num_seqs * -(-max_context // block_size)
    if blocks * block_size < max_context:  # a sequence growing to its context could then never be scheduled
        given = f"--kv-cache-memory {kv_cache_memory}: " if num_blocks is None and kv_cache_memory is not None else ""
        raise GenerationError(
            f"{given}a KV pool of {blocks:,} blocks of {block_size} tokens holds {blocks * block_size:,} tokens, "
            f"less than one sequence's context of {max_context:,}: raise --num-blocks or --kv-cache-memory, or "
            "lower --max-context"
        )
    available = available_memory() if on_host else None
    if available is not None and blocks * block_bytes > available:
        raise GenerationError(
            f"a KV pool of {blocks:,} blocks needs {blocks * block_bytes / 2**30:.2f} GiB; this machine has "
            f"{available / 2**30:.2f} GiB available: lower --kv-cache-memory, --num-blocks, --max-num-seqs or "
            "--max-context (generate sizes it for --n full contexts)"
        )
    return blocks
