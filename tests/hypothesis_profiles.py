"""The suite's hypothesis profiles, and the example counts the state machines run under them.

* ``ci`` (loaded by tests/conftest.py, so what ``python3 dev.py test`` runs): no deadline
  (the machine may be loaded; a slow example is not a failing one), and each state machine
  runs the count it declares with `examples` (the storage state machine 2,000).
* ``quick``: for a fast local round; every test runs at most 10 examples.

Choose one with ``pytest --hypothesis-profile=quick``.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

CI = "ci"
QUICK = "quick"


def register_profiles() -> None:
    settings.register_profile(
        CI,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
    settings.register_profile(QUICK, parent=settings.get_profile(CI), max_examples=10)


def current_profile() -> str:
    """The loaded profile's name (hypothesis' pytest plugin may suffix it, as in
    ``ci-with-verbose-verbosity``)."""
    return settings.get_current_profile_name().split("-with-")[0]


def examples(ci: int) -> int:
    """`ci` under the ci profile; under another, its ``max_examples`` if that is fewer."""
    if current_profile() == CI:
        return ci
    return min(ci, settings.default.max_examples)
