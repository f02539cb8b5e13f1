"""The key-correctness matrix (``tests/helpers/key_matrix.py``): the MISS cases of a changed
wheel (a version bumped, a wheel rebuilt, a libraries variant, a CUDA runtime), each installed
by pip."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import needs_cute
from tests.helpers.key_matrix import PACKAGE_MISSES, Miss, World, build_world, check_miss

pytestmark = [pytest.mark.slow, needs_cute]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("case", PACKAGE_MISSES, ids=[case.id for case in PACKAGE_MISSES])
def test_relevant_perturbation_misses_and_explain_names_it(
    world: World, case: Miss, tmp_path: Path
) -> None:
    check_miss(world, case, tmp_path)
