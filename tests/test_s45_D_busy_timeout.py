"""SQLite's ``busy_timeout`` below a millisecond (stop 45, helper D): SQLite counts it in whole
milliseconds, so ``busy_timeout=1e-320`` (or 0.0009) became 0 - a store that never waits for
another process's lock, though the caller asked it to wait. Such a value is now refused at the
call, keyword or URL, with ``evstore.invalid_input`` naming the option and the range; 0 (do not
wait) and a millisecond up still open."""

from __future__ import annotations

import pytest

from evstore import InvalidInput, open_store


@pytest.mark.parametrize("value", [1e-320, 5e-324, 1e-9, 0.0009])
async def test_a_busy_timeout_below_a_millisecond_is_refused(value: float, tmp_path: object) -> None:
    for given in ({"busy_timeout": value}, {}):
        url = f"sqlite:///{tmp_path}/s.db" + ("" if given else f"?busy_timeout={value!r}")
        with pytest.raises(InvalidInput) as caught:
            async with open_store(url, **given):  # type: ignore[arg-type]
                pass
        error = caught.value
        assert error.code == "evstore.invalid_input" and error.details["field"] == "busy_timeout"
        assert "0.001" in error.message and "0 (" in error.message, error.message


@pytest.mark.parametrize("value", [0, 0.0, 0.001, 0.0015, 1, 30.0, 86_400])
async def test_a_busy_timeout_of_zero_or_a_millisecond_up_opens(value: float, tmp_path: object) -> None:
    async with open_store(f"sqlite:///{tmp_path}/s.db", busy_timeout=value) as store:
        assert await store.head() == 0
        assert store.backend.busy_timeout_ms == int(value * 1000)  # type: ignore[attr-defined]
