"""Cells of sequences sharing a KV cache (backends/cell_blocks.py): each position keeps its offset
within an aligned block, each sequence's blocks rise, blocks are taken lowest first and freed on
truncation."""
import pytest

from specdec.backends.cell_blocks import CellBlocks
from specdec.types import SpecdecError


def test_a_sequence_alone_sits_where_it_would_in_a_cache_of_its_own():
    blocks = CellBlocks(64, block=8)
    assert blocks.cells(0, range(20)) == list(range(20))


def test_interleaved_sequences_keep_offsets_within_blocks_and_rising_blocks():
    blocks = CellBlocks(96, block=8)
    a, b = [], []
    for start in range(0, 40, 5):  # two sequences growing in turns, as decode rounds do
        a += blocks.cells(0, range(start, start + 5))
        b += blocks.cells(1, range(start, start + 5))
    for cells in (a, b):
        assert [cell % 8 for cell in cells] == [p % 8 for p in range(40)]
        assert cells == sorted(cells)  # rising: summed in the order of a cache of its own
    assert not set(a) & set(b)


def test_truncation_frees_whole_blocks_and_the_lowest_free_block_is_taken_first():
    blocks = CellBlocks(64, block=8)
    blocks.cells(0, range(24))  # blocks 0, 1, 2
    blocks.cells(1, range(8))  # block 3
    blocks.truncate(0, 9)  # keeps blocks 0 and 1 (position 8 is in block 1)
    assert blocks.cells(2, range(3)) == [16, 17, 18]  # block 2 again
    blocks.truncate(0, 0)
    assert blocks.cells(3, [0]) == [0]


def test_a_sequence_with_no_free_block_above_its_last_gets_a_clear_error():
    blocks = CellBlocks(24, block=8)  # three blocks
    blocks.cells(0, [0])  # block 0
    blocks.cells(1, [0])  # block 1
    blocks.cells(2, [0])  # block 2
    blocks.truncate(0, 0)  # block 0 free, but below sequence 2's block
    with pytest.raises(SpecdecError, match="no free block after sequence 2"):
        blocks.cells(2, [8])


def test_a_shared_block_is_free_again_only_when_its_last_holder_drops_it():
    blocks = CellBlocks(64, block=8)
    blocks.cells(0, range(20))  # blocks 0, 1, 2
    blocks.share(0, 1, 16)  # sequence 1 takes positions 0..15: blocks 0 and 1, the same cells
    assert blocks.first_cell(1) == 0
    assert blocks.cells(1, [16]) == [24]  # its own next block above them: still rising
    blocks.truncate(0, 0)
    assert blocks.cells(2, range(9)) == [16, 17, 18, 19, 20, 21, 22, 23, 32]  # block 2 was 0's alone
    blocks.truncate(1, 0)
    assert blocks.cells(3, [0]) == [0]  # now blocks 0 and 1 are free


def test_no_holder_may_cut_into_a_block_it_shares():
    blocks = CellBlocks(64, block=8)
    blocks.cells(0, range(20))
    blocks.share(0, 1, 16)
    assert blocks.keepable(0, 12) == 8  # position 12 sits in block 1, which sequence 1 holds too
    assert blocks.keepable(1, 12) == 8
    assert blocks.keepable(0, 18) == 18  # block 2 is its own
    assert blocks.keepable(0, 16) == 16
    blocks.truncate(1, 0)
    assert blocks.keepable(0, 12) == 12


def test_sharing_takes_the_blocks_of_held_positions_and_only_into_an_empty_sequence():
    blocks = CellBlocks(64, block=8)
    blocks.cells(0, range(20))
    with pytest.raises(ValueError):
        blocks.share(0, 1, 32)  # more than it holds
    blocks.cells(1, [0])
    with pytest.raises(ValueError):
        blocks.share(1, 0, 8)


def test_a_start_ending_inside_a_block_shares_it_and_only_its_last_holder_writes_there():
    blocks = CellBlocks(64, block=8)
    blocks.cells(0, range(20))  # blocks 0, 1, 2; position 19 in block 2
    blocks.share(0, 1, 12)  # positions 0..11: blocks 0 and 1, block 1 in part
    assert blocks.keepable(1, 12) == 8 and blocks.keepable(0, 12) == 8
    with pytest.raises(ValueError, match="another sequence holds"):
        blocks.cells(1, [12])  # position 12 of sequence 0 still sits in that block
    blocks.truncate(0, 8)  # sequence 0 keeps block 0 only: block 1 is sequence 1's alone
    assert blocks.keepable(1, 12) == 12
    assert blocks.cells(1, range(12, 18)) == [12, 13, 14, 15, 16, 17]  # then block 2, freed by 0's cut
    with pytest.raises(ValueError, match="another sequence holds"):
        blocks.cells(0, [3])  # block 0 stays shared


