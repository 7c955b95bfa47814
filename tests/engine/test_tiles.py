"""SparseLoCo's chunks: a fragment laid out tile-major, every tile or 1-D run one chunk of the codec."""

import pytest
import torch

from diloco.engine.tiles import TileLayout


def test_a_matrix_is_cut_into_row_major_tiles_each_a_whole_chunk():
    layout = TileLayout([(6, 5)], tile=2)  # 3 x 3 tiles of 2 x 2, the right column half empty
    x = torch.arange(30.0)
    tiled = layout.to_tiles(x).view(-1, 4)
    assert layout.padded_numel == 9 * 4
    assert tiled[0].tolist() == [0, 1, 5, 6]  # rows 0-1, columns 0-1
    assert tiled[1].tolist() == [2, 3, 7, 8]
    assert tiled[2].tolist() == [4, 0, 9, 0]  # the edge tile: its missing column as zeros
    assert tiled[3].tolist() == [10, 11, 15, 16]  # the next band of rows
    assert torch.equal(layout.from_tiles(layout.to_tiles(x)), x)


def test_vectors_take_runs_and_tensors_never_share_a_chunk():
    layout = TileLayout([(5,), (), (2, 2, 2)], tile=2)  # 5 values, a scalar, then a 2 x 4 matrix
    x = torch.arange(1.0, 15.0)
    chunks = layout.to_tiles(x).view(-1, 4)
    assert chunks.tolist() == [[1, 2, 3, 4], [5, 0, 0, 0], [6, 0, 0, 0], [7, 8, 11, 12], [9, 10, 13, 14]]
    assert torch.equal(layout.from_tiles(layout.to_tiles(x)), x)


def test_the_default_tiles_are_sparseloco_64_by_64_in_chunks_of_4096():
    layout = TileLayout([(128, 192), (300,)])
    x = torch.randn(128 * 192 + 300)
    tiled = layout.to_tiles(x)
    assert layout.chunk == 4096 and layout.padded_numel == (2 * 3 + 1) * 4096
    assert torch.equal(tiled[4096:8192].view(64, 64), x[:128 * 192].view(128, 192)[:64, 64:128])
    assert torch.equal(layout.from_tiles(tiled), x)
    with pytest.raises(ValueError, match="expected 24876 values"):
        layout.to_tiles(x[:-1])
