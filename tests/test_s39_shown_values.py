"""Stop 39: a value a person gave, quoted in a refusal, is cut with an ellipsis when long (a cut
quote read as the whole value), and an integer of thousands of digits is said to be one (its
``repr`` raises ``ValueError`` past 4,300 digits, which escaped as Python's error, not evstore's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evstore import InvalidInput, open_store
from evstore.errors import shown
from tests.conftest import make_provider

HUGE = 10**5000


def test_shown_cuts_long_values_with_an_ellipsis_and_names_huge_integers() -> None:
    assert shown("abc") == "'abc'"
    long = shown("x" * 500, 80)
    assert len(long) == 81 and long.endswith("…") and long.startswith("'xxx")
    assert shown(2**64) == str(2**64)
    assert shown(HUGE) == "an integer of more than 4300 digits"
    assert shown(-HUGE) == "an integer of more than 4300 digits"
    assert shown(10**45) == shown(-(10**45)) == "an integer of 46 digits"  # (stop 48)

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert shown(Broken()) == "a Broken"


async def test_a_long_uuid_is_quoted_cut_with_an_ellipsis(store_url: str) -> None:
    async with open_store(store_url) as store:
        with pytest.raises(InvalidInput) as info:
            await store.create_provider("z" * 300, "n")
        assert "…" in info.value.message and "z" * 81 not in info.value.message
        assert await store.head() == 0


@pytest.mark.parametrize("option", ["max_batch", "poll_interval", "snapshot_every"])
async def test_a_huge_integer_option_is_invalid_input(tmp_path: Path, option: str) -> None:
    with pytest.raises(InvalidInput, match=r"an integer of more than 4300 digits|past 64 bits") as info:
        async with open_store(f"sqlite:///{tmp_path / 'x.db'}", **{option: HUGE}):  # type: ignore[misc]
            pass
    assert info.value.details["field"] == option


async def test_huge_integers_given_as_flags_are_invalid_input(store_url: str) -> None:
    async with open_store(store_url) as store:
        await make_provider(store, VCPU=1)
        with pytest.raises(InvalidInput, match="history must be True or False"):
            await store.audit(history=HUGE)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="must be True or False"):
            await store.rebuild(full=HUGE)  # type: ignore[arg-type]
