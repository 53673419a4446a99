"""How the workers share the tests (tests/helpers/scheduling.py): the modules run whole on one worker
exist and each has a module fixture to share, and node ids name their module as SHARED_RUNS does."""

from __future__ import annotations

from tests.helpers.run import REPO
from tests.helpers.scheduling import SHARED_RUNS, unit_of


def test_each_module_run_whole_exists_and_has_a_module_fixture():
    for path in sorted(SHARED_RUNS):
        assert 'scope="module"' in (REPO / path).read_text(), path


def test_a_shared_runs_module_is_one_unit_and_any_other_test_its_own(request):
    own = request.node.nodeid
    # the form xdist hands node ids in, and SHARED_RUNS' paths take: relative to the checkout
    assert own.split("::", 1)[0] == "tests/test_scheduling.py"
    assert unit_of(own) == own
    first, second = "tests/compare/test_compare.py::test_a", "tests/compare/test_compare.py::test_b[adamw]"
    assert unit_of(first) == unit_of(second) == "tests/compare/test_compare.py"
