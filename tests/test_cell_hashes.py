"""Every cell of the shipped configs keeps its results path and settings hash.

tests/data/cell_hashes.json was written at 2f5c4dd, before the Layout value replaced
five types and the package was regrouped (#45): a refactor that moved a cell's path or
hash would orphan every result recorded before it (a resumed sweep would run the cell
again, a compare would find it missing). A change that means to move them (a new
setting of a strategy, say) rewrites the file, and says why in its commit.
"""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from parabench.config import cells, load_config

GOLDEN = json.loads((REPO / "tests/data/cell_hashes.json").read_text())


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_shipped_configs_cells_keep_their_paths_and_hashes(name):
    config = load_config(REPO / "config" / name)
    got = sorted(f"{c.spec.path} {c.spec.config_hash()}" for c in cells(config))
    assert got == GOLDEN[name]
