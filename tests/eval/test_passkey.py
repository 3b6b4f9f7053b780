"""Passkey retrieval: the scorer on given strings, the grid of cells from the tiny model of a run
directory (deterministic, independent of the batch size), its table and heat map, bad grids."""

import pytest

from nsa.eval.passkey import (
    PasskeyCell,
    cell_keys,
    passkey_accuracy,
    passkey_correct,
    passkey_table,
    save_heatmap,
)
from nsa.train.checkpoint import load_model
from nsa.train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only wait
BYTES = ByteTokenizer()


@pytest.mark.parametrize("generated, right", [
    (" 71432", True), ("71432", True), (" 71432.", True), ("\n 71432 is it", True),
    (" 7143", False), (" 714321", False), (" 71433", False), ("", False), (" key 71432", False),
    (" 71 432", False), ("71432"[::-1], False),
])
def test_the_answer_is_the_first_run_of_digits(generated, right):
    assert passkey_correct(generated, "71432") is right


@pytest.fixture(scope="module")
def tiny_model(run_dir):
    return load_model(run_dir)[1]


def test_the_tiny_model_gets_a_cell_per_length_and_depth(tiny_model):
    cells = passkey_accuracy(tiny_model, BYTES, [96, 128], [0, 50, 100], trials=3, seed=1,
                             batch_size=2)
    assert [(c.length, c.depth, c.trials) for c in cells] == [
        (length, depth, 3) for length in (96, 128) for depth in (0, 50, 100)]
    assert all(0 <= c.correct <= 3 and 0.0 <= c.accuracy <= 1.0 for c in cells)
    again = passkey_accuracy(tiny_model, BYTES, [96, 128], [0, 50, 100], trials=3, seed=1,
                             batch_size=3)
    assert again == cells


def test_keys_depend_on_seed_length_and_depth_only():
    keys = cell_keys(0, 128, 50, 20)
    assert keys == cell_keys(0, 128, 50, 20) and len(set(keys)) > 15
    assert keys[:5] == cell_keys(0, 128, 50, 5)
    assert all(cell_keys(*other, 20) != keys for other in [(1, 128, 50), (0, 96, 50),
                                                           (0, 128, 50.5)])


@pytest.mark.parametrize("lengths, depths, trials, message", [
    ([129], [50], 1, "passkey length 129 is outside \\[79, 128\\]"),
    ([78], [50], 1, "passkey length 78 is outside \\[79, 128\\]"),
    ([128], [-5], 1, "passkey depth -5 is outside \\[0, 100\\]"),
    ([128], [100.5], 1, "passkey depth 100.5 is outside"),
    ([128], [50], 0, "passkey trials must be >= 1"),
    ([], [50], 1, "at least one length"),
    ([128, 96, 128], [50], 1, "must be distinct"),
    ([128], [0, 50, 0], 1, "must be distinct"),
])
def test_a_bad_grid_is_named(tiny_model, lengths, depths, trials, message):
    with pytest.raises(ValueError, match=message):
        passkey_accuracy(tiny_model, BYTES, lengths, depths, trials)


CELLS = [PasskeyCell(length, depth, 4, correct) for (length, depth), correct in zip(
    [(2048, 0.0), (2048, 12.5), (2048, 100.0), (4096, 0.0), (4096, 12.5), (4096, 100.0)],
    [4, 3, 0, 2, 1, 4], strict=True)]


def test_the_table_has_a_row_per_length_and_a_column_per_depth():
    assert passkey_table(CELLS).splitlines() == [
        "length \\ depth      0%   12.5%    100%",
        "          2048    1.00    0.75    0.00",
        "          4096    0.50    0.25    1.00",
    ]


def test_the_heat_map_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    save_heatmap(CELLS, tmp_path / "passkey.png", "passkey retrieval")
    assert (tmp_path / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["passkey.png"]  # no temporary file left
