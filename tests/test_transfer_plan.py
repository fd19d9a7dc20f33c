"""``TransferPlan``: in which order one request's blocks travel (one message per layer, blocks
in ascending destination id) and their runs of consecutive block ids, and the message tags.
Pure: the module is torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.transfer.plan import (
    TRANSFER_SECRET_BYTES,
    InvalidTransferPlanError,
    TransferPlan,
    message_tag,
    new_transfer_secret,
)


def destination_order(block_ids: list[int], plan: TransferPlan) -> list[int]:
    """The destination block ids in the order messages carry the blocks."""
    return [block_ids[position] for position in plan.block_order]


def runs_of(block_ids: list[int], plan: TransferPlan) -> list[list[int]]:
    """The destination block ids of each run."""
    ordered = destination_order(block_ids, plan)
    return [
        ordered[offset : offset + length]
        for offset, length in zip(plan.run_offsets(), plan.run_lengths, strict=True)
    ]


# ----------------------------------------------------------------------------- for_destination


def test_contiguous_blocks_are_one_run_in_table_order() -> None:
    plan = TransferPlan.for_destination(range(4, 12))
    assert plan.block_order == tuple(range(8))
    assert plan.run_lengths == (8,)
    assert (plan.num_blocks, plan.num_runs) == (8, 1)
    assert plan.run_offsets() == [0]


def test_reversed_blocks_are_one_run_carried_in_ascending_block_order() -> None:
    plan = TransferPlan.for_destination([7, 6, 5, 4])
    assert plan.run_lengths == (4,)
    assert plan.block_order == (3, 2, 1, 0)
    assert destination_order([7, 6, 5, 4], plan) == [4, 5, 6, 7]


def test_one_block() -> None:
    plan = TransferPlan.for_destination([13])
    assert (plan.block_order, plan.run_lengths) == ((0,), (1,))


def test_scattered_blocks_are_cut_into_maximal_runs_of_consecutive_ids() -> None:
    block_ids = [9, 10, 11, 3, 4, 20, 19, 0]
    plan = TransferPlan.for_destination(block_ids)
    assert plan.run_lengths == (1, 2, 3, 2)
    assert plan.block_order == (7, 3, 4, 0, 1, 2, 6, 5)
    assert runs_of(block_ids, plan) == [[0], [3, 4], [9, 10, 11], [19, 20]]
    assert plan.run_offsets() == [0, 1, 3, 6]
    assert (plan.num_blocks, plan.num_runs) == (8, 4)


def test_ids_one_apart_in_the_table_but_not_in_value_are_separate_runs() -> None:
    block_ids = [2, 4, 6, 8]
    plan = TransferPlan.for_destination(block_ids)
    assert plan.run_lengths == (1, 1, 1, 1)
    assert runs_of(block_ids, plan) == [[2], [4], [6], [8]]


def test_every_plan_covers_each_block_once_in_runs_of_consecutive_ids() -> None:
    for block_ids in ([5, 1, 2, 3, 9, 8, 30, 31, 0], [100, 0, 50, 51, 49], list(range(40, 0, -3))):
        plan = TransferPlan.for_destination(block_ids)
        assert sorted(destination_order(block_ids, plan)) == sorted(block_ids)
        for run in runs_of(block_ids, plan):
            assert run == list(range(run[0], run[0] + len(run)))
        starts = [run[0] for run in runs_of(block_ids, plan)]
        ends = [run[-1] for run in runs_of(block_ids, plan)]
        assert all(start > end + 1 for start, end in zip(starts[1:], ends, strict=False))


def test_duplicate_destination_ids_are_refused() -> None:
    with pytest.raises(InvalidTransferPlanError, match="repeat"):
        TransferPlan.for_destination([3, 4, 3])


def test_an_invalid_plan_is_a_value_error() -> None:
    assert issubclass(InvalidTransferPlanError, ValueError)


# ----------------------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    "block_order",
    [(0, 0, 1), (1, 2, 3), (0, 1, 3), (0, -1, 1)],
    ids=["repeat", "shifted", "gap", "negative"],
)
def test_constructor_refuses_an_order_that_is_not_a_permutation(
    block_order: tuple[int, ...],
) -> None:
    with pytest.raises(InvalidTransferPlanError, match="permutation"):
        TransferPlan(block_order, (3,))


@pytest.mark.parametrize("run_lengths", [(0, 3), (4, -1)], ids=["zero", "negative"])
def test_constructor_refuses_runs_that_are_not_positive(run_lengths: tuple[int, ...]) -> None:
    with pytest.raises(InvalidTransferPlanError, match="positive"):
        TransferPlan((0, 1, 2), run_lengths)


@pytest.mark.parametrize("run_lengths", [(1, 1), (2, 2), ()], ids=["short", "long", "none"])
def test_constructor_refuses_runs_not_covering_the_blocks(run_lengths: tuple[int, ...]) -> None:
    with pytest.raises(InvalidTransferPlanError, match="runs cover"):
        TransferPlan((2, 0, 1), run_lengths)


def test_constructor_accepts_a_valid_plan() -> None:
    plan = TransferPlan((2, 0, 1), (1, 2))
    assert plan.run_offsets() == [0, 1]
    assert plan == TransferPlan((2, 0, 1), (1, 2))  # a value: compared by content


# ----------------------------------------------------------------------------- tags


def test_the_same_secret_and_index_give_the_same_tag() -> None:
    secret = new_transfer_secret()
    assert len(secret) == TRANSFER_SECRET_BYTES == 16
    assert message_tag(secret, 7) == message_tag(bytes(secret), 7)  # both sides agree
    assert all(0 <= message_tag(secret, index) < 1 << 64 for index in range(100))


def test_different_secrets_give_different_tags() -> None:
    secrets = [new_transfer_secret() for _ in range(64)]
    assert len(set(secrets)) == len(secrets)  # drawn afresh each time
    tags = {message_tag(secret, 0) for secret in secrets}
    assert len(tags) == len(secrets)
    one_bit_off = bytes([secrets[0][0] ^ 1]) + secrets[0][1:]
    assert message_tag(one_bit_off, 0) != message_tag(secrets[0], 0)


def test_message_tags_are_unique_across_transfers_and_layers() -> None:
    num_layers = 30
    tags = [
        message_tag(secret, layer)  # message index = layer
        for secret in (new_transfer_secret() for _ in range(4))
        for layer in range(num_layers)
    ]
    assert len(set(tags)) == len(tags) == 4 * num_layers


def test_tags_are_not_the_old_packed_transfer_id_and_index() -> None:
    """The tag tells nothing of the message index: it is no ``id << 20 | index`` packing, and
    consecutive indices do not give neighbouring tags."""
    secret = new_transfer_secret()
    tags = [message_tag(secret, index) for index in range(256)]
    assert len({tag & ((1 << 20) - 1) for tag in tags}) > 200  # low bits are not the index
    assert len({tag >> 20 for tag in tags}) == len(tags)  # high bits are no shared id


@pytest.mark.parametrize(
    ("secret", "index"),
    [(bytes(15), 0), (bytes(17), 0), (b"", 0), (bytes(16), -1), (bytes(16), 1 << 64)],
)
def test_message_tag_rejects_bad_secrets_and_indices(secret: bytes, index: int) -> None:
    with pytest.raises(ValueError, match="secret|index"):
        message_tag(secret, index)


def test_plan_module_is_torch_free() -> None:
    check = "import splitserve.transfer.plan, sys; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", check], check=True)
