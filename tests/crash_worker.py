"""A writer to be killed: ``python -m tests.crash_worker URL ACKFILE SEED``.

Appends multi-consumer commands as fast as it can from several tasks, and after each commit
returns writes an acknowledgement line (consumers and positions) and flushes it, so the parent
knows exactly which commands it was told succeeded before the SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import uuid

import structlog

from evstore import ConsumerAllocations, EvstoreError, open_store


async def main(url: str, ack_path: str, seed: int) -> None:
    # (evstore logs each command at info; unconfigured, structlog prints that to stdout, which
    # the parent reads only for "ready")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rng = random.Random(seed)
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    async with open_store(url) as store:
        providers = [u for u, _ in await store.providers()]
        print("ready", flush=True)

        async def writer() -> None:
            while True:
                consumers = [str(uuid.uuid4()) for _ in range(3)]
                p = rng.choice(providers)
                body = {
                    c: ConsumerAllocations(
                        allocations={p: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE"
                    )
                    for c in consumers
                }
                try:
                    receipt = await store.write_allocations(body)
                    # release some, so the log mixes event types
                    if rng.random() < 0.3:
                        await store.delete_consumer(consumers[0])
                except EvstoreError:
                    continue
                os.write(
                    fd,
                    (
                        json.dumps({"consumers": consumers, "positions": list(receipt.positions)}) + "\n"
                    ).encode(),
                )

        await asyncio.gather(*(writer() for _ in range(4)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
