"""Stop 45, helper E: ``rebuild`` answers a ``Rebuilt`` (an ``int`` with ``snapshots_dropped``).
An int can be copied and pickled (a result handed to another process, kept in a cache); the
subclass's ``__new__`` takes two arguments, and ``copy.copy``, ``copy.deepcopy`` and ``pickle``
(protocol 2 and above) call it with the int's one: TypeError."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from evstore import open_store
from evstore.store import Rebuilt
from tests.conftest import make_provider


@pytest.mark.parametrize(
    "again",
    [copy.copy, copy.deepcopy, *(lambda r, p=p: pickle.loads(pickle.dumps(r, p)) for p in range(6))],
)
def test_a_rebuilt_survives_copy_and_pickle(again: object) -> None:
    rebuilt = Rebuilt(7, 2)
    made = again(rebuilt)  # type: ignore[operator]
    assert type(made) is Rebuilt and made == 7 and made.snapshots_dropped == 2


async def test_what_rebuild_answers_is_an_int_in_every_way(sqlite_url: str) -> None:
    async with open_store(sqlite_url, snapshot_every=1) as store:
        await make_provider(store, "rp", VCPU=4)
        await store.take_snapshots()
        rebuilt = await store.rebuild()
        assert rebuilt == await store.head() and rebuilt.snapshots_dropped >= 1
        assert isinstance(rebuilt, int) and hash(rebuilt) == hash(int(rebuilt))
        assert json.dumps({"folded": rebuilt}) == json.dumps({"folded": int(rebuilt)})
        assert (str(rebuilt), repr(rebuilt)) == (str(int(rebuilt)), repr(int(rebuilt)))
        back = pickle.loads(pickle.dumps(rebuilt))
        assert back == rebuilt and back.snapshots_dropped == rebuilt.snapshots_dropped
