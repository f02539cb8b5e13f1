"""The key-correctness matrix (``tests/helpers/key_matrix.py``): every MISS case but a changed
wheel's (tests/test_key_matrix_packages.py): the GPUs, the spec, the kernels' sources, settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import needs_cute
from tests.helpers.key_matrix import OTHER_MISSES, Miss, World, build_world, check_miss

pytestmark = [pytest.mark.slow, needs_cute]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("case", OTHER_MISSES, ids=[case.id for case in OTHER_MISSES])
def test_relevant_perturbation_misses_and_explain_names_it(
    world: World, case: Miss, tmp_path: Path
) -> None:
    check_miss(world, case, tmp_path)
