"""The key-correctness matrix (``tests/helpers/key_matrix.py``): its HIT cases, and its size.

The MISS cases are in tests/test_key_matrix_packages.py and tests/test_key_matrix_misses.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelcache.stamp import DEFAULT_DISTRIBUTIONS
from tests.conftest import dsl_declared_settings, needs_cute
from tests.helpers.key_matrix import (
    CUTE_DSL_SWITCHES,
    HITS,
    MISSES,
    Hit,
    World,
    build_world,
    check_hit,
)

pytestmark = [pytest.mark.slow, needs_cute]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("case", HITS, ids=[case.id for case in HITS])
def test_irrelevant_perturbation_hits(world: World, case: Hit, tmp_path: Path) -> None:
    check_hit(world, case, tmp_path)


def test_matrix_has_the_required_size() -> None:
    """The requirement: at least 20 irrelevant perturbations that HIT, 15 relevant that MISS."""
    assert len({case.id for case in HITS}) == len(HITS) >= 20
    assert len({case.id for case in MISSES}) == len(MISSES) >= 15
    assert {f"version-{name}" for name in DEFAULT_DISTRIBUTIONS} <= {case.id for case in MISSES}


def test_cute_dsl_switches_are_the_dsls_list() -> None:
    """Each setting the installed DSL marks as affecting compile has its case, ARCH aside (the
    arch case): a setting a new DSL adds fails here until it has one."""
    declared = {name for name, marked in dsl_declared_settings().items() if marked}
    assert set(CUTE_DSL_SWITCHES) == declared - {"CUTE_DSL_ARCH"}
