"""Stop 45, helper J's review of ``Rebuilt`` (what ``rebuild`` answers: an ``int``, the events
folded, with ``.snapshots_dropped``): what the int it replaced did, it does - but msgspec, a
dependency of evstore, encodes no subclass of int."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import msgspec
import pytest

from evstore import Rebuilt, open_store
from tests.conftest import make_provider


async def test_what_rebuild_answers_is_an_int_to_json_pickle_and_another_process() -> None:
    async with open_store("sqlite:///:memory:") as store:
        await make_provider(store, VCPU=4)
        folded = await store.rebuild()
    assert isinstance(folded, Rebuilt) and isinstance(folded, int)
    assert (
        folded == int(folded)
        and hash(folded) == hash(int(folded))
        and json.dumps({"n": folded}) == (f'{{"n": {int(folded)}}}')
    )
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sys; x = pickle.loads(sys.stdin.buffer.read()); "
            "print(int(x), x.snapshots_dropped)",
        ],
        input=pickle.dumps(folded),
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert shown == [str(int(folded)).encode(), str(folded.snapshots_dropped).encode()]


async def test_what_rebuild_answers_encodes_with_msgspec_given_int_as_its_hook() -> None:
    """msgspec encodes no subclass of int (README says so, and what to give it): ``enc_hook=int``."""
    async with open_store("sqlite:///:memory:") as store:
        await make_provider(store, VCPU=4)
        folded = await store.rebuild()
    with pytest.raises(TypeError, match="Rebuilt"):
        msgspec.json.encode({"folded": folded})
    assert msgspec.json.encode({"folded": folded}, enc_hook=int) == b'{"folded":%d}' % int(folded)