def test_room_to_hold_counts_a_block_taken_in_part():
    blocks = CellBlocks(32, block=8)  # four blocks
    blocks.cells(0, range(12))  # blocks 0 and 1
    blocks.cells(1, range(8))  # block 2
    assert blocks.room_to_hold(2, 0, 12, 16)  # blocks 0 and 1 (in part): its positions up to 16 fit
    assert blocks.room_to_hold(2, 0, 12, 24)  # and one more above: block 3
    assert not blocks.room_to_hold(2, 0, 12, 32)


def test_room_to_hold_counts_the_free_blocks_above_a_shared_start():
    blocks = CellBlocks(48, block=8)  # six blocks
    blocks.cells(0, range(8))  # block 0
    blocks.cells(1, range(24))  # blocks 1, 2, 3
    blocks.cells(2, range(8))  # block 4
    blocks.truncate(0, 0)  # block 0 free, below sequence 1's blocks
    assert blocks.room_to_hold(0, 1, 16, 24)  # blocks 1 and 2, then block 5
    assert not blocks.room_to_hold(0, 1, 16, 32)  # one more: only block 0 is free, below
    assert blocks.room_to_hold(0, 0, 0, 16)  # from scratch: blocks 0 and 5
    assert not blocks.room_to_hold(0, 0, 0, 24)


def test_room_to_hold_counts_the_blocks_a_sequence_gives_up():
    blocks = CellBlocks(48, block=8)
    blocks.cells(0, range(24))  # blocks 0, 1, 2
    blocks.cells(1, range(24))  # blocks 3, 4, 5
    assert blocks.room_to_hold(0, 0, 10, 24)  # keeps blocks 0 and 1: block 2 is its again
    assert not blocks.room_to_hold(0, 0, 10, 32)
    assert blocks.room_to_hold(1, 0, 16, 40)  # 0's blocks 0 and 1, then its own 3, 4, 5 given up
    assert not blocks.room_to_hold(1, 0, 16, 48)  # block 2 stays sequence 0's
    blocks.share(1, 2, 8)  # block 3 is sequence 2's too: not free when sequence 1 gives it up
    assert not blocks.room_to_hold(1, 0, 16, 40)
    assert blocks.room_to_hold(1, 0, 16, 32)
    assert blocks.room_to_hold(1, 1, 24, 24)  # what it holds already


def test_held_cells_names_the_cells_of_a_sequence_positions_shared_ones_included():
    blocks = CellBlocks(16, block=4)
    blocks.cells(0, range(6))  # blocks 0, 1
    blocks.cells(1, range(3))  # block 2
    blocks.cells(0, range(6, 9))  # block 3
    blocks.share(0, 2, 5)  # blocks 0 and 1, the second in part
    assert blocks.held_cells(0, 9) == [0, 1, 2, 3, 4, 5, 6, 7, 12]
    assert blocks.held_cells(2, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        blocks.held_cells(1, 5)  # one block: 4 positions at most


def test_a_sequence_among_others_blocks_is_gathered_into_a_free_run_with_room_for_its_end():
    blocks = CellBlocks(128, block=8)  # 16 blocks
    blocks.cells(0, range(16))  # blocks 0, 1: a conversation taken back from its parked start
    blocks.cells(1, range(24))  # 2..4: another one parked above it
    assert blocks.cells(0, [16]) == [5 * 8]  # its next position would sit past the other's blocks
    blocks.truncate(0, 16)
    moved = blocks.gathered(0, 16, end=40)  # 5 blocks: the lowest free run of 5 is 5..9
    assert moved == [5, 6]
    cells = blocks.move_to(0, moved)
    assert cells[:16] == list(range(40, 56))  # offsets within blocks as before
    assert blocks.cells(0, [16]) == [56]  # and it grows into the next block
    assert blocks.cells(2, range(16)) == list(range(16))  # its old blocks are free
    assert blocks.gathered(0, 17, end=40) is None  # together now


def test_a_sequence_already_together_shared_or_with_nowhere_better_stays():
    blocks = CellBlocks(64, block=8)  # 8 blocks
    blocks.cells(0, range(16))  # 0, 1
    assert blocks.gathered(0, 16, end=48) is None  # 2..5 free above it
    blocks.cells(1, range(8))  # 2
    blocks.cells(2, range(40))  # 3..7: no run of free blocks fits it better
    assert blocks.gathered(0, 16, end=48) is None
    blocks.share(0, 3, 16)
    blocks.truncate(1, 0)
    assert blocks.gathered(0, 16, end=24) is None  # shared: the other holder reads those cells


def test_gathering_never_leaves_a_sequence_less_room_for_its_end():
    blocks = CellBlocks(80, block=8)  # 10 blocks
    blocks.cells(0, range(16))  # 0, 1
    blocks.cells(1, range(8))  # 2
    blocks.cells(2, range(8))  # 3
    blocks.cells(3, range(8))  # 4
    blocks.truncate(2, 0)  # 3 free: 3, 5..9 free, 6 of them above block 1
    # 8 blocks wanted: none fits; the longest run, 5..9, would leave it 5 of the 8 where it has 8.
    assert blocks.gathered(0, 16, end=64) is None
    # 5 wanted: 5..9 holds them all, together: moved there.
    assert blocks.gathered(0, 16, end=40) == [5, 6]
