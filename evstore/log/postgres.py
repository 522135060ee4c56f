"""The PostgreSQL backend: many processes on many machines share one database (asyncpg, a pool).

**Parallel writers.** Each command runs in its own READ COMMITTED transaction on a pooled
connection. It first takes ``pg_advisory_xact_lock`` on hashed keys of the entities it touches
(consumers, providers, provider names, the custom class it creates, its idempotency key), in
sorted order; the loader then follows consumers to their providers and migrations, and any entity
discovered beyond what is locked is locked too - directly if its key sorts after every held key;
otherwise only if it is free at once (``pg_try_advisory_xact_lock``, which never waits), and
failing that the transaction restarts with the whole set locked in order. Nothing ever waits for a lock out of
order, so lock waits never form a cycle.
Commands on disjoint entities therefore commit in parallel; commands sharing one are serialised.
A deadlock (40P01) or serialization failure (40001) reported by the server is retried.

**Positions: gap-free, assigned after commit.** A writer inserts its events with
``position`` NULL, an internal ``seq`` (bigserial, may have gaps) and
``transaction_id xid8 DEFAULT pg_current_xact_id()``, and commits. A *sequencer* then - in a short
transaction of its own, under one advisory lock - gives every committed, not yet positioned event
the next positions (``tail + 1 ...``, ordered by ``(transaction_id, seq)`` so a transaction's
events stay contiguous and in order), the ``recorded_at`` time (the server's clock: one clock for
every client, never going backwards) and the hash chain, and commits.
Whoever commits runs it (coalesced in-process), and so does a reader that finds positionless
events (a writer may have died between its commit and the sequencing), so nothing waits for a
particular process. Why this is safe for a position cursor (``read(after)``, ``subscribe``):

- only the sequencer assigns positions, one run at a time, each run above the previous tail;
  a run commits (becomes visible) before it releases the lock, so the next run starts after it.
  A snapshot that sees a run therefore sees every earlier run: **the visible positions are always
  exactly 1..head**, never a prefix with holes, so ``position > after`` can neither skip nor repeat;
- events are positioned only once committed and visible: an aborted transaction's events are
  never positioned, so committed positions have **no gaps** (the audit's gap check holds as is);
- a position is final once visible, and the hash chain is computed in position order by the
  single sequencer, so the chain is the same as SQLite's (``events.event_hash``).

Positions follow the order in which the sequencer sees commits: an event committed before a run
starts is positioned before every event committed after that run; within one run the order is
``(transaction_id, seq)``. This is the transaction-id technique applied once, by the sequencer,
instead of by every reader: readers keep an ``int`` cursor. The sequencer needs no
``pg_snapshot_xmin`` horizon because it orders by *when it sees* commits rather than by ids
fixed before commit; the horizon would only make every receipt wait for the oldest write
transaction in the whole cluster. The price is a second short transaction per commit (shared by
all commits that finish meanwhile) and one serialised step in the write path: contention is on
a few row updates, never on a command.

**Position-valued projection fields** (a consumer's ``allocated_at`` and ``deleted_at``) are
written before positions exist: the write path folds with ``-seq`` as the position, and the
``p_consumers_resolved`` view turns a negative value into the event's position once assigned.
Rebuild writes real positions.

**A consistent (projection, head) pair** - what the audit and rebuild need - must not fall
between a writer's commit and its sequencing: writers hold a shared advisory "fence" lock for the
length of their transaction; ``load_state`` and ``rebuild`` take it exclusively (waiting for the
writers in flight, holding new ones back), run the sequencer, then read. Plain queries do not.

**Round trips.** A command costs five: ``BEGIN``; ``evstore_lock_load_near`` (take the locks,
then load the slice ``decide`` reads, each read with a snapshot taken after the locks);
``evstore_write`` (insert the events in order, their entity index rows and every projection
change); ``COMMIT``; and ``evstore_sequence`` in a transaction of its own, which returns the
events' positions (or finds them already positioned by another process's run and returns at
once). Python decides between the second and the third. A command that names consumers only (a
release, a revert) discovers their providers while loading. The entities its consumers were last
loaded with by this process are guessed and locked in the same load, each only if it is free at
once (a guess never waits); whatever the load finds beyond its locks costs one more load,
preceded by a try-lock when it sorts before a held key (a restart, three round trips more, only
if one is busy). The command's own events are folded before they have seqs, at ``OWN_EVENT - index``;
``evstore_write`` turns those into ``-seq`` as above. The functions' statements use generic plans
(``plan_cache_mode``): planning them on each call cost more than running them.

Schema changes are versioned migrations run on open under an advisory lock (safe when several
processes open at once). Faults (a connection killed mid-command) fail that command with
:class:`StorageError` - rolled back, or, if the connection died during COMMIT, with
``details["outcome_unknown"]`` set (retry with the same idempotency key) - and the pool replaces
the connection. The ``xid8`` column only orders events within one sequencer run, so a logical
dump and restore (which does not keep transaction ids) loses nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import hashlib
import heapq
import itertools
import logging
import random
import re
import socket
import ssl
import uuid as _uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import asyncpg  # type: ignore[import-untyped,unused-ignore]

from evstore import errors as err
from evstore.commands import CreateResourceClass, Needs, decide
from evstore.errors import shown
from evstore.events import EventBase, RecordedEvent, untrack_rows
from evstore.log import (
    HISTORY_EXAMPLES,
    MAX_POSITION,
    STORE_KEYWORDS,
    CallbackFailed,
    HistoryCheck,
    Job,
    LostTail,
    Outcome,
    PayloadRow,
    RawEvent,
    Rebuilt,
    Receipt,
    SchemaRepair,
    carried,
    check_held_amount,
    follows_on,
    store_keyword_hint,
)
from evstore.log.sqlite import decode_rows, history_keys, imported_keys, parse_version
from evstore.logs import get_logger
from evstore.schema import (
    flag_option_from_url,
    validate_flag_option,
    validate_int_option,
    validate_seconds_option,
)
from projections import persisted
from projections.exchange import duplicate_id
from projections.gcpause import gc_paused
from projections.replay import fold_payloads, replay
from projections.state import ConsumerState, State, dismantle, evolve
from projections.views import UsageGroup, groups_from_rows

log = get_logger("evstore.postgres")
T = TypeVar("T")

SCHEMA_VERSION = 9

#: Migration ``n`` brings the schema from version ``n`` to ``n + 1``.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE evstore_meta (key text PRIMARY KEY, value text NOT NULL);
    CREATE TABLE events (
        seq bigserial PRIMARY KEY,
        transaction_id xid8 NOT NULL DEFAULT pg_current_xact_id(),
        position bigint UNIQUE,
        event_id text NOT NULL UNIQUE,
        type text NOT NULL,
        schema_version integer NOT NULL,
        data text NOT NULL,
        metadata text NOT NULL,
        recorded_at text,
        hash text
    );
    CREATE INDEX events_unpositioned ON events (transaction_id, seq) WHERE position IS NULL;
    CREATE INDEX events_recorded_at ON events (recorded_at) WHERE position IS NOT NULL;
    CREATE TABLE event_entities (entity text NOT NULL, seq bigint NOT NULL, PRIMARY KEY (entity, seq));
    CREATE TABLE idempotency (key text PRIMARY KEY, fingerprint text NOT NULL, receipt text NOT NULL);
    CREATE TABLE p_providers (
        uuid text PRIMARY KEY, name text NOT NULL, parent text, root text NOT NULL,
        generation bigint NOT NULL, inventories text NOT NULL, usages text NOT NULL
    );
    CREATE INDEX p_providers_name ON p_providers (name);
    CREATE INDEX p_providers_parent ON p_providers (parent);
    CREATE TABLE p_consumers (
        uuid text PRIMARY KEY, project_id text, user_id text, consumer_type text, generation bigint,
        deleted integer NOT NULL, deleted_at bigint, on_behalf_of text, allocated_at bigint
    );
    CREATE INDEX p_consumers_behalf ON p_consumers (on_behalf_of);
    CREATE INDEX p_consumers_project ON p_consumers (project_id, user_id);
    CREATE TABLE p_allocations (
        consumer text NOT NULL, provider text NOT NULL, rc text NOT NULL, used bigint NOT NULL,
        PRIMARY KEY (consumer, provider, rc)
    );
    CREATE INDEX p_allocations_provider ON p_allocations (provider);
    CREATE TABLE p_classes (name text PRIMARY KEY);
    CREATE VIEW p_consumers_resolved AS
    SELECT c.uuid, c.project_id, c.user_id, c.consumer_type, c.generation, c.deleted,
           CASE WHEN c.deleted_at < 0
                THEN coalesce((SELECT e.position FROM events e WHERE e.seq = -c.deleted_at), c.deleted_at)
                ELSE c.deleted_at END AS deleted_at,
           c.on_behalf_of,
           CASE WHEN c.allocated_at < 0
                THEN coalesce((SELECT e.position FROM events e WHERE e.seq = -c.allocated_at), c.allocated_at)
                ELSE c.allocated_at END AS allocated_at
    FROM p_consumers c;
    CREATE FUNCTION evstore_lock(fence bigint, keys bigint[]) RETURNS void LANGUAGE plpgsql AS $$
    DECLARE k bigint;
    BEGIN
        IF fence IS NOT NULL THEN PERFORM pg_advisory_xact_lock_shared(fence); END IF;
        FOREACH k IN ARRAY keys LOOP PERFORM pg_advisory_xact_lock(k); END LOOP;
    END $$;
    """,
    # 2: snapshots of the folded state, a cache for time travel (see projections/snapshots.py)
    """
    CREATE TABLE snapshots (
        position bigint PRIMARY KEY, event_hash text NOT NULL, format integer NOT NULL, state text NOT NULL
    );
    """,
    # 3: the write path in three statements (see "Round trips" in the module doc). Functions
    # only: the tables are unchanged, so a store of version 2 is upgraded in place.
    r"""
    CREATE OR REPLACE FUNCTION evstore_lock_load(
        fence bigint, keys bigint[], want_consumers text[], migrations_of text[], provider_names text[],
        children_of text[], want_providers text[], custom_classes text[]
    ) RETURNS TABLE (
        kind smallint, t1 text, t2 text, t3 text, t4 text, t5 text, t6 text,
        b1 bigint, b2 bigint, b3 bigint, b4 bigint
    ) LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
    DECLARE cs text[]; ps text[];
    BEGIN
        PERFORM evstore_lock(fence, keys);
        cs := ARRAY(SELECT unnest(want_consumers)
                    UNION SELECT c.uuid FROM p_consumers c WHERE c.on_behalf_of = ANY(migrations_of));
        cs := cs || ARRAY(SELECT DISTINCT c.on_behalf_of FROM p_consumers c
                          WHERE c.uuid = ANY(cs) AND c.on_behalf_of IS NOT NULL
                            AND NOT c.on_behalf_of = ANY(cs));
        ps := ARRAY(SELECT unnest(want_providers)
                    UNION SELECT a.provider FROM p_allocations a WHERE a.consumer = ANY(cs)
                    UNION SELECT p.uuid FROM p_providers p WHERE p.name = ANY(provider_names)
                    UNION SELECT p.uuid FROM p_providers p WHERE p.parent = ANY(children_of));
        RETURN QUERY
            SELECT 1::smallint, c.uuid, c.project_id, c.user_id, c.consumer_type, c.on_behalf_of, NULL::text,
                   c.generation, c.deleted::bigint, c.deleted_at, c.allocated_at
            FROM p_consumers_resolved c WHERE c.uuid = ANY(cs)
            UNION ALL
            SELECT 2::smallint, a.consumer, a.provider, a.rc, NULL, NULL, NULL, a.used, NULL, NULL, NULL
            FROM p_allocations a WHERE a.consumer = ANY(cs)
            UNION ALL
            SELECT 3::smallint, p.uuid, p.name, p.parent, p.root, p.inventories, p.usages,
                   p.generation, NULL, NULL, NULL
            FROM p_providers p WHERE p.uuid = ANY(ps)
            UNION ALL
            SELECT 4::smallint, n.name, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
            FROM p_classes n WHERE n.name = ANY(custom_classes)
            ORDER BY 1, 2, 3, 4;
    END $$;

    CREATE OR REPLACE FUNCTION evstore_write(
        e_ids text[], e_types text[], e_versions integer[], e_data text[], e_metadata text,
        entity_names text[], entity_events integer[],
        del_providers text[],
        p_uuid text[], p_name text[], p_parent text[], p_root text[], p_generation bigint[],
        p_inventories text[], p_usages text[],
        del_consumers text[], del_allocations text[],
        c_uuid text[], c_project text[], c_user text[], c_type text[], c_generation bigint[],
        c_deleted integer[], c_deleted_at bigint[], c_behalf text[], c_allocated_at bigint[],
        a_consumer text[], a_provider text[], a_rc text[], a_used bigint[],
        new_classes text[]
    ) RETURNS bigint[] LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
    DECLARE seqs bigint[] := '{}'; s bigint; k integer;
    BEGIN
        -- one INSERT per event, in order: seqs follow the command's event order
        FOR k IN 1 .. coalesce(array_length(e_ids, 1), 0) LOOP
            INSERT INTO events (event_id, type, schema_version, data, metadata)
            VALUES (e_ids[k], e_types[k], e_versions[k], e_data[k], e_metadata) RETURNING seq INTO s;
            seqs := seqs || s;
        END LOOP;
        INSERT INTO event_entities SELECT u.n, seqs[u.e] FROM unnest(entity_names, entity_events) AS u(n, e)
        ON CONFLICT DO NOTHING;
        DELETE FROM p_providers WHERE uuid = ANY(del_providers);
        INSERT INTO p_providers
        SELECT * FROM unnest(p_uuid, p_name, p_parent, p_root, p_generation, p_inventories, p_usages)
        ON CONFLICT (uuid) DO UPDATE SET
            name = EXCLUDED.name, parent = EXCLUDED.parent, root = EXCLUDED.root,
            generation = EXCLUDED.generation, inventories = EXCLUDED.inventories, usages = EXCLUDED.usages;
        DELETE FROM p_allocations WHERE consumer = ANY(del_allocations);
        DELETE FROM p_consumers WHERE uuid = ANY(del_consumers);
        -- positions of this command's own events were folded as -(2^62 + index): the events'
        -- -seq, like every position written before the sequencer runs (see p_consumers_resolved)
        INSERT INTO p_consumers
        SELECT u.uuid, u.project, u.usr, u.ctype, u.gen, u.deleted,
               CASE WHEN u.deleted_at <= -4611686018427387904
                    THEN -seqs[(-u.deleted_at - 4611686018427387904)::integer + 1] ELSE u.deleted_at END,
               u.behalf,
               CASE WHEN u.allocated_at <= -4611686018427387904
                    THEN -seqs[(-u.allocated_at - 4611686018427387904)::integer + 1] ELSE u.allocated_at END
        FROM unnest(c_uuid, c_project, c_user, c_type, c_generation, c_deleted, c_deleted_at, c_behalf,
                    c_allocated_at)
             AS u(uuid, project, usr, ctype, gen, deleted, deleted_at, behalf, allocated_at)
        ON CONFLICT (uuid) DO UPDATE SET
            project_id = EXCLUDED.project_id, user_id = EXCLUDED.user_id,
            consumer_type = EXCLUDED.consumer_type, generation = EXCLUDED.generation,
            deleted = EXCLUDED.deleted, deleted_at = EXCLUDED.deleted_at,
            on_behalf_of = EXCLUDED.on_behalf_of, allocated_at = EXCLUDED.allocated_at;
        INSERT INTO p_allocations SELECT * FROM unnest(a_consumer, a_provider, a_rc, a_used);
        INSERT INTO p_classes SELECT * FROM unnest(new_classes) ON CONFLICT DO NOTHING;
        RETURN seqs;
    END $$;

    -- the positions of these seqs, in their order (NULL: not positioned, or no such event)
    CREATE OR REPLACE FUNCTION evstore_positions(want bigint[]) RETURNS bigint[] LANGUAGE sql STABLE AS $$
        SELECT ARRAY(SELECT (SELECT e.position FROM events e WHERE e.seq = w.s)
                     FROM unnest(want) WITH ORDINALITY AS w(s, o) ORDER BY w.o)
    $$;

    CREATE OR REPLACE FUNCTION evstore_sequence(lock_key bigint, wait boolean, want bigint[],
                                     OUT positioned bigint, OUT positions bigint[])
    LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
    DECLARE pos bigint; prev text; last_at text; stamp text; r record;
    BEGIN
        positioned := 0;
        -- events in ``want`` already positioned (by another process's run): nothing to wait for
        positions := evstore_positions(want);
        IF cardinality(want) > 0 AND array_position(positions, NULL) IS NULL THEN
            RETURN;
        END IF;
        IF wait THEN
            PERFORM pg_advisory_xact_lock(lock_key);
        ELSIF NOT pg_try_advisory_xact_lock(lock_key) THEN
            RETURN;  -- another run holds it: that run (or the writer's own next one) positions them
        END IF;
        IF cardinality(want) > 0 THEN  -- the run we waited for may have positioned them
            positions := evstore_positions(want);
            IF array_position(positions, NULL) IS NULL THEN
                RETURN;
            END IF;
        END IF;
        SELECT e.position, e.hash, e.recorded_at INTO pos, prev, last_at
        FROM events e WHERE e.position IS NOT NULL ORDER BY e.position DESC LIMIT 1;
        IF NOT FOUND THEN
            pos := 0; prev := repeat('0', 64); last_at := '';
        ELSIF prev IS NULL OR last_at IS NULL THEN
            RAISE EXCEPTION 'the event at position % has no hash or time: the log is damaged', pos;
        END IF;
        stamp := to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US') || '+00:00';
        IF stamp < last_at THEN
            stamp := last_at;  -- never goes backwards
        END IF;
        FOR r IN SELECT e.seq, e.event_id, e.type, e.schema_version, e.data, e.metadata FROM events e
                 WHERE e.position IS NULL ORDER BY e.transaction_id, e.seq LOOP
            pos := pos + 1;
            prev := encode(sha256(convert_to(concat_ws(chr(31), prev, pos::text, r.event_id, r.type,
                    r.schema_version::text, r.data, r.metadata, stamp), 'UTF8')), 'hex');
            UPDATE events SET position = pos, hash = prev, recorded_at = stamp WHERE seq = r.seq;
            positioned := positioned + 1;
        END LOOP;
        positions := evstore_positions(want);
    END $$;
    """,
    # 4: the sequencer waits for its lock however the URL sets lock_timeout: it runs after the
    # command committed, so a timeout there failed a command that had succeeded
    """
    ALTER FUNCTION evstore_sequence(bigint, boolean, bigint[]) SET lock_timeout = 0;
    """,
    # 5: a migration consumer keeps its instance's consumer type (a revert gives it back to the
    # instance, absent by then); the open then refolds the projection to fill it (see open)
    r"""
    ALTER TABLE p_consumers ADD COLUMN IF NOT EXISTS instance_type text;
    CREATE OR REPLACE VIEW p_consumers_resolved AS
    SELECT c.uuid, c.project_id, c.user_id, c.consumer_type, c.generation, c.deleted,
           CASE WHEN c.deleted_at < 0
                THEN coalesce((SELECT e.position FROM events e WHERE e.seq = -c.deleted_at), c.deleted_at)
                ELSE c.deleted_at END AS deleted_at,
           c.on_behalf_of,
           CASE WHEN c.allocated_at < 0
                THEN coalesce((SELECT e.position FROM events e WHERE e.seq = -c.allocated_at), c.allocated_at)
                ELSE c.allocated_at END AS allocated_at,
           c.instance_type
    FROM p_consumers c;
    DROP FUNCTION IF EXISTS evstore_write(
        text[], text[], integer[], text[], text, text[], integer[], text[], text[], text[], text[], text[],
        bigint[], text[], text[], text[], text[], text[], text[], text[], text[], bigint[], integer[],
        bigint[], text[], bigint[], text[], text[], text[], bigint[], text[]
    );
    CREATE OR REPLACE FUNCTION evstore_lock_load(
        fence bigint, keys bigint[], want_consumers text[], migrations_of text[], provider_names text[],
        children_of text[], want_providers text[], custom_classes text[]
    ) RETURNS TABLE (
        kind smallint, t1 text, t2 text, t3 text, t4 text, t5 text, t6 text,
        b1 bigint, b2 bigint, b3 bigint, b4 bigint
    ) LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
    DECLARE cs text[]; ps text[];
    BEGIN
        PERFORM evstore_lock(fence, keys);
        cs := ARRAY(SELECT unnest(want_consumers)
                    UNION SELECT c.uuid FROM p_consumers c WHERE c.on_behalf_of = ANY(migrations_of));
        cs := cs || ARRAY(SELECT DISTINCT c.on_behalf_of FROM p_consumers c
                          WHERE c.uuid = ANY(cs) AND c.on_behalf_of IS NOT NULL
                            AND NOT c.on_behalf_of = ANY(cs));
        ps := ARRAY(SELECT unnest(want_providers)
                    UNION SELECT a.provider FROM p_allocations a WHERE a.consumer = ANY(cs)
                    UNION SELECT p.uuid FROM p_providers p WHERE p.name = ANY(provider_names)
                    UNION SELECT p.uuid FROM p_providers p WHERE p.parent = ANY(children_of));
        RETURN QUERY
            SELECT 1::smallint, c.uuid, c.project_id, c.user_id, c.consumer_type, c.on_behalf_of,
                   c.instance_type, c.generation, c.deleted::bigint, c.deleted_at, c.allocated_at
            FROM p_consumers_resolved c WHERE c.uuid = ANY(cs)
            UNION ALL
            SELECT 2::smallint, a.consumer, a.provider, a.rc, NULL, NULL, NULL, a.used, NULL, NULL, NULL
            FROM p_allocations a WHERE a.consumer = ANY(cs)
            UNION ALL
            SELECT 3::smallint, p.uuid, p.name, p.parent, p.root, p.inventories, p.usages,
                   p.generation, NULL, NULL, NULL
            FROM p_providers p WHERE p.uuid = ANY(ps)
            UNION ALL
            SELECT 4::smallint, n.name, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
            FROM p_classes n WHERE n.name = ANY(custom_classes)
            ORDER BY 1, 2, 3, 4;
    END $$;

    CREATE OR REPLACE FUNCTION evstore_write(
        e_ids text[], e_types text[], e_versions integer[], e_data text[], e_metadata text,
        entity_names text[], entity_events integer[],
        del_providers text[],
        p_uuid text[], p_name text[], p_parent text[], p_root text[], p_generation bigint[],
        p_inventories text[], p_usages text[],
        del_consumers text[], del_allocations text[],
        c_uuid text[], c_project text[], c_user text[], c_type text[], c_generation bigint[],
        c_deleted integer[], c_deleted_at bigint[], c_behalf text[], c_allocated_at bigint[],
        a_consumer text[], a_provider text[], a_rc text[], a_used bigint[],
        new_classes text[], c_instance_type text[]
    ) RETURNS bigint[] LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
    DECLARE seqs bigint[] := '{}'; s bigint; k integer;
    BEGIN
        -- one INSERT per event, in order: seqs follow the command's event order
        FOR k IN 1 .. coalesce(array_length(e_ids, 1), 0) LOOP
            INSERT INTO events (event_id, type, schema_version, data, metadata)
            VALUES (e_ids[k], e_types[k], e_versions[k], e_data[k], e_metadata) RETURNING seq INTO s;
            seqs := seqs || s;
        END LOOP;
        INSERT INTO event_entities SELECT u.n, seqs[u.e] FROM unnest(entity_names, entity_events) AS u(n, e)
        ON CONFLICT DO NOTHING;
        DELETE FROM p_providers WHERE uuid = ANY(del_providers);
        INSERT INTO p_providers
        SELECT * FROM unnest(p_uuid, p_name, p_parent, p_root, p_generation, p_inventories, p_usages)
        ON CONFLICT (uuid) DO UPDATE SET
            name = EXCLUDED.name, parent = EXCLUDED.parent, root = EXCLUDED.root,
            generation = EXCLUDED.generation, inventories = EXCLUDED.inventories, usages = EXCLUDED.usages;
        DELETE FROM p_allocations WHERE consumer = ANY(del_allocations);
        DELETE FROM p_consumers WHERE uuid = ANY(del_consumers);
        -- positions of this command's own events were folded as -(2^62 + index): the events'
        -- -seq, like every position written before the sequencer runs (see p_consumers_resolved)
        INSERT INTO p_consumers
        SELECT u.uuid, u.project, u.usr, u.ctype, u.gen, u.deleted,
               CASE WHEN u.deleted_at <= -4611686018427387904
                    THEN -seqs[(-u.deleted_at - 4611686018427387904)::integer + 1] ELSE u.deleted_at END,
               u.behalf,
               CASE WHEN u.allocated_at <= -4611686018427387904
                    THEN -seqs[(-u.allocated_at - 4611686018427387904)::integer + 1] ELSE u.allocated_at END,
               u.itype
        FROM unnest(c_uuid, c_project, c_user, c_type, c_generation, c_deleted, c_deleted_at, c_behalf,
                    c_allocated_at, c_instance_type)
             AS u(uuid, project, usr, ctype, gen, deleted, deleted_at, behalf, allocated_at, itype)
        ON CONFLICT (uuid) DO UPDATE SET
            project_id = EXCLUDED.project_id, user_id = EXCLUDED.user_id,
            consumer_type = EXCLUDED.consumer_type, generation = EXCLUDED.generation,
            deleted = EXCLUDED.deleted, deleted_at = EXCLUDED.deleted_at,
            on_behalf_of = EXCLUDED.on_behalf_of, allocated_at = EXCLUDED.allocated_at,
            instance_type = EXCLUDED.instance_type;
        INSERT INTO p_allocations SELECT * FROM unnest(a_consumer, a_provider, a_rc, a_used);
        INSERT INTO p_classes SELECT * FROM unnest(new_classes) ON CONFLICT DO NOTHING;
        RETURN seqs;
    END $$;
    """,
    # 6: the sequencer looks its positions up in its own statements (planned once per session, as
    # plpgsql caches them) rather than through evstore_positions, a SQL function planned anew at
    # each of its three calls per run: 0.44-0.52 -> 0.31-0.35 ms of the server's time per run
    # (pg_stat_user_functions over 2,000 sequential commands). Functions only.
    r"""
    CREATE OR REPLACE FUNCTION evstore_sequence(lock_key bigint, wait boolean, want bigint[],
                                     OUT positioned bigint, OUT positions bigint[])
    LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET lock_timeout = 0 AS $$
    DECLARE pos bigint; prev text; last_at text; stamp text; r record;
    BEGIN
        positioned := 0;
        positions := ARRAY(SELECT (SELECT e.position FROM events e WHERE e.seq = w.s)
                           FROM unnest(want) WITH ORDINALITY AS w(s, o) ORDER BY w.o);
        IF cardinality(want) > 0 AND array_position(positions, NULL) IS NULL THEN
            RETURN;  -- positioned already (by another process's run): nothing to wait for
        END IF;
        IF wait THEN
            PERFORM pg_advisory_xact_lock(lock_key);
        ELSIF NOT pg_try_advisory_xact_lock(lock_key) THEN
            RETURN;  -- another run holds it: that run (or the writer's own next one) positions them
        END IF;
        IF cardinality(want) > 0 THEN  -- the run we waited for may have positioned them
            positions := ARRAY(SELECT (SELECT e.position FROM events e WHERE e.seq = w.s)
                               FROM unnest(want) WITH ORDINALITY AS w(s, o) ORDER BY w.o);
            IF array_position(positions, NULL) IS NULL THEN
                RETURN;
            END IF;
        END IF;
        SELECT e.position, e.hash, e.recorded_at INTO pos, prev, last_at
        FROM events e WHERE e.position IS NOT NULL ORDER BY e.position DESC LIMIT 1;
        IF NOT FOUND THEN
            pos := 0; prev := repeat('0', 64); last_at := '';
        ELSIF prev IS NULL OR last_at IS NULL THEN
            RAISE EXCEPTION 'the event at position % has no hash or time: the log is damaged', pos;
        END IF;
        stamp := to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US') || '+00:00';
        IF stamp < last_at THEN
            stamp := last_at;  -- never goes backwards
        END IF;
        FOR r IN SELECT e.seq, e.event_id, e.type, e.schema_version, e.data, e.metadata FROM events e
                 WHERE e.position IS NULL ORDER BY e.transaction_id, e.seq LOOP
            pos := pos + 1;
            prev := encode(sha256(convert_to(concat_ws(chr(31), prev, pos::text, r.event_id, r.type,
                    r.schema_version::text, r.data, r.metadata, stamp), 'UTF8')), 'hex');
            UPDATE events SET position = pos, hash = prev, recorded_at = stamp WHERE seq = r.seq;
            positioned := positioned + 1;
        END LOOP;
        positions := ARRAY(SELECT (SELECT e.position FROM events e WHERE e.seq = w.s)
                           FROM unnest(want) WITH ORDINALITY AS w(s, o) ORDER BY w.o);
    END $$;
    """,
    # 7: no table changes. Events may carry payload fields an evstore of schema 6 or older refuses
    # (on_behalf_of, a ProviderDeleted's parent): the version closes such a store to it, which
    # would otherwise call those events corrupt.
    "SELECT 1",
    # 8: evstore_lock_load_near, evstore_lock_load that also takes the locks of the entities a
    # command is guessed to reach (``near``: what its consumers were loaded with before), each only
    # if it is free at once, and returns those it took (kind 5): a command naming consumers only no
    # longer needs a second load (and often a try-lock) to lock the providers and migrations it
    # finds. Functions only; evstore_lock_load stays for the processes of version 7 still running.
    r"""
    CREATE OR REPLACE FUNCTION evstore_lock_load_near(
        fence bigint, keys bigint[], want_consumers text[], migrations_of text[], provider_names text[],
        children_of text[], want_providers text[], custom_classes text[], near bigint[]
    ) RETURNS TABLE (
        kind smallint, t1 text, t2 text, t3 text, t4 text, t5 text, t6 text,
        b1 bigint, b2 bigint, b3 bigint, b4 bigint
    ) LANGUAGE plpgsql
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
    DECLARE cs text[]; ps text[]; taken bigint[];
    BEGIN
        PERFORM evstore_lock(fence, keys);
        -- a guess never waits (holding the keys above, a wait out of order could close a cycle)
        taken := ARRAY(SELECT k FROM unnest(near) AS k WHERE pg_try_advisory_xact_lock(k));
        cs := ARRAY(SELECT unnest(want_consumers)
                    UNION SELECT c.uuid FROM p_consumers c WHERE c.on_behalf_of = ANY(migrations_of));
        cs := cs || ARRAY(SELECT DISTINCT c.on_behalf_of FROM p_consumers c
                          WHERE c.uuid = ANY(cs) AND c.on_behalf_of IS NOT NULL
                            AND NOT c.on_behalf_of = ANY(cs));
        ps := ARRAY(SELECT unnest(want_providers)
                    UNION SELECT a.provider FROM p_allocations a WHERE a.consumer = ANY(cs)
                    UNION SELECT p.uuid FROM p_providers p WHERE p.name = ANY(provider_names)
                    UNION SELECT p.uuid FROM p_providers p WHERE p.parent = ANY(children_of));
        RETURN QUERY
            SELECT 1::smallint, c.uuid, c.project_id, c.user_id, c.consumer_type, c.on_behalf_of,
                   c.instance_type, c.generation, c.deleted::bigint, c.deleted_at, c.allocated_at
            FROM p_consumers_resolved c WHERE c.uuid = ANY(cs)
            UNION ALL
            SELECT 2::smallint, a.consumer, a.provider, a.rc, NULL, NULL, NULL, a.used, NULL, NULL, NULL
            FROM p_allocations a WHERE a.consumer = ANY(cs)
            UNION ALL
            SELECT 3::smallint, p.uuid, p.name, p.parent, p.root, p.inventories, p.usages,
                   p.generation, NULL, NULL, NULL
            FROM p_providers p WHERE p.uuid = ANY(ps)
            UNION ALL
            SELECT 4::smallint, n.name, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
            FROM p_classes n WHERE n.name = ANY(custom_classes)
            UNION ALL
            SELECT 5::smallint, NULL, NULL, NULL, NULL, NULL, NULL, t.k, NULL, NULL, NULL
            FROM unnest(taken) AS t(k)
            ORDER BY 1, 2, 3, 4;
    END $$;
    """,
    # 9: the sequencer finds the events to position through events_unpositioned by an ordered index
    # scan. Its generic plan was a bitmap scan, and a bitmap scan never marks the entries of dead
    # row versions (every positioned event leaves one: the UPDATE gives it a new version) as dead:
    # each run read every entry and heap page of the events positioned since the table's last
    # VACUUM - 3.6 ms and 664 buffers per run after 1,200 commands, growing with the log until
    # autovacuum ran (at 20% of the table). An index scan marks what it passes over as dead once
    # no snapshot can see it, so the next run skips it.
    """
    ALTER FUNCTION evstore_sequence(bigint, boolean, bigint[]) SET enable_bitmapscan = off;
    """,
)

PROJECTION_TABLES = ("p_allocations", "p_consumers", "p_providers", "p_classes")

#: The projection's objects as the current schema defines them (the migrations above made them),
#: to re-create any that were lost (dropped by hand): each before what depends on it.
PROJECTION_OBJECTS: tuple[tuple[str, str], ...] = (
    (
        "p_providers",
        """CREATE TABLE p_providers (
            uuid text PRIMARY KEY, name text NOT NULL, parent text, root text NOT NULL,
            generation bigint NOT NULL, inventories text NOT NULL, usages text NOT NULL
        )""",
    ),
    (
        "p_consumers",
        """CREATE TABLE p_consumers (
            uuid text PRIMARY KEY, project_id text, user_id text, consumer_type text, generation bigint,
            deleted integer NOT NULL, deleted_at bigint, on_behalf_of text, allocated_at bigint,
            instance_type text
        )""",
    ),
    (
        "p_allocations",
        """CREATE TABLE p_allocations (
            consumer text NOT NULL, provider text NOT NULL, rc text NOT NULL, used bigint NOT NULL,
            PRIMARY KEY (consumer, provider, rc)
        )""",
    ),
    ("p_classes", "CREATE TABLE p_classes (name text PRIMARY KEY)"),
    ("p_providers_name", "CREATE INDEX p_providers_name ON p_providers (name)"),
    ("p_providers_parent", "CREATE INDEX p_providers_parent ON p_providers (parent)"),
    ("p_consumers_behalf", "CREATE INDEX p_consumers_behalf ON p_consumers (on_behalf_of)"),
    ("p_consumers_project", "CREATE INDEX p_consumers_project ON p_consumers (project_id, user_id)"),
    ("p_allocations_provider", "CREATE INDEX p_allocations_provider ON p_allocations (provider)"),
    (
        "p_consumers_resolved",
        """CREATE VIEW p_consumers_resolved AS
        SELECT c.uuid, c.project_id, c.user_id, c.consumer_type, c.generation, c.deleted,
               CASE WHEN c.deleted_at < 0
                    THEN coalesce((SELECT e.position FROM events e WHERE e.seq = -c.deleted_at), c.deleted_at)
                    ELSE c.deleted_at END AS deleted_at,
               c.on_behalf_of,
               CASE WHEN c.allocated_at < 0
                    THEN coalesce((SELECT e.position FROM events e WHERE e.seq = -c.allocated_at),
                                  c.allocated_at)
                    ELSE c.allocated_at END AS allocated_at,
               c.instance_type
        FROM p_consumers c""",
    ),
    (
        "snapshots",
        """CREATE TABLE snapshots (
            position bigint PRIMARY KEY, event_hash text NOT NULL, format integer NOT NULL,
            state text NOT NULL
        )""",
    ),
)


async def _missing_objects(conn: Any) -> list[str]:
    """The projection's tables, indexes and view that this schema lacks."""
    names = [name for name, _ in PROJECTION_OBJECTS]
    found = await conn.fetch("SELECT n, to_regclass(n) IS NOT NULL FROM unnest($1::text[]) AS n", names)
    return [name for name, present in found if not present]


async def _lost_tail(conn: Any) -> LostTail | None:
    """See :meth:`PostgresBackend.lost_tail` (one statement, one snapshot). The sequence's last
    value is read only by a role that may read the sequence (SELECT or USAGE on it): a role with
    SELECT on the store's tables alone - which reads, exports and audits - was refused the whole
    check ("permission denied for sequence events_seq_seq", its audit failed). For it, every -seq
    the log lacks is taken as handed out (a lost event): the projection is not clean either way."""
    sql = (
        "WITH head AS (SELECT coalesce(max(position), 0) AS h FROM events), "
        "seq AS (SELECT pg_get_serial_sequence('events', 'seq') AS name), "
        "given AS (SELECT CASE WHEN has_sequence_privilege(seq.name, 'SELECT, USAGE') "
        "THEN coalesce(pg_sequence_last_value(seq.name::regclass), 0) "
        "ELSE 9223372036854775807 END AS s FROM seq) "
        "SELECT head.h, t.v, c.uuid, t.what FROM p_consumers c CROSS JOIN LATERAL "
        "(VALUES (c.deleted_at, 'deleted'), (c.allocated_at, 'allocations changed')) AS t(v, what), "
        "head, given "
        "WHERE (t.v < 0 AND -t.v <= given.s AND NOT EXISTS (SELECT 1 FROM events e WHERE e.seq = -t.v)) "
        "OR t.v > head.h ORDER BY t.v DESC LIMIT 1"
    )
    row = await conn.fetchrow(sql)
    if row is None:
        return None
    if int(row[1]) < 0 and await conn.fetchval(
        "SELECT count(position) <> coalesce(max(position), 0) FROM events"
    ):
        # (an event the projection names by its seq is gone, and so is a position in the middle
        # of the log: rows deleted from the middle by hand - the tombstone among them - not a lost
        # tail, which --force would let a rebuild forget; every read and the rebuild refuse the
        # hole itself, position_gap. Counted only on this rare path: a scan of the positions)
        return None
    return LostTail(int(row[0]), int(row[1]), str(row[2]), str(row[3]))


async def _refold_pending(conn: Any) -> bool:
    """Whether a migration left the projection to be refolded (see _migrate)."""
    return bool(await conn.fetchval("SELECT count(*) FROM evstore_meta WHERE key = 'refold_pending'"))


async def _refold(conn: Any, missing: list[str]) -> bool:
    """Inside the fence, every committed event positioned: fold the log into the projection
    (``missing``: the projection objects just made again, for the logs). Whether it did: a log
    that lost its last events is not refolded, as a rebuild refuses to without force (the fold
    would forget them silently, a tombstone among them), and one that cannot be folded is left
    to the audit, which names the row. Each is logged."""
    lost = None if "p_consumers" in missing else await _lost_tail(conn)
    if lost is not None:
        log.error(
            "projection.refold_refused",
            tables=missing,
            reason="log_truncated",
            position=lost.position,
            consumer=lost.consumer,
        )
        return False
    try:
        async with conn.transaction():  # (a savepoint)
            await _rebuild(conn, State(usages_deferred=True), 5000, None)
    except (err.CorruptEvent, OverflowError, ValueError, TypeError) as exc:
        log.error("projection.refold_failed", tables=missing, error=repr(exc)[:200])
        return False
    return True


async def _drop_snapshots(conn: Any) -> int:
    """Delete every snapshot and tombstone segment, the table locked first (in the caller's
    transaction, or one of its own): a snapshot and its segment are two rows a save locks in its
    order, which a DELETE's scan may take the other way round - "deadlock detected" (a rebuild
    failed with it under test_maintenance_races). SHARE ROW EXCLUSIVE waits for the saves under
    way and holds new ones back until the commit; rows already saved are still read meanwhile.
    Returns the snapshots deleted (not their tombstone segments, kept at minus their position)."""
    async with conn.transaction():  # (a savepoint inside the caller's)
        await conn.execute("LOCK TABLE snapshots IN SHARE ROW EXCLUSIVE MODE")
        status = await conn.execute("DELETE FROM snapshots WHERE position > 0")
        await conn.execute("DELETE FROM snapshots")
    return int(str(status).rsplit(" ", 1)[-1])


async def _recreate(conn: Any, missing: list[str]) -> None:
    """Create the lost projection objects (empty: the caller refolds), in dependency order."""
    for name, ddl in PROJECTION_OBJECTS:
        if name in missing:
            await conn.execute(ddl)


EVENT_COLUMNS = "position, event_id, type, schema_version, data, metadata, recorded_at, hash"
PROVIDER_COLUMNS = "uuid, name, parent, root, generation, inventories, usages"
CONSUMER_COLUMNS = (
    "uuid, project_id, user_id, consumer_type, generation, deleted, deleted_at, on_behalf_of, allocated_at, "
    "instance_type"
)
RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})  # deadlock detected, serialization failure
DISK_FULL = "53100"  # disk_full: the server found no room to write (details["reason"] "disk_full")
#: SQLSTATE class 53, insufficient resources: each one's ``details["reason"]`` (its condition name)
#: and what a person does about it, said in the error's message. (An unknown code of the class:
#: its class's, "insufficient_resources".)
RESOURCE_SHORTAGES: dict[str, tuple[str, str]] = {
    "53000": (
        "insufficient_resources",
        "the database server lacks a resource it needed, which its message and its log name: free "
        "it or lower the load there, then retry",
    ),
    DISK_FULL: (
        "disk_full",
        "the database server's disk is full: free space there - its data directory, its WAL, its "
        "temporary files - then retry; the store stays as it was, consistent",
    ),
    "53200": (
        "out_of_memory",
        "the database server ran out of memory: lower the load or work_mem there, or give it more "
        "memory (out of shared memory: raise its max_locks_per_transaction), then retry",
    ),
    "53300": (
        "too_many_connections",
        "the server has no connection slot free: its max_connections, or the role's or the "
        "database's CONNECTION LIMIT, is reached - lower pool_size in the processes using it, close "
        "idle clients, or raise that limit; retry once a slot is free",
    ),
    "53400": (
        "configuration_limit_exceeded",
        "a limit of the server's configuration was reached, which its message names - "
        "max_pred_locks_per_transaction, max_prepared_transactions, ...: raise that setting, or "
        "lower the load there, then retry",
    ),
}


#: how long after the server refused the pool a connection for want of a slot (53300) a wait
#: for one that runs out is put down to that refusal (see PostgresBackend._acquire): a refusal
#: answers a connect in a round trip, and the pool tries again within 0.1 s
_REFUSAL_FRESH = 0.5

#: the shortages a later try may well not meet: the server short of memory or of some other
#: resource (53200, 53000: what its other sessions hold - sorts, hashes, locks, dynamic shared
#: memory, background workers - comes free as they end) or of connection slots (53300). Their
#: errors say ``transient=True``: subscribers ride them out with their back-off, as a restart,
#: rather than ending at the first one. Not a full disk (53100), which waits for a person to free
#: space, nor a configuration limit (53400: temp_file_limit, max_prepared_transactions, ...),
#: which the same statement meets again until a person raises it; nor a code of the class this
#: table does not know.
PASSING_SHORTAGES = frozenset({"53000", "53200", "53300"})


def _kept(failed: err.StorageError) -> dict[str, Any]:
    """What an error wrapping ``failed`` keeps of its details: the SQLSTATE, the reason (a full
    disk, too many connections) and whether it may pass (``transient``), which a caller acts on."""
    return {k: failed.details[k] for k in ("sqlstate", "reason", "transient") if k in failed.details}


def _resource_shortage(sqlstate: object) -> tuple[str, str] | None:
    """The reason and the advice for a SQLSTATE of class 53 (see RESOURCE_SHORTAGES), else None."""
    if not isinstance(sqlstate, str) or not sqlstate.startswith("53"):
        return None
    return RESOURCE_SHORTAGES.get(sqlstate, RESOURCE_SHORTAGES["53000"])


OPTIONS = (
    "pool_size",
    "min_pool_size",
    "connect_timeout",
    "command_timeout",
    "max_retries",
    "statement_cache_size",
    "create",
    "upgrade",
)

TestHook = Callable[[Any], Awaitable[None]]


def _options_in_url(url: str, safe_url: str) -> tuple[str, dict[str, Any]]:
    """evstore's own options given as ``?k=v`` in the URL (the only way the CLI's ``--url`` can set
    them), taken out of it: asyncpg would send them to the server as settings, which refuses them.
    ``connect_timeout`` is also libpq's parameter, in the same unit. Returns the URL without them."""
    try:
        parts = urlsplit(url)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError as exc:  # (its text may quote a piece of the password: "[" in it, for one)
        raise err.InvalidInput(
            f"Malformed PostgreSQL URL {safe_url}: {err.redact_text(str(exc), url)}"
        ) from None
    names = [k for k, _ in pairs]
    twice = sorted({k for k in names if names.count(k) > 1})
    if twice:
        raise err.InvalidInput(
            f"The PostgreSQL URL {safe_url} sets {', '.join(twice)} more than once", field=twice[0]
        )
    keywords = [k for k in names if k in STORE_KEYWORDS]
    if keywords:
        raise err.InvalidInput(
            f"Unknown PostgreSQL store option(s) {', '.join(keywords)} in {safe_url}"
            + store_keyword_hint(keywords),
            field=keywords[0],
        )
    ours = {k: v for k, v in pairs if k in OPTIONS}
    if not ours:
        return url, {}
    rest = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in pairs if k not in OPTIONS])))
    options: dict[str, Any] = {}
    for name, text in ours.items():
        if name in ("create", "upgrade"):
            options[name] = flag_option_from_url(text, name)
            continue
        try:
            options[name] = float(text) if name.endswith("_timeout") else int(text)
        except ValueError:
            kind = "a number of seconds" if name.endswith("_timeout") else "an integer"
            raise err.InvalidInput(
                f"{name} in the URL must be {kind}, got {shown(text, 40)}", field=name
            ) from None
    return rest, options


#: a URL's scheme and the text of its host part (up to the first "/", "?" or "#")
_AUTHORITY = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)")
#: from the host part on: a user name, ":" and anything up to the last "@" (as redact_url finds a
#: password)
_USER_AND_MORE = re.compile(r"[^:/?#@]*:.*@")


def _connect_hint(exc: BaseException) -> str:
    """What to check when the first connect of an open failed for a reason of its own: the login
    refused (SQLSTATE class 28: no such role, a wrong password, no pg_hba.conf entry), nothing
    listening at the address, a host name that does not resolve; "" for any other failure."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    if sqlstate.startswith("28"):
        return (
            " (the server refused the login: check the URL's user name and password - or PGPASSWORD, "
            "~/.pgpass - and that the server's pg_hba.conf lets that user connect to that database "
            "from this host)"
        )
    if isinstance(exc, ConnectionRefusedError) or _all_refused(exc):
        return " (nothing listens there: check the host and the port in the URL, and that the server is up)"
    if isinstance(exc, FileNotFoundError):
        return (
            " (no server socket there: check the URL's host - the directory of the server's Unix "
            "socket - and port, and that the server is up)"
        )
    if isinstance(exc, socket.gaierror):
        if exc.errno == socket.EAI_AGAIN:  # (the resolver failed for now: a later open may resolve it)
            return (
                " (the host name could not be resolved for now: try again; if it lasts, check this "
                "host's DNS)"
            )
        return " (the host name does not resolve: check the host in the URL, and this host's DNS)"
    if _tls_refused(exc) and not _tls_files(exc):
        return (
            " (the TLS handshake failed: what answers there and this client cannot agree on TLS - "
            "that does not pass by itself: check the host and port, the URL's sslmode and "
            "ssl_min_protocol_version/ssl_max_protocol_version, and the server's ssl settings)"
        )
    if _no_tls(exc):
        return (
            " (the server offers no TLS - its ssl setting is off - and the URL's sslmode asks for it: "
            "that does not pass by itself - check sslmode, whose default, prefer, connects without "
            "TLS where the server has none, or turn ssl on at the server)"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            " (this client does not trust the server's certificate - the URL's sslmode, verify-ca or "
            "verify-full, checks it against sslrootcert (else PGSSLROOTCERT, else "
            "~/.postgresql/root.crt), and verify-full its host name too: that does not pass by "
            "itself - check sslrootcert names the CA that signed the server's certificate, and the "
            "URL's host)"
        )
    if isinstance(exc, PermissionError):
        return (
            " (this process may not use the server's socket or address: that does not pass by "
            "itself - check the Unix socket's directory and file permissions, or the firewall)"
        )
    return ""


def _all_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is asyncio's plain ``OSError("Multiple exceptions: ...")`` for a host name
    with more than one address (``localhost``: ``::1`` and ``127.0.0.1``), each failed and one at
    least refused (another may be unreachable: ``::1`` where IPv6 is off)."""
    text = str(exc) if type(exc) is OSError else ""
    return text.startswith("Multiple exceptions: ") and f"[Errno {errno.ECONNREFUSED}]" in text


def _misread_password(url: str, safe_url: str) -> str:
    """A note for the errors about ``url`` when its user name and password may have been misread
    ("" when not): the URL's last "@" is past the end of its host part. A password with an
    unencoded "/", "?" or "#" ends the host part there, the rest read as a path, query or
    fragment, and the password's start as the port - a number, for one that starts with digits
    (``u:123/x@db``: host ``u``, port 123) - or, after an "@" of its own, as the host
    (``u:1@2/3@db``: host ``2``). The URL may also be a sound one with an "@" in its query
    (``?user=a@b``), so this is said only with an error. A second "@" in the host part is refused
    here: PostgreSQL's clients split the URL at the first, and would look a piece of the password
    up as a host name."""
    authority = _AUTHORITY.match(url)
    if authority is None:
        return ""
    if authority.group(1).count("@") > 1:
        raise err.InvalidInput(
            f"Malformed PostgreSQL URL {safe_url}: it holds more than one '@' before the host, and "
            "PostgreSQL's clients take everything after the first for the host (a piece of the "
            "password with it): percent-encode the '@' of a user name or password as %40 (e.g. "
            "urllib.parse.quote(password, safe=''))",
            url=safe_url,
        )
    userinfo = _USER_AND_MORE.match(url, authority.start(1))
    if userinfo is None or userinfo.end() <= authority.end():
        return ""
    return (
        " (if the URL's text up to its last '@' is a user name and password, the password holds a "
        "'/', '?' or '#', which ends the host part of a URL: PostgreSQL's clients then read its "
        "pieces as the port, the host, the database or settings - percent-encode them, and any "
        "'@', as %2F, %3F, %23, %40, e.g. urllib.parse.quote(password, safe=''))"
    )


def redact(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    return err.redact_url(url)


def _literal(text: str) -> str:
    """``text`` as a SQL string literal, whatever ``standard_conforming_strings`` says."""
    return "E'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


#: the schemas a connection's search_path finds now, quoted, as a search_path
_SCHEMAS_FOUND = (
    "SELECT array_to_string(ARRAY(SELECT quote_ident(s) FROM unnest(current_schemas(false)) AS s), ', ')"
)


async def _init_connection(conn: Any, search_path: str | None = None) -> str | None:
    """Every new connection: evstore's transactions run at READ COMMITTED, whatever the role, the
    database or the URL make the default (and its client encoding is UTF-8). Its locking is built
    for it (a command locks, then reads what the last holder committed; a snapshot taken before
    the lock would be stale), and at REPEATABLE READ or SERIALIZABLE its reads (audit, rebuild,
    the head) failed with serialization errors it does not retry.

    ``search_path``: the store's, as its first connection found it (None: this is the first; its
    search_path is answered). A URL without one takes the role's or the database's default at
    each connect: changed by a DBA (``ALTER ROLE ... SET search_path``) while the store is open,
    the connections opened after it - a reconnect after a restart or a terminated session -
    resolved every unqualified name in another schema: read another store, wrote to it under
    this one's locks. One round trip for each later connection."""
    # (and UTF-8, whatever the URL's client_encoding says: asyncpg encodes every text argument in
    # the session's client encoding, and a name outside it - "rack ☃" under LATIN1 - failed the
    # command; the server tells asyncpg of the change, which encodes in UTF-8 from then on)
    isolation = "SET default_transaction_isolation = 'read committed'; SET client_encoding = 'UTF8'"
    if search_path is None:
        await conn.execute(isolation)
        # (the schemas it names that exist, not its text: '"$user", public' is resolved anew at
        # every statement - a schema named after the role, made while the store is open, would
        # take every connection to it)
        found = str(await conn.fetchval(_SCHEMAS_FOUND))
        await conn.execute(f"SELECT set_config('search_path', {_literal(found)}, false)")
        return found
    await conn.execute(f"{isolation}; SELECT set_config('search_path', {_literal(search_path)}, false)")
    return search_path


async def _reset_connection(conn: Any, unsynced: set[int]) -> None:
    """What a connection needs before it goes back to the pool: no open transaction.

    asyncpg's default reset (unlock all advisory locks, close cursors, unlisten, ``RESET ALL``)
    costs a round trip per release; this backend keeps no session state (locks are per
    transaction; ``search_path`` and other URL settings are session defaults that stay).

    ``unsynced``: the server pids of connections whose holder was cancelled, or stopped by
    asyncpg before it sent a statement's arguments (see :meth:`PostgresBackend._connection` and
    :func:`_maybe_unsynced`). asyncpg prepares a statement with Parse and Describe
    and no Sync, and sends Bind, Execute and Sync once the prepare has answered; a task cancelled
    after that answer came and before it resumed sends neither and requests no cancellation, and
    the server sits in the implicit transaction the Parse began (with a snapshot: a SELECT's
    analysis takes one) while asyncpg, whose transaction state comes from the last ReadyForQuery,
    thinks the connection idle. The next holder's ``BEGIN`` ran inside it: ``BEGIN ISOLATION
    LEVEL REPEATABLE READ`` failed "SET TRANSACTION ISOLATION LEVEL must be called before any
    query", and a plain ``BEGIN`` joined it. A simple query ends that transaction (the Parse's
    work is all it holds: asyncpg sends a Sync with every Bind/Execute) and brings the
    ReadyForQuery that says where the server is.
    """
    if unsynced and (pid := conn.get_server_pid()) in unsynced:
        unsynced.discard(pid)
        await conn.execute("SELECT 1")
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


#: the schema of the table (or view) an unqualified name $1 resolves to through the search_path
SCHEMA_OF = (
    "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = to_regclass($1)"
)

#: the columns of evstore's ``events`` (a table of that name holding them all is evstore's)
EVENTS_COLUMNS = frozenset(
    {"seq", "transaction_id", "position", "event_id", "type", "schema_version", "data", "metadata", "hash"}
)


async def _holds_evstore_events(conn: Any, schema: str) -> bool:
    """Whether ``schema`` holds evstore's ``events`` table (by its columns): a store, even when
    its evstore_meta is gone, rather than another application's table of that name."""
    found = await conn.fetchval(
        "SELECT array_agg(a.attname::text) FROM pg_attribute a "
        "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = $1 AND c.relname = 'events' AND c.relkind IN ('r', 'p') "
        "AND a.attnum > 0 AND NOT a.attisdropped",
        schema,
    )
    return found is not None and EVENTS_COLUMNS <= set(found)


async def _version_of_objects(conn: Any, schema: str) -> int:
    """The schema version the store's objects in ``schema`` show: the newest whose objects, and
    those of every version before it, are there as the migrations made them (the version a store
    that lost its own is to be given again: the open upgrades it from there, and the migrations
    after version 1 can run again over what they made). Versions 6 and 7 have the same objects
    (7 changed only the number): 6, from which the open upgrades through 7 doing nothing."""
    rows = await conn.fetch(
        "SELECT p.proname::text, p.prosrc, coalesce(p.proconfig, '{}'), coalesce(p.proargnames, '{}') "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1 "
        "AND p.proname IN ('evstore_sequence', 'evstore_write', 'evstore_lock_load_near')",
        schema,
    )
    sequencer = next((r for r in rows if r[0] == "evstore_sequence"), None)
    snapshots = await conn.fetchval(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = $1 AND c.relname = 'snapshots'",
        schema,
    )
    # (each version's mark, oldest first - 7 has none; a lost snapshots table, which the open
    # re-creates, does not make a store of version 3 or later one of version 1)
    marks = {
        2: bool(snapshots) or sequencer is not None,
        3: sequencer is not None,  # (the write path's functions)
        4: sequencer is not None and "lock_timeout=0" in sequencer[2],
        5: any(r[0] == "evstore_write" and "c_instance_type" in r[3] for r in rows),
        6: sequencer is not None and "evstore_positions" not in sequencer[1],
        8: any(r[0] == "evstore_lock_load_near" for r in rows),
        9: sequencer is not None and "enable_bitmapscan=off" in sequencer[2],
    }
    version = 1
    for number, mark in marks.items():
        if not mark:
            break
        version = number
    return version


async def _lost_version(
    conn: Any, url: str, schema: str, lost: Literal["table", "row", "value"], value: object
) -> err.SchemaVersionError:
    """The error for the store in ``schema`` of ``url`` (evstore's events table is there) that
    lost evstore_meta (``lost`` "table"), its schema_version row ("row"), or whose version is not
    one evstore writes ("value": ``value``): evstore does not guess the version. The message gives
    the statement that puts back the version its objects show (:func:`_version_of_objects`),
    evstore_meta named with its schema (psql's search_path need not be the store's)."""
    shaped = await _version_of_objects(conn, schema)
    meta = f"{await conn.fetchval('SELECT quote_ident($1)', schema)}.evstore_meta"
    where = f"The store in schema {schema!r} of {url}"
    if shaped == SCHEMA_VERSION:
        as_shaped = f" (its tables and functions are those of schema version {shaped}, this evstore's)"
    else:
        of = f"{shaped} or 7, which differ only in the number" if shaped == 6 else f"{shaped}"
        as_shaped = (
            f" (its tables and functions are those of schema version {of}: this evstore upgrades "
            f"it to {SCHEMA_VERSION} on its next open - stop processes running an older evstore first)"
        )
    if lost == "table":
        what = (
            f"{where} has lost evstore_meta, the table of its schema version (its events and other "
            "tables are there): it was dropped by hand, or a restore left it out"
        )
        fix = (
            f"restore evstore_meta from a backup, or make it again{as_shaped}: `CREATE TABLE {meta} "
            f"(key text PRIMARY KEY, value text NOT NULL); INSERT INTO {meta} VALUES ('schema_version', "
            f"'{shaped}')`"
        )
    elif lost == "row":
        what = (
            f"{where} has evstore's tables but no schema version (evstore_meta lost its "
            "schema_version row): it was deleted by hand, or a restore left it out"
        )
        fix = (
            f"restore evstore_meta from a backup, or put the row back{as_shaped}: `INSERT INTO {meta} "
            f"VALUES ('schema_version', '{shaped}')`"
        )
    else:
        number = parse_version(value)
        what = (
            f"{where}: its schema version is {shown(value, 40)}, "
            + ("not a number" if number is None else "and evstore numbers its versions from 1")
            + ", so it was changed by hand, or damaged"
        )
        fix = (
            f"restore evstore_meta from a backup, or set the version{as_shaped}: `UPDATE {meta} SET "
            f"value = '{shaped}' WHERE key = 'schema_version'`"
        )
    return err.SchemaVersionError(
        f"{what}. evstore neither guesses the version of a store nor creates one over its tables: "
        f"{fix}. Nothing was written",
        url=url,
        schema=schema,
        found=value if lost == "value" else None,
        supported=SCHEMA_VERSION,
    )


#: the schema of the store: the first of the search_path holding its evstore_meta, else the first
#: that exists. (A scan of pg_class, not to_regclass: that would cache the name's absence in this
#: session, and the open's check after waiting for another open's migration would believe it.)
STORE_SCHEMA = (
    "SELECT coalesce((SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.relname = 'evstore_meta' AND n.nspname = ANY(current_schemas(false)) "
    "ORDER BY array_position(current_schemas(false), n.nspname) LIMIT 1), current_schema())"
)

#: the names of the store's tables, view and sequence, as its statements name them (unqualified)
STORE_RELATIONS = (
    "evstore_meta",
    "events",
    "events_seq_seq",
    "event_entities",
    "idempotency",
    "snapshots",
    "p_consumers_resolved",
    *PROJECTION_TABLES,
)

#: the names of the functions the store's statements call (unqualified): those its migrations make
STORE_FUNCTIONS = tuple(
    sorted(set(re.findall(r"CREATE (?:OR REPLACE )?FUNCTION (evstore_\w+)", "".join(MIGRATIONS))))
)

#: what the schemas of the session's search_path before the store's ($1) hold of evstore's
#: names - relations ($2) and functions ($3: evstore's own, not any evstore_* - a function of
#: another name resolves nothing evstore calls) -, by schema then name: up to 5
SHADOWING = (
    "WITH path AS (SELECT s.nspname, s.i "
    "FROM unnest(current_schemas(false)) WITH ORDINALITY AS s(nspname, i)), "
    "before AS (SELECT n.oid, p.nspname, p.i FROM path p JOIN pg_namespace n ON n.nspname = p.nspname "
    "WHERE p.i < (SELECT min(i) FROM path WHERE nspname = $1)) "
    "SELECT b.nspname, x.name FROM before b JOIN LATERAL ("
    "SELECT relname::text AS name FROM pg_class WHERE relnamespace = b.oid AND relname = ANY($2::text[]) "
    "UNION SELECT proname::text FROM pg_proc WHERE pronamespace = b.oid AND proname = ANY($3::text[])"
    ") x ON true ORDER BY b.i, x.name LIMIT 5"
)

#: whether the search_path the session began with (the URL's, the role's, the database's - before
#: _init_connection set the schemas found) names pg_temp first
TEMP_SCHEMA_FIRST = (
    "SELECT lower(btrim(split_part(reset_val, ',', 1), ' \"')) = 'pg_temp' "
    "FROM pg_settings WHERE name = 'search_path'"
)

#: take every advisory lock of $1 that is free, without waiting; true if all of them were
TRY_LOCK = "SELECT bool_and(pg_try_advisory_xact_lock(k)) FROM unnest($1::bigint[]) AS k"


#: _remember_near: the most entities remembered for a consumer, and how many consumers are kept
NEAR_SLICE_MAX = 16
#: A command whose entities' locks would number more than this (a bulk ``write_allocations``)
#: takes the fence exclusively instead - every command takes it shared first, so it then runs
#: alone, as a rebuild's swap does - rather than one lock per entity: those live in the server's
#: shared lock table (``max_locks_per_transaction`` x connections, 6,400 entries by default),
#: which ~30,000 of them overflowed on every try ("out of shared memory", 53200).
LOCK_ALONE_ABOVE = 1000
NEAR_KEPT = 10_000


#: whether a session holds the advisory lock of the bigint key given as its two halves (_lock_tag)
ADVISORY_LOCK_HELD = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 1)"
)


def _lock_tag(key: int) -> tuple[int, int]:
    """An advisory lock's bigint key as pg_locks shows it: its high and low 32 bits (unsigned)."""
    return (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF


class _Relock(Exception):
    """Restart the transaction holding this larger set of locks, taken in order."""

    def __init__(self, keys: set[int]) -> None:
        super().__init__()
        self.keys = keys


class _CannotPosition(Exception):
    """This session cannot run the sequencer (read-only, or no UPDATE on ``events``), and
    ``pending`` committed events wait for positions."""

    def __init__(self, pending: int, cause: str) -> None:
        super().__init__()
        self.pending = pending
        self.cause = cause


class _StaleConnection(Exception):
    """A pooled connection was dead before the command sent anything (``lost``: asyncpg's error)."""

    def __init__(self, lost: BaseException) -> None:
        super().__init__(str(lost))
        self.lost = lost


class _Unpositioned(Exception):
    """The slice holds a tombstone whose event is committed but not positioned yet (its
    ``deleted_at`` is still the event's ``-seq``): decided on, the refusal would report that as
    the position the consumer was deleted at. Restart once the sequencer has positioned it."""

    def __init__(self, seqs: list[int]) -> None:
        super().__init__()
        self.seqs = seqs


def _unpositioned_tombstones(consumers: Iterable[ConsumerState]) -> list[int]:
    """The seqs of the tombstones among ``consumers`` that have no position yet (see
    ``p_consumers_resolved``: a position written before the sequencer ran is ``-seq``)."""
    return sorted({-c.deleted_at for c in consumers if c.deleted_at is not None and c.deleted_at < 0})


def _unpositioned_here(what: str, cause: str, **details: Any) -> err.StorageError:
    """``what`` waits for positions that this session cannot assign (see CANNOT_WRITE), and
    other sessions did not assign in time."""
    return err.StorageError(
        f"{what} have no positions yet, and this session cannot assign them ({cause}: a read-only "
        "role or database, a hot standby, or no UPDATE on the events table): a session that can "
        "write assigns them as it commits or reads (any evstore command or read with such a role), "
        "then run this again",
        **details,
    )


#: what the sequencer raises in a session that cannot write: read-only (the role's or the
#: database's default_transaction_read_only, a hot standby), or a role without UPDATE on events
CANNOT_WRITE = (asyncpg.exceptions.ReadOnlySQLTransactionError, asyncpg.exceptions.InsufficientPrivilegeError)

#: what a database call can raise: errors of the server, of the connection, of asyncpg's state
DB_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)


def _closed(conn: Any) -> bool:
    """Whether a pooled connection is gone (asyncpg detaches the proxy of a connection that died:
    asking it then raises instead of answering)."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


def _in_chain(exc: BaseException | None, found: Callable[[BaseException], bool]) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling (evstore's errors
    replace asyncpg's ``from None``, which keeps them as the context), is ``found``."""
    for _ in range(10):
        if exc is None:
            return False
        if found(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _timed_out(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was raised while handling, asyncpg's ``TimeoutError`` (a statement
    that ran out of ``command_timeout``)."""
    return _in_chain(exc, lambda e: isinstance(e, TimeoutError))


def _maybe_unsynced(exc: BaseException | None) -> bool:
    """Whether a holder that failed with ``exc`` may have left its connection between a
    prepare's answer and the Bind, Execute and Sync that follow it (see _reset_connection):
    cancelled there, or stopped by asyncpg on the client's side - an argument it cannot encode
    is found once the statement is prepared, and nothing more is sent (its ``DataError``, a
    ``PostgresError`` made on the client: without the severity every error the server reports
    has). Not for an error the server reported (asyncpg synced after it) nor evstore's own
    outcomes: those cost no extra round trip at release."""
    return _in_chain(
        exc,
        lambda e: (
            isinstance(e, asyncio.CancelledError | asyncpg.InterfaceError)
            or (isinstance(e, asyncpg.PostgresError) and getattr(e, "severity", None) is None)
        ),
    )


def _reason(exc: BaseException) -> BaseException:
    """The error to name for ``exc``: when the server ends a connection inside a transaction
    block or before a cleanup statement, asyncpg's complaint about that cleanup on the dead
    connection ("cannot call Transaction.__aexit__(): the underlying connection is closed",
    "... connection has been released back to the pool") replaces the server's reason, which it
    was raised while handling."""
    for _ in range(5):
        context = exc.__context__
        if not isinstance(exc, asyncpg.InterfaceError) or not isinstance(context, DB_ERRORS):
            break
        exc = context
    return exc


def _is_connection_error(exc: BaseException) -> bool:
    """``InternalClientError`` ("cannot switch to state ...; another operation is in progress"):
    what asyncpg raises on a pooled connection the server killed while it was idle."""
    return isinstance(
        exc,
        OSError
        | asyncpg.InternalClientError
        | asyncpg.exceptions.ConnectionDoesNotExistError
        | asyncpg.exceptions.InterfaceError
        | asyncpg.exceptions.PostgresConnectionError
        | asyncpg.exceptions.AdminShutdownError
        | asyncpg.exceptions.CrashShutdownError
        | asyncpg.exceptions.CannotConnectNowError,
    )


def _refused_for_good(exc: BaseException) -> bool:
    """A connect that failed for a reason the next try meets again, until a person changes
    something: the process may not use the server's socket or route (``PermissionError``: a Unix
    socket's permissions, a firewall's EPERM), or does not trust the server's certificate. Not
    transient, though an ``OSError``, unlike a refused, reset or timed out connection, a name the
    resolver cannot answer for now, or a Unix socket that is gone (a stopped server removes it).
    Nor does a server that offers no TLS where the URL's sslmode asks for it (:func:`_no_tls`)."""
    return (
        isinstance(exc, PermissionError | ssl.SSLCertVerificationError)
        or _no_tls(exc)
        or _tls_files(exc)
        or _tls_refused(exc)
    )


def _tls_refused(exc: BaseException) -> bool:
    """A TLS handshake that failed on what was said, not on a connection cut under it: the
    server (or what answers at its address - a proxy speaking HTTP) and this client cannot agree
    on TLS ("WRONG_VERSION_NUMBER", a protocol version or cipher the other refuses). Not an
    ``SSLEOFError``, ``SSLZeroReturnError`` or ``SSLSyscallError``: the connection closed or cut
    during the handshake, which a restart does."""
    return isinstance(exc, ssl.SSLError) and not isinstance(
        exc, ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLSyscallError | ssl.SSLCertVerificationError
    )


def _tls_files(exc: BaseException) -> bool:
    """Whether ``exc`` is an ``OSError`` asyncpg raised while parsing the URL, before any
    connect: reading the TLS files it names (``sslrootcert``, ``sslcert``, ``sslkey``) - one
    missing (``FileNotFoundError``, which a Unix socket gone raises too, at its connect), not
    readable, or holding no certificate (``ssl.SSLError``). Told by where it was raised."""
    if not isinstance(exc, OSError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_parse_connect_dsn_and_args":
            return True
        tb = tb.tb_next
    return False


def _tls_file_read(exc: BaseException) -> tuple[str, str] | None:
    """For an error of :func:`_tls_files`: which of asyncpg's TLS files it was reading - the URL's
    option and the file's path -, from the parsing frame's variables (an ``ssl`` error does not
    name its file): they are set in the order asyncpg reads them (sslrootcert, sslcrl, then
    sslcert with its sslkey), so the last one set is the one that failed. None: not found."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "_parse_connect_dsn_and_args":
        tb = tb.tb_next
    if tb is None:
        return None
    found = None
    for name in ("sslrootcert", "sslcrl", "sslcert"):
        value = tb.tb_frame.f_locals.get(name)
        if value:
            found = (name, str(value))
    key = tb.tb_frame.f_locals.get("sslkey")
    if found is not None and found[0] == "sslcert" and key:
        found = ("sslcert", f"{found[1]}, its key {key}")
    return found


def _tls_files_hint(read: tuple[str, str] | None) -> str:
    """Where the TLS files come from and what each must be (``read``: :func:`_tls_file_read`'s)."""
    return (
        "a file the URL names (sslrootcert, sslcert, sslkey, sslcrl), else the one the "
        "environment names (PGSSLROOTCERT, PGSSLCERT, PGSSLKEY, PGSSLCRL), else the default in "
        "~/.postgresql (root.crt, postgresql.crt, postgresql.key, root.crl; the client "
        "certificate is read under the default sslmode, prefer, too): each must be a readable "
        "file in PEM form - the server's CA certificate, this client's certificate and key"
        + (
            " (a key with a passphrase: check sslpassword)"
            if read is not None and read[0] == "sslcert"
            else ""
        )
    )


def _refused_hint(exc: BaseException) -> str:
    """What a connect refused for good (:func:`_refused_for_good`) is told to check - at a read's,
    a command's or the pool's reconnect as at an open's first connect (:func:`_connect_hint`):
    the TLS file that cannot be used, named; the server offering no TLS; a failed handshake; a
    certificate not trusted; the socket's permissions or the firewall."""
    if _tls_files(exc):
        read = _tls_file_read(exc)
        return (
            " (a TLS file the PostgreSQL client reads cannot be used"
            + ("" if read is None else f": {read[0]}, {read[1]}")
            + f"; that does not pass by itself - {_tls_files_hint(read)})"
        )
    return _connect_hint(exc) or (
        " (this process may not use the server's socket or address, or does not trust its "
        "certificate: that does not pass by itself - check the socket's permissions, the firewall, "
        "the URL's sslmode and sslrootcert)"
    )


def _in_url(schema: str) -> str:
    """A schema's name as a URL's ``?search_path=`` names it: quoted (``%22``) when PostgreSQL
    would otherwise fold or refuse it (capitals, a hyphen, a space), as README says."""
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", schema):
        return schema
    return "%22" + quote(schema.replace('"', '""'), safe="") + "%22"


def _no_tls(exc: BaseException) -> bool:
    """asyncpg's plain ``ConnectionError`` for a server that answered the URL's ``sslmode``
    (require, verify-ca, verify-full) that it offers no TLS (its ``ssl`` is off): known by its
    words alone, asyncpg raising the same type for a connection lost during its TLS exchange."""
    return type(exc) is ConnectionError and "rejected SSL upgrade" in str(exc)


def _storage_error(
    exc: BaseException,
    doing: str,
    committing: bool | None = False,
    timeout: str = "command_timeout",
    keyed: bool = True,
    writes: bool = False,
    url: str | None = None,
) -> err.StorageError:
    """``committing``: True while a command's COMMIT was in flight, False inside its transaction
    (rolled back), None for work that writes nothing of the caller's (reads, the sequencer) or
    whose outcome is not told (``writes``: a snapshot saved or dropped - a cache -, whose 42501
    is told as a command's: ``read_only``, what the role lacks).
    ``timeout``: the setting a ``TimeoutError`` means ran out, as the message names it; ``keyed``:
    the command carries an idempotency key (a retry with it is safe, without it is not).
    A failure of the connection rather than of the work (lost, refused, timed out, the server
    shutting down or full) says ``transient=True``: the same call may succeed on a new
    connection once the server is back (subscribers wait for that: AllocationStore.subscribe);
    not one that is refused for good (:func:`_refused_for_good`), nor an answer of the server but
    a shortage that passes by itself (PASSING_SHORTAGES: out of memory, say).
    ``url``: the store's URL, for the error of a connect (the pool's, at a reconnect), whose
    text - the server's, the resolver's, the TLS library's - is redacted of its passwords as the
    open's first connect's is (:func:`evstore.errors.redact_text`: the login refused for a role,
    or a database, whose name holds the password's text)."""
    exc = _reason(exc)
    sqlstate = getattr(exc, "sqlstate", None)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if url is not None:
        text = err.redact_text(text, url)
    shortage: dict[str, str] = {}  # (a connection refused for want of a slot: its reason)
    if _refused_for_good(exc) and not committing:  # (a connect's: nothing was sent)
        lead = f"Cannot connect to PostgreSQL while {doing}: {text}{_refused_hint(exc)}"
        if committing is None:
            return err.StorageError(lead, sqlstate=sqlstate)
        return err.StorageError(f"{lead}; it was rolled back", sqlstate=sqlstate, outcome_unknown=False)
    if isinstance(exc, TimeoutError):
        # (asyncpg's own timeouts: an OSError on Python 3.11, but no connection was lost - the
        # caller's setting ran out, and that is what a person has to know)
        lead = f"PostgreSQL did not answer within {timeout} while {doing}"
    elif isinstance(exc, asyncpg.exceptions.TargetServerAttributeNotMatched):
        # (an InternalClientError too, but no session ended: none was what the URL asks for)
        lead = (
            f"No host of the URL was what its target_session_attrs asks for while {doing}: {text} "
            "(a failover under way? else check it and the hosts)"
        )
    elif isinstance(exc, asyncpg.InternalClientError):
        # (asyncpg's state machine on a connection that broke under it: its words alone say
        # nothing of what happened)
        lead = (
            f"Lost the connection to PostgreSQL while {doing}: the session ended under it - the "
            "server ended it (a restart, pg_terminate_backend, idle_in_transaction_session_timeout) "
            f"or the network cut it (asyncpg: {text})"
        )
    elif _is_connection_error(exc):
        lead = f"Lost the connection to PostgreSQL while {doing}: {text}"
    elif isinstance(exc, asyncpg.exceptions.TooManyConnectionsError):
        # (the server's answer, but to the connect: nothing ran, and a later try may get a slot)
        lead = f"PostgreSQL error while {doing}: {text} ({RESOURCE_SHORTAGES['53300'][1]})"
        shortage = {"reason": RESOURCE_SHORTAGES["53300"][0]}
    else:
        lead = f"PostgreSQL error while {doing}: {text}"
        if sqlstate == "57014" and "statement timeout" in text:
            # (a role's or database's low statement_timeout ends a long audit or rebuild: say where
            # to raise it, for evstore's sessions only)
            lead += (
                " (the statement_timeout of the URL, the role or the database ended it: raise it for "
                "evstore's sessions, e.g. ?statement_timeout=0 in the store URL)"
            )
        reason: dict[str, Any] = {}
        # (disk_full: the server could not extend a table, an index or a temporary file; a COMMIT
        # that cannot write its WAL is no answer but a server that stops: the connection lost)
        found = _resource_shortage(sqlstate)
        if found is not None:
            lead += f" ({found[1]})"
            reason = {"reason": found[0]}
            if sqlstate in PASSING_SHORTAGES:
                reason["transient"] = True
        elif sqlstate == "25006":  # (read_only_sql_transaction: as a SQLite file this process may not write)
            lead += f" ({READ_ONLY_HINT})"
            reason = {"reason": "read_only"}
        elif sqlstate == "42501" and "temporary tables" in text:
            # ("permission denied to create temporary tables in database": TEMP revoked from
            # PUBLIC - no want of a privilege on the store, which this role may write or read)
            lead += f" ({NO_TEMP_HINT})"
        elif (
            sqlstate == "42501" and (committing is not None or writes) and text.startswith("must be owner of")
        ):
            # (what only the tables' owner may do - a full rebuild's REINDEX: a role that writes
            # the store, commands and a plain rebuild, may not do it; granting more is no help)
            lead += f" ({OWNER_ONLY_HINT})"
        elif sqlstate == "42501" and (committing is not None or writes):
            # (insufficient_privilege in work that writes - a command, a rebuild, an import, a
            # snapshot saved or dropped: a role that may read the store but not write it, as a
            # SQLite file this process may read and not write; a read's is a privilege it lacks
            # to read, no such reason: _NO_READ below)
            lead += f" ({NO_WRITE_PRIVILEGE_HINT})"
            reason = {"reason": "read_only"}
        elif sqlstate == "42501" and _NO_READ.match(text):
            # (in a read: a role that may not read the store - no SELECT on a table, no USAGE on
            # the schema any more: what the read needs, not what a write would)
            lead += f" ({NO_READ_PRIVILEGE_HINT})"
        if committing is None:
            return err.StorageError(lead, sqlstate=sqlstate, **reason)
        # the server answered with an error: the transaction is rolled back, also at COMMIT
        return err.StorageError(
            f"{lead}; it was rolled back", sqlstate=sqlstate, outcome_unknown=False, **reason
        )
    if committing is None:
        return err.StorageError(lead, sqlstate=sqlstate, transient=True, **shortage)
    outcome = (
        (
            "it may or may not have been committed (retry with the same idempotency key to be sure)"
            if keyed
            else "it may or may not have been committed (it was sent without an idempotency key: "
            "look at the store before running it again)"
        )
        if committing
        else "it was rolled back"
    )
    return err.StorageError(
        f"{lead}; {outcome}", sqlstate=sqlstate, outcome_unknown=committing, transient=True, **shortage
    )


#: what SQLSTATE 25006 (read_only_sql_transaction) means for the caller: nothing was written
READ_ONLY_HINT = (
    "this session may not write: the server is a hot standby, or default_transaction_read_only is "
    "set for the role, the database or in the store URL; run commands on the primary, with a "
    "session that may write - reads, export, audit (without --history) and time travel work here"
)


#: what SQLSTATE 42501 (insufficient_privilege) means for work that writes: nothing was written
NO_WRITE_PRIVILEGE_HINT = (
    "this role may not write the store: it lacks a privilege on its tables - INSERT, UPDATE and "
    "DELETE on the schema's tables, USAGE on its sequence, EXECUTE on evstore's functions; grant "
    "them, or run what writes - commands, snapshot, rebuild, import - as the role that owns the "
    "store; reads, export, audit and time travel work with SELECT on its tables"
)


#: a read's SQLSTATE 42501 for want of a privilege on the store's objects (not "to create
#: temporary tables", not "to set parameter"): the words are PostgreSQL's untranslated message
_NO_READ = re.compile(r"permission denied for (table|view|relation|schema|sequence|function) ")

#: what such a 42501 means for a read: nothing was read
NO_READ_PRIVILEGE_HINT = (
    "this role may not read the store: grant it USAGE on the schema and SELECT on its tables "
    "(GRANT SELECT ON ALL TABLES IN SCHEMA ..., or the role pg_read_all_data), or use a role that "
    "has them"
)


#: what SQLSTATE 42501 "permission denied to create temporary tables" means: the database's TEMP
#: privilege, which PostgreSQL grants to PUBLIC unless it was revoked
NO_TEMP_HINT = (
    "this role may not create temporary tables in the database, where the audit's --history check "
    "and a full rebuild stage the history index's rows: GRANT TEMPORARY ON DATABASE to it, or run "
    "them as a role that has it - the rest works without it"
)


#: what SQLSTATE 42501 "must be owner of table ..." means for work that writes: nothing was written
OWNER_ONLY_HINT = (
    "only the role that owns the store's tables may do this - a full rebuild reindexes them; this "
    "role's privileges are enough for commands and a plain rebuild: run it as the owner, or as a "
    "role granted the owner's membership"
)


#: asyncpg's warning, with the connect's traceback, at each failed try to reopen the connections
#: the pool keeps at least (min_pool_size) - after a connection was lost, while the server is
#: down or refuses it: retried after 1 s, 2 s, ... 60 s, for as long as the outage lasts
_FLOOR_WARNING = "Failed to restore the pool connection floor; retrying"
#: the open backends, whose pools' floor warnings _floor_retry routes
_OPEN: weakref.WeakSet[PostgresBackend] = weakref.WeakSet()


def _floor_retry(record: logging.LogRecord) -> bool:
    """A filter of asyncpg's pool logger: its floor warning for a pool of evstore's where the
    logging is not configured - which printed it, with a traceback of some 40 lines, on stderr at
    every try during an outage - is logged through structlog instead, a line with the error and
    what it means (``postgres.pool_floor_retry``), as subscribers log their retries. Left as it
    is: where the logging is configured (its handlers decide), for another pool, and for an error
    other than the connection's or the server's (a bug's, whose traceback is wanted) - but for
    the text of the error, which is redacted as the open's (:func:`_redacted_floor_record`)."""
    if record.msg != _FLOOR_WARNING or not record.exc_info:
        return True
    exc = record.exc_info[1]
    if not isinstance(exc, DB_ERRORS):
        return True
    try:
        task = asyncio.current_task()
    except RuntimeError:  # (no loop running: not the pool's maintenance)
        return True
    frame = getattr(task.get_coro() if task is not None else None, "cr_frame", None)
    pool = frame.f_locals.get("self") if frame is not None else None
    backend = next((b for b in list(_OPEN) if pool is not None and b._pool is pool), None)
    if backend is None:
        return True
    if logging.getLogger(record.name).hasHandlers():
        _redacted_floor_record(record, exc, backend.url)
        return True
    failed = _storage_error(
        exc,
        f"reopening the pool's min_pool_size ({backend.min_pool_size}) connections to {backend.safe_url}",
        None,
        backend._timeout_named("connect_timeout"),
        url=backend.url,
    )
    log.warning(
        "postgres.pool_floor_retry",
        error=failed.message,
        action="asyncpg tries again after a pause growing from 1 s to 60 s; calls connect anew meanwhile",
        **{k: v for k, v in _kept(failed).items() if v is not None},
    )
    return False


def _redacted_floor_record(record: logging.LogRecord, exc: BaseException, url: str) -> None:
    """asyncpg's floor warning for a pool of the store at ``url``, left to the configured logging's
    handlers (the CLI's prints the error's first line, its traceback at -vv): when the text of its
    error, or of one it was raised from or while handling, shows a password of the URL (the login
    refused for a role whose name holds the password's text, say - see
    :func:`evstore.errors.redact_text`), the record names the error redacted, without the
    traceback, whose text would show it."""
    chain: list[BaseException] = []
    found: BaseException | None = exc
    while found is not None and len(chain) < 10:
        chain.append(found)
        found = found.__cause__ or found.__context__
    if all(err.redact_text(str(e), url) == str(e) for e in chain):
        return
    text = str(exc).splitlines()[0] if str(exc) else ""
    record.msg = (
        f"{_FLOOR_WARNING} ({type(exc).__name__}: {err.redact_text(text, url)}; its traceback left "
        "out: its text shows a password of the store's URL)"
    )
    record.args = None
    record.exc_info = None
    record.exc_text = None


def _lost_at_set_up(exc: BaseException) -> bool:
    """Whether a pool's acquire failed because the server ended (or the network cut) the new
    connection the pool had opened for it, as it was being set up - asyncpg's
    ``InternalClientError`` ("cannot switch to state 15 ..."), its ``InterfaceError`` ("connection
    is closed"), a session that ended or was reset: another acquire opens another. Not a connect
    refused or timed out (the next meets the same, at once or after ``connect_timeout`` again),
    nor the server short of slots (the acquire waited for one already)."""
    return isinstance(
        exc,
        asyncpg.InternalClientError
        | asyncpg.exceptions.InterfaceError
        | asyncpg.exceptions.ConnectionDoesNotExistError
        | asyncpg.exceptions.AdminShutdownError
        | ConnectionResetError,
    )


class _LostAtAcquire(Exception):
    """Raised by :meth:`PostgresBackend._connection` asked to (``lost_again``), for an acquire
    that lost its new connection as it was set up (:func:`_lost_at_set_up`): the caller asks
    for another connection (asked again without ``lost_again``, the same loss is its error)."""


class _Refused(Exception):
    """A command's decision was to refuse it: raised inside its transaction to roll it back, and
    its outcome returned (see PostgresBackend._attempt)."""

    def __init__(self, outcome: err.EvstoreError) -> None:
        super().__init__(outcome.code)
        self.outcome = outcome


def _refusal_under(exc: BaseException) -> _Refused | _Relock | _Unpositioned | None:
    """What ended the command's transaction that ``exc`` was raised while handling (its ROLLBACK
    failed), if it was a refusal or a restart (:class:`_Relock`, :class:`_Unpositioned`)."""
    for _ in range(10):
        context = exc.__context__
        if context is None:
            return None
        if isinstance(context, _Refused | _Relock | _Unpositioned):
            return context
        exc = context
    return None


class PostgresBackend:
    """Log and projection in one PostgreSQL database (or schema), shared by many processes.

    Example::

        async with open_store("postgresql://evstore@db.example:5432/evstore", pool_size=20) as store:
            ...

    Options: ``pool_size`` (connections, default 10), ``min_pool_size`` (1), ``connect_timeout``
    (seconds, 10), ``command_timeout`` (seconds per statement, none), ``max_retries`` (attempts
    on deadlock/serialization failure, 10), ``statement_cache_size`` (asyncpg's, 100; 0 behind a
    pgbouncer in transaction mode). Each also as ``?k=v`` in the URL (a keyword wins). Other URL
    query parameters than libpq's are passed to the server as settings, e.g.
    ``?search_path=tenant_a`` (the schema must exist).
    """

    def __init__(self, url: str, **options: Any) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise err.InvalidInput(
                f"Unknown PostgreSQL store option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}"
                + store_keyword_hint(unknown),
                field=unknown[0],
            )
        self.safe_url = redact(url)
        #: added to the errors the URL may be the cause of (see _misread_password)
        self._url_note = _misread_password(url, self.safe_url)
        url, from_url = _options_in_url(url, self.safe_url)
        options = {**from_url, **options}  # (a keyword wins, as on SQLite)
        self.url = url
        try:
            parts = urlsplit(url)
            # (parsing the port is the check: one that is not a number raises; a libpq multi-host
            # URL, host1:port1,host2:port2, is left to asyncpg, which tries the hosts in turn)
            for host in parts.netloc.rsplit("@", 1)[-1].split(","):
                urlsplit(f"//{host}").port  # noqa: B018
        except ValueError as exc:  # (its text may quote the password: one with a "/" ends the netloc)
            raise err.InvalidInput(
                f"Malformed PostgreSQL URL {self.safe_url}: {err.redact_text(str(exc), url)}{self._url_note}"
            ) from None
        self.pool_size = validate_int_option(options.get("pool_size", 10), "pool_size", 1)
        self.min_pool_size = validate_int_option(options.get("min_pool_size", 1), "min_pool_size", 0)
        self.max_retries = validate_int_option(options.get("max_retries", 10), "max_retries", 1)
        cache_size = options.get("statement_cache_size", 100)
        self.statement_cache_size = validate_int_option(cache_size, "statement_cache_size", 0)
        self.connect_timeout = validate_seconds_option(options.get("connect_timeout", 10), "connect_timeout")
        timeout = options.get("command_timeout")
        if timeout is not None:
            timeout = validate_seconds_option(timeout, "command_timeout")
        self.command_timeout: float | None = timeout
        #: False: refuse to open a database (schema) that holds no store instead of creating one
        self.create = validate_flag_option(options.get("create", True), "create")
        #: False: refuse a store an older evstore wrote instead of upgrading it (which closes it
        #: to the older evstore processes still using it)
        self.upgrade = validate_flag_option(options.get("upgrade", True), "upgrade")
        #: the schema version this open upgraded the store from (None: it was current, or new)
        self.upgraded_from: int | None = None
        #: what this open repaired in a store of the current version (None: nothing to repair)
        self.repaired: SchemaRepair | None = None
        if self.min_pool_size > self.pool_size:  # (each one's own range was checked as it was read)
            raise err.InvalidInput(
                f"min_pool_size ({self.min_pool_size}) must not exceed pool_size ({self.pool_size}): "
                "the pool keeps that many connections open and never opens more than pool_size",
                field="min_pool_size",
            )
        self._pool: asyncpg.Pool | None = None
        #: server pids of pooled connections whose holder was cancelled (_reset_connection)
        self._unsynced: set[int] = set()
        #: pooled connections whose release was cancelled, which may never have run (_give_back)
        self._interrupted: set[Any] = set()
        #: the pool's acquires whose callers were cancelled, left to finish (see _acquire)
        self._orphans: set[asyncio.Task[None]] = set()
        #: one for each connection of the pool, taken before the pool's acquire (see _acquire)
        self._tickets = _Tickets(self.pool_size)
        #: the connections the pool has opened so far, and this count and the loop's time at the
        #: last refusal of one for want of a slot (see _acquire)
        self._opened = 0
        self._last_refusal: tuple[int, float] | None = None
        self._namespace = ""
        # Commands use at most all but one connection: waiting for a lock another process holds
        # (its rebuild's fence, a hot entity), they must not take every connection from the reads
        # (head, queries, history, audit), which take no lock and would wait for a connection.
        self._slots = _OldestFirst(max(1, self.pool_size - 1))
        self._started = 0
        #: entity name -> the end of the transaction of the last started job naming it (start_jobs)
        self._last_of: dict[str, asyncio.Future[None]] = {}
        #: consumer's lock name -> the entities its last commands here loaded with it (see
        #: _run_job): a guess, locked in order with the command's own, that saves the loads and
        #: try-locks of discovering its providers and migrations one round trip at a time
        self._near: dict[str, frozenset[str]] = {}
        # in-process coalescing of sequencer runs (see _sequenced)
        self._seq_lock = asyncio.Lock()
        self._seq_started = 0
        self._seq_done = 0
        #: seqs awaited by the tasks that will share the next run (see _sequenced)
        self._seq_wanted: list[int] = []
        #: run number -> the tasks waiting for it (see _sequenced), and the positions it found
        #: (seq -> position) while more than its runner wait for them
        self._seq_sharers: dict[int, int] = {}
        self._seq_found: dict[int, dict[int, int | None]] = {}
        #: the search_path the store's first connection had, each later one's (see _init_connection)
        self._search_path: str | None = None
        #: until when (the loop's time) a save on the way to an answer is not tried, and the
        #: refusal of the last one, for want of a write (see save_snapshot)
        self._snapshot_refused: tuple[float, err.StorageError] | None = None
        #: test hooks: awaited with the connection just before COMMIT / after it, before sequencing
        self._before_commit: TestHook | None = None
        self._after_commit: TestHook | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        self._search_path = None  # (an open again after a failed one finds it anew)
        try:
            pool = await asyncpg.create_pool(
                self.url,
                min_size=self.min_pool_size,
                max_size=self.pool_size,
                timeout=self.connect_timeout,
                command_timeout=self.command_timeout,
                statement_cache_size=self.statement_cache_size,
                reset=functools.partial(_reset_connection, unsynced=self._unsynced),
                init=self._opened_one,
            )
            if not self.min_pool_size:
                # (a pool with no floor opened no connection: its first is made here, as one
                # with a floor makes it, so that its failure - a login refused, a misspelt
                # option, nothing listening - is told as an open's, not as a read's)
                try:
                    await pool.release(await pool.acquire(timeout=self.connect_timeout))
                except BaseException:
                    pool.terminate()
                    raise
            self._pool = pool
        except (
            OSError,
            TimeoutError,
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,  # (a first connection the server ended at its set-up)
        ) as exc:
            if isinstance(exc, ValueError) and not isinstance(exc, ssl.SSLCertVerificationError):
                # (ClientConfigurationError: ?sslmode=bogus, a URL's fault - not a certificate the
                # client does not trust, a ValueError too, which was told "Malformed PostgreSQL URL")
                raise self._malformed(exc) from None
            # (a server's or resolver's text may quote what the URL held: a misread password's piece)
            text = err.redact_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, self.url)
            if _tls_files(exc):  # (as asyncpg's refusal of a default root certificate missing)
                raise self._tls_file_refused(exc, text) from None
            if getattr(exc, "sqlstate", None) == "08P01" and text.lower().startswith("no such database"):
                # (pgbouncer's refusal of a database it has no entry for: 08P01, its code for all
                # its refusals, most of which pass - this one does not, as the server's 3D000)
                raise self._no_database(
                    f"{text} (pgbouncer's answer: it has no entry of that name in its [databases])"
                ) from None
            # (InterfaceError: asyncpg had seen the connection go before its set-up statement -
            # told by its words alone: asyncpg raises a plain InterfaceError for it, as for its
            # other complaints, with no type of its own)
            mismatched = isinstance(exc, asyncpg.exceptions.TargetServerAttributeNotMatched)
            ended = (
                isinstance(exc, asyncpg.InternalClientError | asyncpg.exceptions.ConnectionDoesNotExistError)
                and not mismatched
            ) or (isinstance(exc, asyncpg.InterfaceError) and text.startswith("connection is closed"))
            # (as a read's or a command's: a connection lost, refused or timed out, the server
            # starting up, shutting down or short of what passes - a later open may well work)
            # (but not a host name that does not resolve - a typo, EAI_NONAME: the next open meets
            # the same - only the resolver's temporary failure, EAI_AGAIN)
            transient = ended or (
                not isinstance(exc, asyncpg.InterfaceError)
                and not (isinstance(exc, socket.gaierror) and exc.errno != socket.EAI_AGAIN)
                and _storage_error(exc, "opening", None).details.get("transient") is True
            )
            if ended:  # (their words say nothing of what happened, or that it passes)
                text = (
                    "the session ended as it was set up - the server ended it (a restart, "
                    f"pg_terminate_backend) or the network cut it; try again (asyncpg: {text})"
                )
            elif mismatched:  # (an InternalClientError, but no session ended: none was what it asks)
                text += (
                    " (no host of the URL is what its target_session_attrs asks for - a primary, a "
                    "standby, read-write: check it and the hosts; during a failover, try again)"
                )
            elif isinstance(exc, TimeoutError) and not str(exc):  # (it said only "TimeoutError")
                text = (
                    f"no answer within connect_timeout ({self.connect_timeout:g} s): check the host, "
                    "the port and that the server is up, or set a longer connect_timeout"
                )
            elif (
                transient
                and not _connect_hint(exc)
                and _resource_shortage(getattr(exc, "sqlstate", None)) is None
            ):
                # (a reset, the server shutting down or starting up: their words do not say it passes)
                text += " (a restart, a failover or the network: try again)"
            if getattr(exc, "sqlstate", None) == "3D000":
                raise self._no_database(text) from None
            if getattr(exc, "sqlstate", None) == "42704" and "configuration parameter" in text:
                # (the URL's other ?k=v go to the server as settings: a misspelt option of ours
                # comes back as the server's refusal of a setting it does not know)
                raise err.InvalidInput(
                    f"Cannot connect to PostgreSQL at {self.safe_url}: {text}. A ?k=v in the URL that "
                    f"is not one of evstore's options ({', '.join(OPTIONS)}) is sent to the server as "
                    "a setting: check its spelling",
                    url=self.safe_url,
                ) from None
            setting = self._refused_setting(exc, text)
            if setting is not None:
                if getattr(exc, "sqlstate", None) == "42501":
                    check = (
                        f"this role may not set it ({setting}): leave it out of the URL, or have it "
                        "granted (GRANT SET ON PARAMETER, or a superuser's role)"
                    )
                elif getattr(exc, "sqlstate", None) == "55P02":
                    # (cant_change_runtime_param: a server-wide setting - shared_buffers,
                    # max_connections, archive_timeout - that no session may set, whatever value)
                    inside = re.search(r'"([^"]+)"', text) if setting == "options" else None
                    named = setting if inside is None else f"{inside.group(1)}, in options"
                    check = (
                        f"no session may set it ({named}): it is the server's own, set only in its "
                        "configuration (postgresql.conf or ALTER SYSTEM, read at a restart or a "
                        "reload) - leave it out of the URL"
                    )
                else:
                    check = f"check its value ({setting})"
                raise err.InvalidInput(
                    f"Cannot connect to PostgreSQL at {self.safe_url}: {text}. A ?k=v in the URL that "
                    f"is not one of evstore's options is sent to the server as a setting: {check}"
                    + (
                        " - a schema whose name needs quoting (capitals, spaces, hyphens) is named "
                        "quoted, ?search_path=%22My Schema%22"
                        if setting.lower() == "search_path"
                        else ""
                    ),
                    url=self.safe_url,
                    field=setting,
                    sqlstate=getattr(exc, "sqlstate", None),
                ) from None
            shortage = _resource_shortage(getattr(exc, "sqlstate", None))
            if shortage is not None:  # (too many connections, the server out of memory: says what to do)
                raise err.StorageError(
                    f"Cannot connect to PostgreSQL at {self.safe_url}: {text} ({shortage[1]})",
                    url=self.safe_url,
                    sqlstate=getattr(exc, "sqlstate", None),
                    reason=shortage[0],
                    **({"transient": True} if transient else {}),
                ) from None
            sqlstate = getattr(exc, "sqlstate", None)
            raise err.StorageError(
                f"Cannot connect to PostgreSQL at {self.safe_url}: {text}{_connect_hint(exc)}"
                f"{self._url_note}",
                url=self.safe_url,
                **({"sqlstate": sqlstate} if sqlstate else {}),
                **({"transient": True} if transient else {}),
            ) from None
        except ValueError as exc:
            raise self._malformed(exc) from None
        if self._tickets.closed or self._tickets.pool is not None:
            # (an open again after a failed one, which closed them: each pool has its own)
            self._tickets = _Tickets(self.pool_size)
        self._tickets.pool = self._pool  # (with the pool, in one step: see _ticket_back)
        _OPEN.add(self)
        logging.getLogger("asyncpg.pool").addFilter(_floor_retry)  # (once: a filter added again is not)
        try:
            await self._migrate()
            await self._repair_projection()
        except err.StorageError as exc:
            await self.close()
            if exc.details.get("transient") is not True:
                raise
            # (the connection lost, refused or timed out as the open set the store up - a
            # restart, a failover: as at its first connect, a later open may well work)
            raise type(exc)(f"{exc.message}; the store did not open: try again", **exc.details) from None
        except BaseException:
            await self.close()
            raise

    def _tls_file_refused(self, exc: OSError, text: str) -> err.InvalidInput:
        """A TLS file asyncpg read as it parsed the URL (:func:`_tls_files`) that cannot be used:
        one the URL names, or - the URL naming none - one of the environment (PGSSLROOTCERT, ...)
        or a default in ~/.postgresql (its client certificate is read even under the default
        sslmode, prefer). The file is named (:func:`_tls_file_read`), and ``field`` is the URL's
        option when the URL names it."""
        read = _tls_file_read(exc)
        try:
            keys = {k for k, _ in parse_qsl(urlsplit(self.url).query)}
        except ValueError:
            keys = set()
        return err.InvalidInput(
            f"Cannot use a TLS file the PostgreSQL client reads for {self.safe_url}: {text}"
            + ("" if read is None else f" ({read[0]}: {read[1]})")
            + f" - {_tls_files_hint(read)}",
            url=self.safe_url,
            **({"field": read[0]} if read is not None and read[0] in keys else {}),
        )

    def _refused_setting(self, exc: BaseException, text: str) -> str | None:
        """The key of the URL's query whose value the server refused at the connect (a ?k=v that
        is not evstore's goes to it as a setting): SQLSTATE 22023 (invalid_parameter_value: not
        a number, out of range, an unquoted schema name with a space), 55P02 (a setting only a
        restart changes), 42601 (a malformed ``options``) or 42501 (a setting this role may not
        set: "permission denied to set parameter", a superuser's) whose text names it - or ``options``,
        whose ``-c k=v`` name settings of their own. None: not such a refusal."""
        sqlstate = getattr(exc, "sqlstate", None)
        if sqlstate not in ("22023", "55P02", "42601", "42501"):
            return None
        if sqlstate == "42501" and "to set parameter" not in text:  # (else a privilege of another kind)
            return None
        try:
            keys = [k for k, _ in parse_qsl(urlsplit(self.url).query, keep_blank_values=True)]
        except ValueError:
            return None
        named = [k for k in keys if f'"{k.lower()}"' in text.lower()]
        if named:
            return named[0]
        return "options" if "options" in keys else None

    def _no_database(self, text: str) -> err.NotFound:
        """The server has no database of the URL's name (invalid_catalog_name): nothing there, as
        a missing SQLite directory - not a fault of the server's."""
        return err.NotFound(
            f"Cannot connect to PostgreSQL at {self.safe_url}: {text} (create it first, e.g. with "
            "createdb, or check the URL's database name)",
            url=self.safe_url,
        )

    def _malformed(self, exc: ValueError) -> err.InvalidInput:
        """asyncpg's ValueError parsing the URL's query (``?port=5432/x``, ``?port=a``) as it
        connects: the URL is wrong, not the server. Raised by the pool's first connection, made in
        ``open`` - or, with ``min_pool_size=0``, by the first acquire. (Its text names the value;
        the password is never in it, but is cut out should a parser ever quote the whole URL.)"""
        text = err.redact_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, self.url)
        return err.InvalidInput(
            f"Malformed PostgreSQL URL {self.safe_url}: {text}{self._url_note}", url=self.safe_url
        )

    def _log_lost(self) -> err.CorruptEvent:
        """The refusal of a store whose ``events`` table is gone (dropped by hand - with CASCADE,
        since the projection's view reads it -, or left out of a restore): what it held is lost,
        and no repair can make it again (an empty table would have commands decide against a
        projection of events no longer there; SQLite makes it again, and its commands then refuse)."""
        return err.CorruptEvent(
            f"The store at {self.safe_url} has no events table (dropped by hand, or left out of a "
            "restore): the log is lost - every event it held - and the projection has nothing to "
            "be checked against. Restore the schema from a backup, or `evstore import` an export "
            "of it into a new, empty store (nothing was written)",
            reason="log_lost",
            url=self.safe_url,
        )

    async def _repair_projection(self) -> None:
        """Re-create projection tables, indexes or the view lost from the schema (dropped by hand):
        a lost table, left missing, failed every command and query (and rebuild); made empty, it
        would have every command decide against nothing held. So a lost table is made and the log
        folded into the projection at once, holding writers back. A log that cannot be folded is
        left to the audit (which names the row): the tables stay empty, as it then reports."""
        async with self._connection() as conn:
            try:
                if await conn.fetchval("SELECT to_regclass('events') IS NULL"):
                    raise self._log_lost()
                missing, pending = await _missing_objects(conn), await _refold_pending(conn)
                if not missing and not pending:
                    return
                if not self.upgrade:
                    await self._refuse_repair(conn)
                    return
                async with conn.transaction():
                    await self._fenced(conn)
                    missing = await _missing_objects(conn)  # (another process may have repaired it)
                    await _recreate(conn, missing)
                    pending = await _refold_pending(conn)
                    # (an upgrade's refold is the upgrade's, said by upgraded_from)
                    repaired = None
                    if self.upgraded_from is None and (missing or pending):
                        repaired = SchemaRepair(tuple(missing))
                    self.repaired = repaired
                    if pending:
                        # (left by an older evstore's upgrade whose open failed before its refold;
                        # deleted in this transaction: a failed refold leaves it pending)
                        await conn.execute("DELETE FROM evstore_meta WHERE key = 'refold_pending'")
                        log.warning("projection.columns_added", action="refolding from the log")
                    elif not set(missing) & set(PROJECTION_TABLES):
                        return
                    else:
                        log.warning(
                            "projection.tables_missing", tables=missing, action="refolding from the log"
                        )
                    if await _refold(conn, missing) and repaired is not None:
                        self.repaired = SchemaRepair(repaired.made_again, refolded=True)
            except DB_ERRORS as exc:
                failed = _storage_error(exc, "repairing the projection")
                raise err.StorageError(
                    f"Cannot repair the projection at {self.safe_url}: {failed}",
                    **_kept(failed),
                    url=self.safe_url,
                ) from None

    async def _refuse_repair(self, conn: Any) -> None:
        """For ``upgrade=False``, on a store that looked to need a repair: look again once the
        fence is free, and refuse it if it still does. Another open may be repairing it now, under
        the fence - lost objects made again, or the refold an older evstore's upgrade to version 5
        left pending (this one refolds in the upgrade's own transaction, under the migration lock
        that this open took before) - and a read that waits for that opens the store as repaired
        rather than refusing it as needing it. The fence is taken shared, as every command takes
        it: writers are not held back, and nothing is written."""
        async with conn.transaction():
            await self._take_in_attempts(
                conn,
                "SELECT pg_advisory_xact_lock_shared($1)",
                self._key("!fence"),
                refusal="Another session held evstore's advisory lock for longer than {timeout} (an "
                "open repairing the store's projection, an audit, rebuild or import: pg_locks says "
                "which), so whether the store still needs its repair is unknown; nothing was "
                "written: retry",
            )
            missing, pending = await _missing_objects(conn), await _refold_pending(conn)
        if missing or pending:
            raise self._repair_refused(missing, pending)

    def _repair_refused(self, missing: list[str], pending: bool) -> err.SchemaVersionError:
        """For ``upgrade=False``: the refusal of a store whose projection the open would repair -
        objects to make again (dropped by hand, left out of a restore) and the log to fold into
        them, or the refold an upgrade to schema version 5 left pending (its open failed before
        it): writes, and a projection not to answer from until they are done."""
        why = []
        if missing:
            why.append(f"lacks {', '.join(missing)} (dropped by hand, or a restore left them out)")
        if pending:
            why.append(
                "awaits the refold of its projection that its upgrade to schema version 5 began "
                "(the earlier evstore's open that upgraded it failed before the refold)"
            )
        return err.SchemaVersionError(
            f"The store at {self.safe_url} {', and '.join(why)}: its projection is not to be read until "
            "it is repaired, which opening it would do (making what is missing and folding the log "
            "into it), and this open says not to (upgrade=False, as evstore's commands open a "
            "store, all but upgrade, rebuild and snapshot). Run `evstore upgrade --url ...` or "
            "open it with upgrade=True, which repairs it (nothing was written)",
            url=self.safe_url,
            found=SCHEMA_VERSION,
            supported=SCHEMA_VERSION,
            missing=missing,
            retired=[],  # (SQLite's key: indexes an older version made that the DDL drops)
            refold_pending=pending,
        )

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        _OPEN.discard(self)
        # (the calls waiting for a connection are told now, not at the next release - which may
        # be far off - or at connect_timeout)
        self._tickets.close()
        if pool is not None:
            if self._orphans:  # (acquires left by their callers: see _acquire; each has a timeout)
                _, left = await asyncio.wait(set(self._orphans), timeout=10)
                for orphan in left:
                    orphan.cancel()
            for conn in self._interrupted:  # (see _give_back)
                if not _closed(conn):
                    with contextlib.suppress(asyncpg.InterfaceError):
                        conn.terminate()
            self._interrupted.clear()
            try:
                await asyncio.wait_for(pool.close(), 10)
            except DB_ERRORS:
                # (a connection lost as it was closed - asyncpg's ConnectionDoesNotExistError, a
                # PostgresError, "connection was closed in the middle of operation" - reached the
                # caller of close() bare; the pool terminated itself already: what is left to do
                # is the same)
                pool.terminate()

    def abandon(self) -> None:
        pool, self._pool = self._pool, None
        _OPEN.discard(self)
        if pool is None:
            return
        loop = getattr(pool, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(pool.terminate)  # (asyncpg's transports are the loop's)
        else:
            pool.terminate()

    def _timeout_named(self, option: str) -> str:
        """``option`` with its value, as a timeout message names it: ``command_timeout (0.5 s)``."""
        value = self.connect_timeout if option == "connect_timeout" else self.command_timeout
        return option if value is None else f"{option} ({value:g} s)"

    @contextlib.asynccontextmanager
    async def _connection(self, command: bool = False, lost_again: bool = False) -> AsyncIterator[Any]:
        """A pooled connection. ``command``: it is for a command's transaction, which a failure
        to get one leaves not run (said in the error, with ``outcome_unknown`` False).
        ``lost_again``: a new connection the server ended as the pool set it up (see
        :func:`_lost_at_set_up`) raises :class:`_LostAtAcquire`, for the caller to try again."""
        pool = self._pool
        if pool is None:
            raise err.StoreClosed("The store is closed")
        try:
            conn = await self._acquire(pool)
        except asyncpg.exceptions.InterfaceError as exc:
            if isinstance(exc, ValueError):  # (min_pool_size=0: see open)
                raise self._malformed(exc) from None
            if str(exc).startswith(("pool is closed", "pool is closing")):
                raise err.StoreClosed("The store is closed") from None
            # Any other: a connection the pool had just opened was lost before its set-up
            # statement ran ("connection is closed" from the pool's init: the server ended it, or
            # the network cut it) - a lost connection, as its InternalClientError below, not a
            # closed store (a subscriber ended for good on it, a command heard "closed"); and
            # close() begun meanwhile is told by _not_connected
            failed = self._not_connected(pool, exc, command)
            if lost_again and isinstance(failed, err.StorageError) and _lost_at_set_up(exc):
                raise _LostAtAcquire from None
            raise failed from None
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InternalClientError) as exc:
            # (InternalClientError: the server ended a connection the pool had just opened before
            # its set-up statement ran - "cannot switch to state 15; another operation (2) is in
            # progress" from the pool's init: a connection lost)
            failed = self._not_connected(pool, exc, command)
            if lost_again and isinstance(failed, err.StorageError) and _lost_at_set_up(exc):
                raise _LostAtAcquire from None
            raise failed from None
        except ValueError as exc:  # (min_pool_size=0: the URL is first parsed here; see _malformed)
            raise self._malformed(exc) from None
        if self._pool is None:
            # close() began while this waited for a connection: asyncpg's Pool.close waits only
            # for the connections held when it began, so it hands this one over and then closes
            # it under its holder (a read would fail as a lost connection, not a closed store)
            with contextlib.suppress(OSError, asyncpg.InterfaceError, asyncpg.PostgresError):
                await self._give_back(pool, conn, None)
            raise err.StoreClosed("The store is closed")
        try:
            yield conn
        except BaseException as exc:
            if _timed_out(exc):
                # asyncpg cancels a statement that ran out of command_timeout, and releasing the
                # connection waits for that cancellation, up to command_timeout again: where the
                # server does not answer (a partition), every failure took twice the timeout.
                # Closed instead (the server rolls back what it held; the pool connects anew).
                # (asyncpg may have closed it already - a connection lost as it timed out is
                # detached from its pool proxy, whose terminate() then raises InterfaceError)
                with contextlib.suppress(asyncpg.InterfaceError):
                    conn.terminate()
            elif _maybe_unsynced(exc):
                # (perhaps between a prepare's answer and its Bind/Execute/Sync: _reset_connection;
                # not for a connection closed above, which no reset would take off the set)
                with contextlib.suppress(asyncpg.InterfaceError):
                    self._unsynced.add(conn.get_server_pid())
            raise
        finally:
            with contextlib.suppress(OSError, asyncpg.InterfaceError, asyncpg.PostgresError):
                # (a timeout of its own: asyncpg bounds the release's reset by the acquire's
                # timeout otherwise, what was left of connect_timeout - ~1 ms after retries near
                # its end - and closes a connection whose reset ran out)
                await self._give_back(pool, conn, max(self.connect_timeout, self.command_timeout or 0))

    def _not_connected(self, pool: Any, exc: BaseException, command: bool) -> err.EvstoreError:
        """What a call that got no connection of ``pool`` (:meth:`_connection`) is told, for the
        acquire's error ``exc``."""
        if self._pool is None:
            # (close() began while this waited for one of the pool's connections, all busy:
            # what ran out is a wait for a pool that is gone, not its size - and a command
            # waiting there was not run)
            return err.StoreClosed("The store is closed")
        if getattr(exc, "sqlstate", None) == "3D000":  # (min_pool_size=0: see open; a database dropped)
            return self._no_database(err.redact_text(str(exc).splitlines()[0], self.url))
        if isinstance(exc, OSError) and _tls_files(exc):
            # (a TLS file the URL, the environment or ~/.postgresql names that asyncpg, parsing
            # the URL again for this connection, could not use - removed, replaced, made
            # unreadable since the open: as the open's refusal, naming it)
            text = err.redact_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, self.url)
            refused = self._tls_file_refused(exc, text)
            if command:
                return err.InvalidInput(f"{refused.message}; the command was not run", **refused.details)
            return refused
        # (nothing was sent on it: no claim about a transaction, but for a command's)
        failed = _storage_error(
            exc, f"connecting to {self.safe_url}", None, self._timeout_named("connect_timeout"), url=self.url
        )
        if str(getattr(exc, "sqlstate", None) or "").startswith("28"):
            # (the login refused at a reconnect - the role's password changed, NOLOGIN, a
            # pg_hba.conf entry gone since the open: what to check, as the open's first connect says)
            failed = err.StorageError(f"{failed.message}{_connect_hint(exc)}", **failed.details)
        busy = pool.get_size() >= self.pool_size and not pool.get_idle_size()
        if isinstance(exc, TimeoutError) and busy:
            failed = err.StorageError(
                f"No connection of the pool came free within {self._timeout_named('connect_timeout')}: "
                f"all {self.pool_size} were busy with other calls (raise pool_size, or set "
                "command_timeout so that no call holds one for long)",
                **failed.details,
            )
        elif isinstance(exc, asyncpg.exceptions.TooManyConnectionsError):
            failed = err.StorageError(
                f"{failed.message}; waited {self._timeout_named('connect_timeout')} for one of "
                f"the pool's own connections (pool_size {self.pool_size}) to come free",
                **failed.details,
            )
        if self._url_note and not isinstance(exc, TimeoutError):  # (min_pool_size=0: see open)
            failed = err.StorageError(f"{failed.message}{self._url_note}", **failed.details)
        if command:
            failed = err.StorageError(
                f"{failed.message}; the command was not run", **failed.details, outcome_unknown=False
            )
        return failed

    async def _give_back(self, pool: Any, conn: Any, reset_within: float | None) -> None:
        """``pool.release(conn)``; if that is cancelled, ``conn`` is remembered until released.

        asyncpg runs the release (the wait for a cancellation in flight, the reset) in a task of
        its own, under ``asyncio.shield``, so that its caller's cancellation does not stop it. A
        shutdown cancels every task at once (``asyncio.run``'s way), that one too: made a moment
        before, it was cancelled before its first step and never ran - the connection stayed
        checked out for ever, and the pool's close waited for it (10 s for each store, then
        terminated the pool). The caller cannot tell that from a release still under way (it was
        cancelled again while waiting for one): ``close`` closes those still checked out first.
        (Closing them here cost a connection, and an unretrieved error of asyncpg's release task,
        at every second cancellation during a release.)"""
        try:
            await pool.release(conn, timeout=reset_within)
        except asyncpg.InternalClientError:
            # ("PoolConnectionHolder.release() called on a free connection holder": the connection
            # was lost - pg_terminate_backend, a restart - between asyncpg's release beginning and
            # its task running, and the loss gave the holder back to the pool already. Nothing is
            # left to give back; raised, it replaced the outcome of the command or read that had
            # used the connection - a committed command told "Storage failure")
            pass
        except asyncio.CancelledError:
            interrupted = self._interrupted
            for gone in [c for c in interrupted if _closed(c)]:  # (released since: detached)
                interrupted.discard(gone)
            interrupted.add(conn)
            raise
        finally:
            # (its ticket: see _acquire; cancelled, the release goes on in asyncpg's task, back in
            # the pool a moment later - the next ticket's holder waits for it in asyncpg's queue)
            self._ticket_back(pool)

    def _ticket_back(self, pool: Any) -> None:
        """Give back the ticket of a call on ``pool`` (see _acquire): to the tickets of that pool.
        One of a pool closed and replaced since - a connection held through close() (whose pool
        close ran out: terminated), the backend then opened again - goes to no one: its tickets
        were closed with it, and given to the new pool's it would be one more than its
        connections (a pool of one letting two calls past, the second waiting in asyncpg's queue,
        which the tickets keep empty)."""
        tickets = self._tickets
        if tickets.pool is None or tickets.pool is pool:
            tickets.give()

    async def _opened_one(self, conn: Any) -> None:
        """The pool's ``init``: each connection it opens, counted (see _acquire)."""
        self._search_path = await _init_connection(conn, self._search_path)
        self._opened += 1

    def _refusal_is_cause(self, pool: Any) -> bool:
        """Whether a wait for a connection that ran out is likely the doing of the server's
        refusals for want of a slot: the pool is below its size, the last refusal (of any of
        this store's calls) is recent and the pool has opened no connection since. Otherwise it
        has a cause of its own - a connect the server left unanswered, connections that came
        and stayed busy - which the refusal would hide."""
        if self._last_refusal is None or pool.get_size() >= self.pool_size:
            return False
        opened, at = self._last_refusal
        return opened == self._opened and asyncio.get_running_loop().time() - at <= _REFUSAL_FRESH

    async def _acquire(self, pool: Any) -> Any:
        """``pool.acquire()``; when the server refuses the pool another connection (too many
        for ``max_connections`` or the role's ``CONNECTION LIMIT``: ``pool_size`` is more than
        it allows), the next connection the pool's holders release, for up to
        ``connect_timeout`` - as when all ``pool_size`` connections are busy - rather than
        failing the command or read that happened to need one more.

        A call first takes one of ``pool_size`` tickets (:class:`_Tickets`, in turn; given back
        with the connection, see _give_back): the pool's acquire then finds a connection free (or
        one to open), and waits in asyncpg's queue only for a moment (a release cut short that
        finishes, the pool reopening a free one for min_pool_size). A caller cancelled while it waits for a
        ticket leaves nothing behind; one cancelled during the acquire leaves it to finish (see
        _shielded), which it does at once. Waiting in asyncpg's queue, each cancelled caller's
        acquire took the next connection to come free (to give it back after its reset): live
        callers waited behind every caller cancelled before them, under a storm of cancellations
        (callers with timeouts) for as long as it lasted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        pause = 0.005
        refused: asyncpg.exceptions.TooManyConnectionsError | None = None
        # (bounded: without a timeout, a call waited for every call ahead of it, each up to
        # command_timeout, or for ever without one)
        await self._tickets.take(self.connect_timeout)
        ticket = True  # (still this call's to give back: not handed on with a connection or an acquire)
        try:
            while True:
                try:
                    try:
                        conn = await self._shielded(pool, max(0.001, deadline - loop.time()))
                    except asyncio.CancelledError:
                        ticket = False  # (the acquire left to finish gives it back: see _settle)
                        raise
                    ticket = False  # (with the connection: see _give_back)
                    return conn
                except asyncpg.exceptions.TooManyConnectionsError as exc:
                    self._last_refusal = (self._opened, loop.time())
                    if loop.time() + pause > deadline or self._pool is None:
                        raise
                    refused = exc
                except TimeoutError:
                    # (the wait ran out after the server refused a connection for want of a slot:
                    # that refusal is the cause, not a server that "did not answer" - if it still is)
                    if refused is not None and self._refusal_is_cause(pool):
                        raise refused from None
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.1)
        finally:
            if ticket:
                self._ticket_back(pool)

    async def _shielded(self, pool: Any, within: float) -> Any:
        """``pool.acquire(timeout=within)``, which its caller's cancellation does not stop.

        Cancelled while the pool opened a connection for it, under the default sslmode (prefer:
        asyncpg asks the server for TLS first), asyncpg closes the half-made connection and its
        protocol sets an error nobody awaits - asyncio then logs "Future exception was never
        retrieved ... unexpected connection_lost() call" (MagicStack/asyncpg#1211, #1310). The
        acquire runs in a task of its own: the caller sees its cancellation at once, and the
        connection that arrives after it has gone is given back (close waits for those)."""
        attempt = asyncio.ensure_future(pool.acquire(timeout=within))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            orphan = asyncio.ensure_future(self._settle(pool, attempt))
            self._orphans.add(orphan)
            orphan.add_done_callback(self._orphans.discard)
            raise

    async def _settle(self, pool: Any, attempt: asyncio.Future[Any]) -> None:
        """Gives back the connection of an acquire whose caller was cancelled (see _shielded),
        and with it the caller's ticket (see _acquire)."""
        try:
            conn = await attempt
        except asyncio.CancelledError:
            self._ticket_back(pool)
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # (this one's own: a shutdown's, close's)
                raise
            return  # (no connection: nothing to give back)
        except Exception:
            self._ticket_back(pool)
            return
        with contextlib.suppress(OSError, asyncpg.InterfaceError, asyncpg.PostgresError):
            await self._give_back(pool, conn, max(self.connect_timeout, self.command_timeout or 0))

    async def _migrate(self) -> None:
        found, upgrading, creating = 0, False, False
        async with self._connection() as conn:
            try:
                # The schema that holds the store: the first of the search_path to hold one (the
                # one every unqualified name resolves to), else where it is to be created. Lock
                # keys are made from it: processes sharing the tables share the locks, whatever
                # the search_path each names them by.
                schema = await conn.fetchval(STORE_SCHEMA)
                # (pg_temp first in the search_path, and no store after it: each session has a
                # temporary schema of its own, gone with it - each pooled connection would have
                # made, or looked for, a store of its own. No other schema's name may start so,
                # "pg_" being PostgreSQL's; one not made yet in this session is in no list of
                # schemas found, but in the search_path the session began with)
                if (schema or "").startswith("pg_temp_") or (
                    schema is None and await conn.fetchval(TEMP_SCHEMA_FIRST)
                ):
                    raise err.InvalidInput(
                        f"The search_path of {self.safe_url} puts the store in pg_temp, the "
                        "session's temporary schema: each connection has its own, and its tables go "
                        "when the session ends. Name the schema that holds, or is to hold, the store "
                        "(?search_path=...) before pg_temp, or leave pg_temp out",
                        url=self.safe_url,
                        field="search_path",
                    )
                if schema == "information_schema":  # (a superuser's search_path could name it)
                    raise err.InvalidInput(
                        f"The search_path of {self.safe_url} puts the store in information_schema, "
                        "PostgreSQL's own schema, which pg_dump leaves out of every backup: name a "
                        "schema of the database's (?search_path=...)",
                        url=self.safe_url,
                        field="search_path",
                    )
                if schema is not None:
                    await self._refuse_shadowed(conn, schema)
                if schema is None and not self.create:  # (nothing to open: no store there)
                    raise err.NotFound(
                        f"No evstore store at {self.safe_url}: no schema of its search_path exists, "
                        "or this role lacks USAGE on it (check the URL's search_path and the role's "
                        "privileges)",
                        url=self.safe_url,
                    )
                if schema is None:  # (as SQLite's missing directory: a place to create in, not there)
                    raise err.NotFound(
                        f"Cannot open {self.safe_url}: no schema of the search_path exists to create "
                        "the store in, or this role lacks USAGE on it (create it first: CREATE "
                        "SCHEMA, or check the URL's search_path and the role's privileges)",
                        url=self.safe_url,
                    )
                database = await conn.fetchval("SELECT current_database()")
                self._namespace = f"{database}.{schema}"
                async with conn.transaction():
                    # Serialise concurrent opens of the same store; the key is per database+schema.
                    await self._take_migration_lock(conn)
                    found = 0
                    exists = await conn.fetchval("SELECT to_regclass('evstore_meta')") is not None
                    if not exists and await _holds_evstore_events(conn, schema):
                        raise await _lost_version(conn, self.safe_url, schema, "table", None)
                    if not exists and not self.create:
                        raise err.NotFound(
                            f"No evstore store in schema {schema!r} of {self.safe_url} (check the URL "
                            "and its search_path, or create one, e.g. with `evstore demo --url ...`)",
                            url=self.safe_url,
                        )
                    if exists:
                        try:
                            value = await conn.fetchval(
                                "SELECT value FROM evstore_meta WHERE key = 'schema_version'"
                            )
                        except asyncpg.exceptions.InsufficientPrivilegeError as exc:
                            # (the open's first read of the store: told as a read's, not as the
                            # migration's write a role that may not read would be told it lacks)
                            raise err.StorageError(
                                f"Cannot open the store at {self.safe_url}: {str(exc).splitlines()[0]} "
                                f"({NO_READ_PRIVILEGE_HINT})",
                                url=self.safe_url,
                                sqlstate=exc.sqlstate,
                            ) from None
                        parsed = parse_version(value)
                        if (parsed is None or parsed < 1) and await _holds_evstore_events(conn, schema):
                            lost: Literal["row", "value"] = "row" if value is None else "value"
                            raise await _lost_version(conn, self.safe_url, schema, lost, value)
                        found = parsed or 0
                        if found < 1:  # (evstore writes its tables and a version >= 1 together)
                            held = (
                                "no schema version"
                                if value is None
                                else f"schema version {shown(value, 40)}, "
                                + ("not a number" if parsed is None else "not one evstore writes")
                            )
                            raise err.SchemaVersionError(
                                f"The schema {schema!r} of {self.safe_url} holds an evstore_meta "
                                f"table with {held}, and no evstore log: it is not a store "
                                "evstore wrote (another application's table?). Put the store in a "
                                "schema of its own (?search_path=...); nothing was written",
                                url=self.safe_url,
                                schema=schema,
                                found=value,
                            )
                    if found > SCHEMA_VERSION:
                        raise err.SchemaVersionError(
                            f"This database has schema version {found}; this evstore understands up "
                            f"to {SCHEMA_VERSION}. Upgrade evstore to open it.",
                            found=found,
                            supported=SCHEMA_VERSION,
                        )
                    upgrading = 0 < found < SCHEMA_VERSION
                    if upgrading and not self.upgrade:
                        raise err.SchemaVersionError(
                            f"The store at {self.safe_url} has schema version {found}, written by "
                            f"an older evstore: opening it would upgrade it to {SCHEMA_VERSION}, "
                            "which closes it to the older evstore processes still using it, and "
                            "this open says not to (upgrade=False, as evstore's commands open a store, "
                            "all but upgrade, rebuild and snapshot). Once no older evstore uses it, "
                            "run `evstore upgrade --url ...` or open it with upgrade=True (nothing was "
                            "written)",
                            url=self.safe_url,
                            found=found,
                            supported=SCHEMA_VERSION,
                        )
                    # 5 added a column the fold fills: the projection of an older store is
                    # refolded, in this transaction, so that no committed state has the new
                    # version with the projection still to refold (a read-only open looking then
                    # refused the store; a process dying before the refold left it to the next
                    # open). Writers are held back first, before the migrations lock the tables
                    # they use, so no wait forms a cycle with them.
                    refold = 0 < found < 5
                    if refold:
                        await self._fence_for_upgrade(conn)
                    creating = not found  # (a new store: its tables made in the schema)
                    for version in range(found, SCHEMA_VERSION):
                        try:
                            await conn.execute(MIGRATIONS[version])
                        except asyncpg.exceptions.DuplicateTableError as exc:
                            if found:
                                # (a table or index an upgrade adds: the schema holds another
                                # application's of that name; the transaction rolls back)
                                raise err.StorageError(
                                    f"Cannot upgrade the store in schema {schema!r} of "
                                    f"{self.safe_url} from schema version {found} to "
                                    f"{SCHEMA_VERSION}: the upgrade creates a table or index the "
                                    f"schema already holds ({str(exc).splitlines()[0]}), and it is "
                                    "not evstore's: another application's? rename it, or move it "
                                    "to another schema, and open the store again; nothing was "
                                    "written (the upgrade was rolled back)",
                                    url=self.safe_url,
                                    schema=schema,
                                    found=found,
                                    supported=SCHEMA_VERSION,
                                ) from None
                            # (a new store's first tables: the schema holds another
                            # application's of the same name, and PostgreSQL's own message
                            # alone reads as evstore's fault; the transaction rolls back)
                            raise err.StorageError(
                                f"Cannot create the store in schema {schema!r} of {self.safe_url}: "
                                f"{str(exc).splitlines()[0]}, and it is not evstore's (the schema "
                                "has no evstore_meta): another application's? Put the store in a "
                                "schema of its own (?search_path=...); nothing was written",
                                url=self.safe_url,
                                schema=schema,
                            ) from None
                    if refold:
                        # (every committed event positioned - by the sequencer the migrations
                        # left - then folded)
                        await _sequence(conn, self._key("!sequencer"), True, [])
                        log.warning("projection.columns_added", action="refolding from the log")
                        await _refold(conn, [])
                    if found < SCHEMA_VERSION:
                        await conn.execute(
                            "INSERT INTO evstore_meta VALUES ('schema_version', $1) "
                            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                            str(SCHEMA_VERSION),
                        )
                # (committed: an open that failed past here upgraded it all the same)
                self.upgraded_from = found if upgrading else None
            except DB_ERRORS as exc:
                if upgrading and isinstance(_reason(exc), CANNOT_WRITE):
                    # (a read-only role, database or hot standby opening a store an older evstore
                    # wrote: what it is missing is the upgrade, which only a writer can make)
                    raise err.SchemaVersionError(
                        f"The store at {self.safe_url} has schema version {found}, written by an "
                        f"older evstore; this evstore needs {SCHEMA_VERSION} and upgrades it on "
                        f"first open, which this session cannot do ({_reason(exc)}): open it once "
                        "with the role that owns the store, on the primary (stop the older "
                        "evstore processes first), or read it with the evstore that wrote it",
                        url=self.safe_url,
                        found=found,
                        supported=SCHEMA_VERSION,
                    ) from None
                if creating and isinstance(_reason(exc), asyncpg.exceptions.InsufficientPrivilegeError):
                    # (README: the first open, which creates the store, needs CREATE on the schema)
                    raise err.StorageError(
                        f"Cannot create the store at {self.safe_url}: {_reason(exc)} - creating a store "
                        "needs CREATE on the schema (GRANT CREATE ON SCHEMA ... TO the role), or open "
                        "it once with a role that may create there, e.g. the schema's owner; nothing "
                        "was written",
                        url=self.safe_url,
                        sqlstate=getattr(_reason(exc), "sqlstate", None),
                    ) from None
                failed = _storage_error(exc, "migrating")
                raise err.StorageError(
                    f"Cannot prepare the store at {self.safe_url}: {failed}",
                    url=self.safe_url,
                    **_kept(failed),
                ) from None

    async def _take_migration_lock(self, conn: Any) -> None:
        """Inside a transaction: the store's migration lock, which serialises opens. Waited for
        ``connect_timeout`` at a time: a session that holds it longer is stuck (another open's
        migration never takes that long), and must not make open() hang for good - unless it holds
        the store's "!refolding" lock too: an upgrade folding the log into the projection in its
        transaction (see _migrate), which takes as long as the log is long. That is waited for as
        the fence is, for at most ``command_timeout`` when one is set."""
        loop = asyncio.get_running_loop()
        deadline = None if self.command_timeout is None else loop.time() + self.command_timeout
        wait_ms = max(1, int(self.connect_timeout * 1000))
        while True:
            try:
                async with conn.transaction():  # (a savepoint: a wait that ran out is undone alone)
                    await conn.execute(f"SET LOCAL lock_timeout = {wait_ms}")
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", self._key("!migrate"))
                break
            except asyncpg.LockNotAvailableError:
                refolding = await conn.fetchval(ADVISORY_LOCK_HELD, *_lock_tag(self._key("!refolding")))
                if not refolding or (deadline is not None and loop.time() >= deadline):
                    waited = "connect_timeout" if not refolding else "command_timeout"
                    raise err.StorageError(
                        f"Cannot open {self.safe_url}: another session has held the store's "
                        f"migration lock for over {self._timeout_named(waited)}"
                        + (
                            ": a stuck process? (pg_locks shows it)"
                            if not refolding
                            else ", upgrading the store and refolding its projection: retry once "
                            "it is done (pg_locks shows it)"
                        ),
                        url=self.safe_url,
                    ) from None
        await conn.execute("SET LOCAL lock_timeout TO DEFAULT")

    async def _fence_for_upgrade(self, conn: Any) -> None:
        """Inside the upgrade's transaction, under the migration lock, before its migrations: say
        that the upgrade refolds the projection (the "!refolding" lock, which opens waiting for the
        migration lock look for), then hold writers back (the fence, as :meth:`_fenced` takes it)."""
        await conn.execute("SELECT pg_advisory_xact_lock($1)", self._key("!refolding"))
        await self._take_in_attempts(
            conn,
            "SELECT pg_advisory_xact_lock($1)",
            self._key("!fence"),
            refusal="Another session held evstore's advisory lock for longer than {timeout}, so the "
            "upgrade could not hold writers back to refold the store's projection; nothing was "
            "written (the upgrade was rolled back): retry. pg_locks says which: another process's "
            "audit, rebuild or import holds it exclusive, a client stuck inside a command (an "
            "older evstore's) holds it shared",
        )

    async def _refuse_shadowed(self, conn: Any, schema: str) -> None:
        """Refuse a search_path that names, before the store's ``schema``, a schema holding a
        table, view, sequence or function of one of evstore's names (another application's
        ``events``): every unqualified name resolves to the first schema holding it, so the store
        would be read, and written, there - its reads failed, "column "position" does not
        exist". One statement, at open."""
        found = await conn.fetch(SHADOWING, schema, list(STORE_RELATIONS), list(STORE_FUNCTIONS))
        if found:
            held = ", ".join(f"{r['nspname']}.{r['name']}" for r in found)
            raise err.InvalidInput(
                f"The search_path of {self.safe_url} names a schema before the store's ({schema!r}) "
                f"that holds what evstore's names would resolve to instead of the store's: {held} "
                "(another application's?). Put the store's schema first in the search_path "
                f"(?search_path={_in_url(schema)}, ...), or leave that schema out; nothing was read or "
                "written",
                url=self.safe_url,
                field="search_path",
                schema=schema,
            )

    def _key(self, name: str) -> int:
        digest = hashlib.blake2b(f"{self._namespace}\x1f{name}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big", signed=True)

    # --- writing --------------------------------------------------------------------------

    async def run_jobs(self, jobs: Sequence[Job]) -> list[Outcome]:
        """Run the jobs concurrently, each in its own transaction on its own connection (see
        :meth:`start_jobs`), and return their outcomes in order."""
        return list(await asyncio.gather(*self.start_jobs(jobs)))

    def start_jobs(
        self, jobs: Sequence[Job], wanted: Sequence[Callable[[], bool]] | None = None
    ) -> list[asyncio.Task[Outcome]]:
        """Start each job now, in its own transaction on its own connection (as many at once as
        the pool has connections), and return its task.

        A job that names an entity (consumer, provider, name, idempotency key) named by a job
        started earlier waits until that one's transaction has ended: such jobs commit in the
        order they were started, the order their callers queued them (and take no connection
        just to wait for each other's locks). Entities a job reaches only while loading (a
        migration's instance, the providers of a consumer's allocations) are serialised by the
        database's locks, in no promised order. A job naming a custom class waits for a creation
        of that class started earlier, not for the other jobs naming it. The others run in
        parallel: a job waiting for a lock held by another process holds back only the jobs that
        share an entity with it.
        ``wanted[i]()`` is asked when job ``i`` is about to begin its transaction: if its caller
        has given up meanwhile, it does not run.
        """
        if self._pool is None:
            raise err.StoreClosed("The store is closed")
        last = self._last_of
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[Outcome]] = []
        for i, job in enumerate(jobs):
            names = _lock_names(job)
            # (a command naming a custom class also waits for a creation of it queued before it)
            before = {last[n] for n in names | _classes_named(job) if n in last}
            ended: asyncio.Future[None] = loop.create_future()  # (its transaction)
            for n in names:
                last[n] = ended
            ended.add_done_callback(functools.partial(self._forget_last, names))
            self._started += 1
            still = wanted[i] if wanted is not None else None
            task = asyncio.ensure_future(self._run_after(before, job, self._started, ended, still))
            # However the task ends (even cancelled before its first step), its successors go
            # only once its own predecessors have ended too.
            task.add_done_callback(functools.partial(_end_when_done, ended, before))
            tasks.append(task)
        return tasks

    def _forget_last(self, names: Iterable[str], ended: asyncio.Future[None]) -> None:
        last = self._last_of
        for n in names:
            if last.get(n) is ended:
                del last[n]

    async def _run_after(
        self,
        before: set[asyncio.Future[None]],
        job: Job,
        order: int,
        ended: asyncio.Future[None],
        wanted: Callable[[], bool] | None,
    ) -> Outcome:
        try:
            if before:
                await asyncio.wait(before)
            await self._slots.acquire(order)
        except asyncio.CancelledError:
            # Cancelled before it began (a shutdown cancelling every task, this one too): it was
            # not run, and that is what its caller, or the log for a caller cancelled as well,
            # hears - not that its outcome is unknown
            return err.StorageError("Not run: cancelled before it began", not_run=True)
        try:
            if wanted is not None and not wanted():
                return err.StorageError("Not run: its caller stopped waiting before it began", not_run=True)
            return await self._run_job(job, ended)
        except err.EvstoreError as exc:
            return exc
        except Exception as exc:  # a backend bug must not take the batch down
            # (raised where the backend could not say whether the command committed: unknown)
            return err.StorageError(f"Storage failure: {exc!r}", outcome_unknown=True)
        finally:
            self._slots.release()

    async def _run_job(self, job: Job, ended: asyncio.Future[None] | None = None) -> Outcome:
        keys = {self._key(n) for n in _lock_names(job)}
        attempt = 0
        positioning = 0  # (rounds that positioned a tombstone: no fault, so not an attempt)
        while True:
            try:
                result = await self._attempt(job, keys, ended)
                break
            except _Relock as relock:
                keys = relock.keys
            except _Unpositioned as pending:
                # (rolled back; its connection is free: the sequencer needs one, even in a pool of
                # one). Each round positions what it found (or raises): another comes only if
                # another consumer of the slice was deleted meanwhile.
                positioning += 1
                if positioning > max(self.max_retries, 3):
                    raise err.StorageError(
                        f"Committed events {pending.seqs} did not get positions; the command was not run",
                        seqs=pending.seqs,
                        outcome_unknown=False,
                    ) from None
                try:
                    await self._tombstone_positions(pending.seqs)
                except err.StorageError as exc:
                    # (a read's or the sequencer's error - a connection lost, say - under a
                    # command that was rolled back first: not run, as it says; a damaged
                    # projection's own error keeps its type and words)
                    if type(exc) is not err.StorageError:
                        exc.details.setdefault("outcome_unknown", False)
                        raise
                    raise err.StorageError(
                        f"{exc.message} (positioning the deleted consumers' tombstones the command "
                        "met); the command was not run",
                        **{**exc.details, "outcome_unknown": False},
                    ) from None
            except _StaleConnection as stale:
                attempt += 1
                if attempt >= self.max_retries:
                    # (each connection was lost at the command's BEGIN: nothing of it was sent -
                    # not run, as a command that got no connection, and transient as a lost one)
                    failed = _storage_error(
                        stale.lost, f"beginning a command on {self.safe_url}", None, keyed=False
                    )
                    raise err.StorageError(
                        f"{failed.message} (each of the {attempt} connections tried, of max_retries "
                        f"{self.max_retries}); the command was not run",
                        **failed.details,
                        outcome_unknown=False,
                    ) from None
            except asyncpg.PostgresError as exc:
                if exc.sqlstate not in RETRYABLE_SQLSTATES:
                    raise _storage_error(exc, "running a command") from None
                attempt += 1
                if attempt >= self.max_retries:
                    # (each try rolled back by the server's answer: not run)
                    raise err.StorageError(
                        f"Gave up after {attempt} attempts (max_retries), each rolled back by "
                        f"PostgreSQL: {str(exc).splitlines()[0]}; the command was not run (other "
                        "sessions contended with it for the same rows and locks: retry it, or "
                        "raise max_retries)",
                        sqlstate=exc.sqlstate,
                        outcome_unknown=False,
                    ) from None
                await asyncio.sleep(random.uniform(0, 0.002 * 2**attempt))
        if ended is not None and not ended.done():
            ended.set_result(None)  # (rolled back: the next job on its entities may go)
        return result

    async def _committed(
        self,
        held: contextlib.AsyncExitStack,
        conn: Any,
        job: Job,
        ended: asyncio.Future[None] | None,
        receipt: Receipt,
        seqs: list[int],
    ) -> Receipt:
        """The receipt of a committed command, with its positions. The sequencer runs first on
        the command's own connection, ``conn`` (one pool release and acquire fewer per command);
        if that fails, ``held`` gives the connection back and the usual path runs on pooled ones."""
        if ended is not None and not ended.done():
            ended.set_result(None)  # (committed: the next job on its entities may go)
        hook = self._after_commit
        if hook is not None:
            await hook(None)
        if not seqs:
            return receipt
        try:
            positions = await self._positions_here(seqs, conn)
            if positions is None:
                await held.aclose()
                positions = await self._positions_of(seqs)
        except Exception as exc:
            # The command is committed: whatever failed here (the sequencer timed out waiting for
            # its lock, the connection died), it must not be reported as rolled back.
            cause = exc.message if isinstance(exc, err.EvstoreError) else f"{type(exc).__name__}: {exc}"
            hint = (
                "retry with the same idempotency key to get its receipt"
                if job.idempotency_key is not None
                else "do not retry it (it was sent without an idempotency key: a retry runs it again)"
            )
            raise err.StorageError(
                f"The command was committed, but reading its positions failed ({cause}); {hint}",
                committed=True,
                outcome_unknown=True,
            ) from None
        return Receipt(
            positions, receipt.consumer_generations, receipt.provider_generations, receipt.replayed
        )

    async def _attempt(
        self, job: Job, keys: set[int], ended: asyncio.Future[None] | None = None
    ) -> Receipt | err.EvstoreError:
        """One transaction for ``job``: its receipt, with positions (see _committed), or its error."""
        async with contextlib.AsyncExitStack() as held:
            conn = await held.enter_async_context(self._connection(command=True))
            committing = False
            try:
                # (asyncpg's transaction as a context manager - entered and left by a stack of its
                # own, so that only BEGIN's failures are told apart below: one started and ended
                # by hand that a cancellation - a shutdown's - stopped at its BEGIN, or whose
                # ROLLBACK it stopped, stayed the connection's, and the pool's reset logged
                # "Resetting connection with an active transaction" at ERROR for it)
                async with contextlib.AsyncExitStack() as transaction:
                    try:
                        await transaction.enter_async_context(conn.transaction())
                    except DB_ERRORS as exc:
                        if _is_connection_error(exc) and not isinstance(exc, TimeoutError):
                            raise _StaleConnection(exc) from None  # nothing was sent: safe to retry
                        # (a BEGIN that ran out of command_timeout is no dead connection: the
                        # server did not answer - a partition - and the pool's next one would
                        # wait as long)
                        raise
                    outcome = await self._decide_and_append(conn, job, keys)
                    if isinstance(outcome, err.EvstoreError):
                        raise _Refused(outcome)  # (rolled back on the way out)
                    hook = self._before_commit
                    if hook is not None:
                        await hook(conn)
                    committing = True
                # (committed on the way out of the block above)
            except _Refused as refused:
                return refused.outcome
            except BaseException as exc:
                decided = _refusal_under(exc)
                if decided is not None and isinstance(exc, DB_ERRORS):
                    # A refusal's ROLLBACK met a lost connection (or ran out of time): nothing
                    # was written - a refusal is decided before any write, and the server rolls
                    # back a lost session's transaction - so the refusal stands, not a storage
                    # error that sent its caller to try again. (Closed: no reset to wait for.)
                    with contextlib.suppress(asyncpg.InterfaceError):
                        conn.terminate()
                    if isinstance(decided, _Refused):
                        return decided.outcome
                    # (a restart - locks to take in order, a tombstone to position - whose
                    # ROLLBACK was lost: restarted as it would have been, on another connection)
                    raise decided from None
                if isinstance(exc, asyncpg.PostgresError) and exc.sqlstate in RETRYABLE_SQLSTATES:
                    raise
                if isinstance(exc, asyncpg.PostgresError) or _is_connection_error(exc):
                    raise _storage_error(
                        exc,
                        "running a command",
                        committing,
                        self._timeout_named("command_timeout"),
                        keyed=job.idempotency_key is not None,
                    ) from None
                raise
            return await self._committed(held, conn, job, ended, *outcome)

    async def _decide_and_append(
        self, conn: Any, job: Job, locked: set[int]
    ) -> tuple[Receipt, list[int]] | err.EvstoreError:
        key = job.idempotency_key
        fence: int | None = self._key("!fence")
        to_lock = sorted(locked)
        alone = len(locked) > LOCK_ALONE_ABOVE
        if alone:
            # (every other writer waits at the fence, taken shared before any lock of theirs: no
            # entity lock is needed, nor can a wait for one close a cycle with this one)
            await conn.execute("SELECT pg_advisory_xact_lock($1)", fence)
            fence, to_lock = None, []
        if key is not None:
            # the key's lock first: the stored receipt is read under it
            await conn.execute("SELECT evstore_lock($1, $2)", fence, to_lock)
            fence, to_lock = None, []
            row = await conn.fetchrow("SELECT fingerprint, receipt FROM idempotency WHERE key = $1", key)
            if row is not None:
                if not job.same_command(row["fingerprint"]):
                    return err.IdempotencyConflict(
                        f"Idempotency key {key!r} was already used for a different command (a retry repeats "
                        "its command exactly; give a new command a new key)",
                        idempotency_key=key,
                    )
                replayed = Receipt.stored(key, row["receipt"])
                seqs = list(replayed.positions)  # (stored as seqs: each must be an event's)
                if seqs and await conn.fetchval(
                    "SELECT count(*) FROM events WHERE seq = ANY($1::bigint[])", seqs
                ) != len(set(seqs)):
                    raise Receipt.damaged(key, f"seqs {shown(seqs, 60)} name no events of the log")
                return replayed, seqs
        # A command naming only consumers (a release, a revert, a migration's start) learns of its
        # providers and migrations by loading: each found beyond its locks cost one more load (and
        # a try-lock when its key sorts below a held one). What its consumers were loaded with
        # before here is guessed: those locks are taken in the same load, each only if free at
        # once. A wrong guess costs nothing but the lock (to this transaction's end) of an entity
        # not needed; what the load finds beyond the locks is locked as before.
        near: list[int] = [] if alone else self._near_keys(job, locked)
        # Guessed locks taken but not (yet) found needed: held, so they count in the order of any
        # wait, but left out of ``locked`` (a restart's or a retry's set, waited for in order): a
        # stale guess kept there was waited for by the next attempt.
        spare: set[int] = set()
        while True:
            state, taken = await lock_load(conn, job.needs, fence, to_lock, near)
            near = []
            found = {self._key(n) for n in _slice_names(state)}
            spare |= taken
            locked |= spare & found
            spare -= found
            extra = found - locked
            if not extra or alone:
                break
            if len(locked | spare | extra) > LOCK_ALONE_ABOVE:
                raise _Relock(locked | extra)  # (rolled back: run again alone, see LOCK_ALONE_ABOVE)
            if min(extra) > max(locked | spare):
                # lock them and reload: what we read before holding these locks may be stale
                fence, to_lock = None, sorted(extra)
                locked |= extra
                continue
            # Out of order: waiting for them while holding larger keys could close a cycle. Take
            # them only if they are free right now (no wait, so no cycle), then reload under the
            # whole set; if one is held elsewhere, restart with every lock taken in order.
            if await conn.fetchval(TRY_LOCK, sorted(extra)):
                fence, to_lock = None, []
                locked |= extra
                continue
            raise _Relock(locked | extra)
        pending = _unpositioned_tombstones(state.consumers.values())
        if pending:
            raise _Unpositioned(pending)
        before = persisted.clone(state)
        try:
            events = decide(job.command, state)
        except err.EvstoreError as exc:
            return exc
        for index, event in enumerate(events):
            evolve(state, event, OWN_EVENT - index)  # -seq once inserted (see evstore_write)
        self._remember_near(state)
        seqs = []
        if events:
            seqs = await write(conn, events, job.metadata_json, persisted.changes(before, state))
        n = job.needs
        receipt = Receipt(
            tuple(seqs),
            {c: state.consumer(c).generation for c in sorted(n.consumers | set(state.consumers))},
            {u: state.providers[u].generation for u in sorted(state.providers)},
        )
        if key is not None:
            await conn.execute(
                "INSERT INTO idempotency VALUES ($1, $2, $3)", key, job.fingerprint, receipt.to_json()
            )
        return receipt, seqs

    def _near_keys(self, job: Job, locked: set[int]) -> list[int]:
        """The lock keys of the entities ``job``'s consumers were last loaded with here, beyond
        ``locked`` (see _remember_near); none past NEAR_SLICE_MAX (a command naming many
        consumers, each remembered with others, would take that many more locks - toward the
        server's max_locks_per_transaction - for entities it may not touch: it finds them as
        before)."""
        near = self._near
        guess: set[str] = set()
        for c in job.needs.consumers | job.needs.migrations_of:
            known = near.get(f"consumer:{c}")
            if known is not None:
                guess |= known
                if len(guess) > NEAR_SLICE_MAX:
                    return []
        return sorted({self._key(n) for n in guess} - locked)

    def _remember_near(self, state: State) -> None:
        """Remember, for each consumer of a small slice, the entities it was found with (see
        _run_job): the slice after the command, joined with what was remembered for its consumers
        (a migration's instance and its migration are loaded together only by some commands).
        Bounded: a joined set grown past NEAR_SLICE_MAX starts again from the slice; the oldest
        consumers are forgotten first."""
        names = set(_slice_names(state))
        if len(names) > NEAR_SLICE_MAX:
            return
        near = self._near
        joined = set(names)
        for n in names:
            known = near.get(n)
            if known is not None:
                joined |= known
        kept = frozenset(joined if len(joined) <= NEAR_SLICE_MAX else names)
        for n in kept:
            if n.startswith("consumer:"):
                near.pop(n, None)  # (re-inserted last: the oldest entry is the first)
                near[n] = kept
        while len(near) > NEAR_KEPT:
            del near[next(iter(near))]

    # --- the sequencer --------------------------------------------------------------------

    async def _tombstone_positions(self, seqs: Sequence[int]) -> tuple[int, ...]:
        """Positions of the events of tombstones found unpositioned (``deleted_at`` = ``-seq``).
        A seq no event has is a damaged row, not an event waiting for the sequencer: said at once
        (ProjectionCorrupt, which a rebuild repairs) rather than after runs that cannot help."""
        async with self._connection() as conn:
            held = await self._guard(
                conn.fetch("SELECT seq FROM events WHERE seq = ANY($1::bigint[])", list(seqs)),
                "reading events",
            )
        missing = sorted(set(seqs) - {r["seq"] for r in held})
        if missing:
            raise err.ProjectionCorrupt(
                f"A consumer's tombstone names events the log does not hold (seqs {missing[:5]}): the "
                "projection is damaged, or the log lost its last events (`evstore audit` says which; "
                "`evstore rebuild` refolds the projection from the log, with --force when the log lost "
                "events, forgetting them)",
                seqs=missing,
            )
        return await self._positions_of(seqs)

    async def _positions_of(self, seqs: Sequence[int]) -> tuple[int, ...]:
        """Positions of committed events, running the sequencer if they have none yet."""
        want = list(seqs)
        for _ in range(3):
            shared: dict[int, int | None] = {}
            found = await self._sequenced(want, shared=shared)
            if found is None and None not in (known := [shared.get(s) for s in want]):
                found = known  # (as the run this task shared found them)
            if found is None:  # positioned by a run this task shared: read them
                async with self._connection() as conn:
                    row = await self._guard(
                        conn.fetchval("SELECT evstore_positions($1)", want),
                        "reading positions",
                    )
                found = list(row)
            positions = [p for p in found if p is not None]
            if len(positions) == len(want):
                return tuple(positions)
        raise err.StorageError(f"Committed events {want} did not get positions", seqs=want)

    async def _positions_here(self, seqs: Sequence[int], conn: Any) -> tuple[int, ...] | None:
        """:meth:`_positions_of` in one try on ``conn``, the caller's connection (outside a
        transaction); ``None`` if that fails (then :meth:`_positions_of` on pooled connections,
        once ``conn`` is back in the pool: it may be the pool's only one)."""
        want = list(seqs)
        shared: dict[int, int | None] = {}
        try:
            found = await self._sequenced(want, conn, shared)
            if found is None:  # positioned by a run this task shared: as it found them, or read them
                found = [shared.get(s) for s in want]
                if None in found:
                    found = list(await conn.fetchval("SELECT evstore_positions($1)", want))
        except DB_ERRORS as exc:
            if _timed_out(exc):
                with contextlib.suppress(asyncpg.InterfaceError):  # (closed already: see _connection)
                    conn.terminate()  # (as _connection does: releasing it would wait for the cancel)
            return None
        positions = [p for p in found if p is not None]
        return tuple(positions) if len(positions) == len(want) else None

    async def _sequenced(
        self, want: list[int], conn: Any = None, shared: dict[int, int | None] | None = None
    ) -> list[int | None] | None:
        """Return once a sequencer run that started after this call has finished.

        Commits that finish while a run is in progress share the next run (in-process); other
        processes' runs are serialised by the sequencer's advisory lock. A run is asked for the
        seqs of every task sharing it (it may skip its work only when all of those are
        positioned already); the task that runs it gets the positions of ``want`` from it, a
        task that shared another's run gets ``None`` - and, in ``shared`` if given, the positions
        that run found for ``want`` (none if it failed): a caller has them without reading them
        again, one round trip fewer for each task that shares a run.
        """
        target = self._seq_started + 1
        self._seq_wanted.extend(want)  # before any await: the run this task waits for sees it
        sharers = self._seq_sharers
        sharers[target] = sharers.get(target, 0) + 1
        try:
            while self._seq_done < target:
                async with self._seq_lock:
                    if self._seq_done >= target:
                        break
                    self._seq_started += 1
                    run = self._seq_started  # (= target: a run numbered so would have ended first)
                    wanted, self._seq_wanted = self._seq_wanted, []
                    try:
                        if conn is not None:  # (one try on the caller's connection: see _positions_here)
                            _, positions = await _sequence(conn, self._key("!sequencer"), True, wanted)
                        else:
                            _, positions = await self._sequence_with_retry(wait=True, want=wanted)
                    finally:
                        self._seq_done = run
                    found = dict(zip(wanted, positions, strict=True))
                    if sharers.get(run, 0) > 1:  # (kept for the tasks sharing it: see below)
                        self._seq_found[run] = found
                    return [found.get(s) for s in want]
            # Shared: the run numbered ``target`` was asked for this task's seqs too, and found
            # their positions (unless it failed: then it left none)
            kept = self._seq_found.get(target)
            if shared is not None and kept is not None:
                shared.update((s, kept.get(s)) for s in want)
            return None
        finally:
            left = sharers[target] - 1
            if left:
                sharers[target] = left
            else:
                del sharers[target]
                self._seq_found.pop(target, None)

    async def _sequence_with_retry(self, wait: bool, want: list[int]) -> tuple[int, list[int | None]]:
        last: BaseException | None = None
        unbounded = False
        for _ in range(3):
            try:
                async with self._connection() as conn:
                    if not unbounded:
                        # one statement, its own transaction: the run commits before its lock is released
                        return await _sequence(conn, self._key("!sequencer"), wait, want)
                    async with conn.transaction():
                        await conn.execute("SET LOCAL statement_timeout = 0")
                        return await _sequence(conn, self._key("!sequencer"), wait, want)
            except CANNOT_WRITE as exc:
                if not want:
                    raise _storage_error(exc, "assigning positions", None, writes=True) from None
                # (a session that cannot write: the writers of these committed events position them)
                return 0, await self._positioned_by_others(want, str(exc).splitlines()[0])
            except DB_ERRORS as exc:
                if isinstance(exc, asyncpg.QueryCanceledError) and not unbounded:
                    # A statement_timeout (the URL's, the role's, the database's) cancelled the
                    # wait for the lock, which another run held: the commands waiting for these
                    # positions have committed, so wait as long as it takes, as for lock_timeout
                    # (the function sets that one; a statement's timer is armed before it runs)
                    last, unbounded = exc, True
                    continue
                if (
                    not _is_connection_error(exc)
                    and getattr(exc, "sqlstate", None) not in RETRYABLE_SQLSTATES
                ):
                    raise _storage_error(
                        exc, "assigning positions", None, self._timeout_named("command_timeout")
                    ) from None
                last = exc  # sequencing is idempotent: try again on a fresh connection
        assert last is not None
        raise _storage_error(last, "assigning positions", None, self._timeout_named("command_timeout"))

    async def _positioned_by_others(self, want: list[int], cause: str) -> list[int | None]:
        """The positions of committed events this session cannot position itself (see
        CANNOT_WRITE), once other sessions have: for up to ``POSITIONS_WAIT`` seconds."""
        deadline = asyncio.get_running_loop().time() + self.POSITIONS_WAIT
        while True:
            async with self._connection() as conn:
                found = await self._guard(
                    conn.fetchval("SELECT evstore_positions($1)", want), "reading positions"
                )
            if None not in found or asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.05)
        if None in found:
            missing = [s for s, p in zip(want, found, strict=True) if p is None]
            raise _unpositioned_here(f"{len(missing)} committed event(s)", cause, seqs=missing)
        return list(found)

    async def _catch_up(self, conn: Any) -> int:
        """Position events left by a writer that died between its commit and the sequencing.

        Runs on the reader's own connection (a pool of one must not wait for a second one);
        returns how many events it positioned. A session that cannot write (read-only, or no
        UPDATE on ``events``: see CANNOT_WRITE) does not try: the sequencer's try-lock it would
        hold until its UPDATE failed made a writer's catch-up at that moment give up ("another
        run positions them"), and the head it read stayed behind.
        """
        if not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM events WHERE position IS NULL)"
            " AND current_setting('transaction_read_only') = 'off'"
            " AND has_table_privilege('events', 'UPDATE')"
        ):
            return 0
        try:
            return (await _sequence(conn, self._key("!sequencer"), False, []))[0]
        except CANNOT_WRITE:
            # A session that cannot write (a read-only role or database, a hot standby, SELECT
            # only) reads the positioned prefix, gap-free as always: the writers position what
            # they commit (with writers running, there is nearly always such an event)
            return 0

    async def _guard(self, awaitable: Awaitable[Any], doing: str, writes: bool = False) -> Any:
        """``awaitable``'s result; its database error as evstore's (``writes``: see _storage_error)."""
        try:
            return await awaitable
        except DB_ERRORS as exc:
            raise _storage_error(
                exc, doing, None, self._timeout_named("command_timeout"), writes=writes
            ) from None

    # --- reading --------------------------------------------------------------------------

    async def _read(self, doing: str, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work`` on a pooled connection; once more on another if that one turns out dead (the
        server, a restart or a firewall closed it while it sat idle in the pool, before asyncpg
        noticed). A read is safe to repeat; failing one per such connection is noise a caller
        cannot act on. (Commands retry the same way: _StaleConnection.)"""
        for attempt in range(2):
            try:
                async with self._connection(lost_again=attempt == 0) as conn:
                    try:
                        return await work(conn)
                    except DB_ERRORS as exc:
                        if attempt == 0 and _is_connection_error(exc) and not isinstance(exc, TimeoutError):
                            # (the pool's other idle connections are likely dead too - a restart, a
                            # failover: each is replaced at its next acquire, this one at its release)
                            if self._pool is not None:
                                await self._pool.expire_connections()
                            continue
                        raise _storage_error(
                            exc, doing, None, self._timeout_named("command_timeout")
                        ) from None
            except _LostAtAcquire:
                # (a new connection the server ended as the pool set it up, nothing sent on it:
                # as a dead pooled one above, another is asked for once; lost again, it fails)
                continue
        raise AssertionError("unreachable")

    async def head(self) -> int:
        async def work(conn: Any) -> int:
            await self._catch_up(conn)
            return int(await conn.fetchval("SELECT max(position) FROM events") or 0)

        return await self._read("reading the head", work)

    async def read_raw(self, after: int, limit: int) -> list[RawEvent]:
        return list(map(RawEvent._make, await self._read_rows(EVENT_COLUMNS, after, limit)))

    async def read_payloads(self, after: int, limit: int) -> list[PayloadRow]:
        rows = await self._read_rows("position, type, schema_version, data", after, limit)
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    async def _read_rows(self, columns: str, after: int, limit: int, untracked: bool = False) -> list[Any]:
        """``untracked``: fetched by :func:`_fetch_untracked` (for pages to decode)."""
        sql = f"SELECT {columns} FROM events WHERE position > $1 ORDER BY position LIMIT $2"

        async def work(conn: Any) -> list[Any]:
            fetch = functools.partial(_fetch_untracked, conn) if untracked else conn.fetch
            rows = await fetch(sql, after, limit)
            if len(rows) < limit and await self._catch_up(conn):
                rows = await fetch(sql, after, limit)
            return list(rows)

        return await self._read("reading the log", work)

    async def read(self, after: int, limit: int) -> list[RecordedEvent]:
        return await _decoded(await self._read_rows(EVENT_COLUMNS, after, limit, untracked=True))

    async def last_positions(self, entities: Sequence[str], upto: int) -> dict[str, int]:
        """The position of the last event at or before ``upto`` naming each entity (``provider:<u>``,
        ``consumer:<u>``), for those some event names (what the audit cites for a drift)."""
        async with self._connection() as conn:
            rows = await self._guard(
                conn.fetch(
                    "SELECT ee.entity, max(e.position) AS last FROM event_entities ee "
                    "JOIN events e ON e.seq = ee.seq WHERE ee.entity = ANY($1::text[]) "
                    "AND e.position IS NOT NULL AND e.position <= $2 GROUP BY ee.entity",
                    list(entities),
                    upto,
                ),
                "finding the last events of entities",
            )
        return {str(r["entity"]): int(r["last"]) for r in rows}

    async def read_entities(
        self,
        entities: Sequence[str],
        after: int,
        limit: int,
        until: int | None = None,
        types: Sequence[str] | None = None,
    ) -> list[RecordedEvent]:
        """The events naming one of ``entities`` in ``(after, until]``, in order, at most ``limit``;
        with ``types``, only those of these types."""
        cols = ", ".join("e." + c.strip() for c in EVENT_COLUMNS.split(","))
        of_type = "" if types is None else "AND e.type = ANY($5::text[]) "
        sql = (
            f"SELECT {cols} FROM events e WHERE e.position > $2 AND e.position <= $4 {of_type}AND e.seq IN "
            "(SELECT seq FROM event_entities WHERE entity = ANY($1::text[])) ORDER BY e.position LIMIT $3"
        )
        last = until if until is not None else MAX_POSITION
        args: tuple[Any, ...] = (sql, list(entities), after, limit, last)
        if types is not None:
            args += (list(types),)

        async def work(conn: Any) -> list[Any]:
            rows = await _fetch_untracked(conn, *args)
            # (as _read_rows: committed events a dead writer left unpositioned belong here too)
            if len(rows) < limit and await self._catch_up(conn):
                rows = await _fetch_untracked(conn, *args)
            return list(rows)

        return await _decoded(await self._read("reading history", work))

    async def position_at(self, at: datetime) -> int:
        stamp = at.astimezone(UTC).isoformat(timespec="microseconds")
        async with self._connection() as conn:
            value = await self._guard(
                conn.fetchval(
                    "SELECT max(position) FROM events WHERE position IS NOT NULL AND recorded_at <= $1", stamp
                ),
                "reading the log",
            )
        return int(value or 0)

    #: how long a session that cannot write waits for other sessions to position the events
    #: committed before it took the fence (see :meth:`load_state`)
    POSITIONS_WAIT = 10.0

    #: seconds a snapshot save refused for want of a write (a read-only role or session, a hot
    #: standby: ``reason`` read_only) is not tried again on the way to an answer (see
    #: save_snapshot): a GRANT, or a standby promoted, is met at the next try after that
    SNAPSHOT_REFUSAL_KEPT = 60.0

    async def load_state(self) -> State:
        """The whole persisted projection, exactly as of the head it reports (writers wait meanwhile).

        A session that cannot run the sequencer (read-only, SELECT only) cannot position the
        events committed before it took the fence, which the projection already reflects: it
        lets go of the fence and tries again until their writers (or any session that can write)
        have positioned them, for up to ``POSITIONS_WAIT`` seconds."""
        deadline = asyncio.get_running_loop().time() + self.POSITIONS_WAIT
        async with self._connection() as conn:
            while True:
                try:
                    async with conn.transaction():
                        await self._fenced(conn, can_wait=True)
                        return await _load_all(conn)
                except _CannotPosition as exc:
                    if asyncio.get_running_loop().time() >= deadline:
                        raise _unpositioned_here(
                            f"{exc.pending} committed event(s)", exc.cause, unpositioned=exc.pending
                        ) from None
                except DB_ERRORS as exc:
                    raise _storage_error(exc, "loading the projection", None) from None
                await asyncio.sleep(0.05)

    #: how long one attempt to take the fence waits (see :meth:`_fenced`)
    FENCE_ATTEMPT_MS = 200

    async def _fenced(self, conn: Any, can_wait: bool = False) -> None:
        """Inside a transaction: hold writers back, and position every committed event.
        ``can_wait``: a session that cannot position them raises :class:`_CannotPosition`.

        The fence is an exclusive advisory lock that every command takes shared. PostgreSQL grants
        lock requests in order, so while the fence is waited for, new commands queue behind the
        wait: behind a client stuck inside a command (a frozen VM, a partition), every command
        would stop until the server ended that client. So the wait is made of short attempts
        (``lock_timeout``, in a savepoint), with pauses in which queued commands go through; for
        at most ``command_timeout`` when one is set (a caller that set one wants every wait bounded).
        """
        await self._take_in_attempts(
            conn,
            "SELECT pg_advisory_xact_lock($1)",
            self._key("!fence"),
            refusal="Another session held evstore's advisory lock for longer than {timeout}, so writers "
            "could not be held back; nothing was done: retry. pg_locks says which: another process's "
            "audit, rebuild or import holds it exclusive (retry once it is done), a client stuck "
            "inside a command holds it shared (end that session; the server's "
            "idle_in_transaction_session_timeout ends such sessions)",
        )
        if not can_wait:
            await _sequence(conn, self._key("!sequencer"), True, [])
            return
        # A session known not to be able to write does not run the sequencer (as _catch_up): it
        # would hold the sequencer's lock until its UPDATE failed, and a writer's catch-up trying
        # the lock then gave up, its head behind (an audit here retries every 50 ms)
        cannot = await conn.fetchval(
            "SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM events WHERE position IS NULL) THEN ''"
            " WHEN current_setting('transaction_read_only') = 'on' THEN 'the transaction is read-only'"
            " WHEN NOT has_table_privilege('events', 'UPDATE') THEN 'no UPDATE privilege on events'"
            " END"
        )
        if cannot == "":
            return  # (nothing to position)
        try:
            if cannot is not None:
                raise _CannotPosition(0, cannot)
            async with conn.transaction():  # (a savepoint: the fence stays held)
                await _sequence(conn, self._key("!sequencer"), True, [])
        except (_CannotPosition, *CANNOT_WRITE) as exc:
            pending = int(await conn.fetchval("SELECT count(*) FROM events WHERE position IS NULL"))
            cause = exc.cause if isinstance(exc, _CannotPosition) else str(exc).splitlines()[0]
            raise _CannotPosition(pending, cause) from None

    async def _take_in_attempts(self, conn: Any, statement: str, *args: Any, refusal: str) -> None:
        """Inside a transaction: run ``statement``, which takes locks, in short attempts
        (``lock_timeout``, each in a savepoint: one that times out lets go of what it took), with
        pauses in which the sessions it waited for go on; for at most ``command_timeout`` when one
        is set, then a StorageError saying ``refusal`` (``{timeout}`` names the option). A wait
        made so never holds a lock another session waits for, so it cannot close a cycle."""
        pause = 0.01
        loop = asyncio.get_running_loop()
        deadline = None if self.command_timeout is None else loop.time() + self.command_timeout
        while True:
            try:
                async with conn.transaction():  # (a savepoint: an attempt that times out is undone alone)
                    previous = await conn.fetchval("SELECT current_setting('lock_timeout')")
                    await conn.execute(f"SET LOCAL lock_timeout = {int(self.FENCE_ATTEMPT_MS)}")
                    await conn.execute(statement, *args)
                    await conn.execute("SELECT set_config('lock_timeout', $1, true)", previous)
                return
            except asyncpg.LockNotAvailableError:
                if deadline is not None and loop.time() >= deadline:
                    timeout = self._timeout_named("command_timeout")
                    raise err.StorageError(refusal.format(timeout=timeout), sqlstate="55P03") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)

    async def query(self, name: str, *args: Any) -> Any:
        fn = QUERIES[name]

        async def work(conn: Any) -> Any:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                return await fn(conn, *args)

        found = await self._read(f"querying {name}", work)
        if isinstance(found, ConsumerState) and (pending := _unpositioned_tombstones([found])):
            # a tombstone committed but not positioned yet (its writer has not run the sequencer,
            # or died first): its position, not its -seq
            (found.deleted_at,) = await self._tombstone_positions(pending)
        return found

    async def tamper(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Run raw SQL (tests and repair tools only); ``?`` placeholders become ``$n``."""
        if "?" in sql:
            parts = sql.split("?")
            sql = parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], 1))
        async with self._connection() as conn:
            await self._guard(conn.execute(sql, *params), "tampering", writes=True)

    # --- snapshots (a cache of folded states; see projections/snapshots.py) -------------------

    async def save_snapshot(
        self,
        position: int,
        event_hash: str,
        fmt: int,
        state: str,
        wait: bool = True,
        tombstones: str | None = None,
    ) -> bool:
        """(``wait`` is SQLite's: here a save waits only for another save of the same position.)
        ``tombstones``: the snapshot's tombstone segment (see :meth:`load_tombstones`), saved in
        the same transaction. True: saved (SQLite's may be left unsaved without an error)."""
        sql = (
            "INSERT INTO snapshots VALUES ($1, $2, $3, $4) ON CONFLICT (position) DO UPDATE SET "
            "event_hash = EXCLUDED.event_hash, format = EXCLUDED.format, state = EXCLUDED.state"
        )
        rows = [(position, event_hash, fmt, state)]
        if tombstones is not None:
            rows.append((-position, event_hash, fmt, tombstones))
        now = asyncio.get_running_loop().time()
        refused = self._snapshot_refused
        if not wait and refused is not None and now < refused[0]:
            # (a save on the way to an answer, by a session that may not write - a read-only role,
            # a hot standby - whose last save was refused a moment ago: not tried again, which
            # cost a failed INSERT, the whole state sent for it, at each question)
            log.debug("snapshot.not_saved", position=position, reason=refused[1].details.get("reason"))
            raise err.StorageError(
                f"{refused[1].message} (not tried again: a save was refused so less than "
                f"{self.SNAPSHOT_REFUSAL_KEPT:g} s ago)",
                **refused[1].details,
            )
        try:
            async with self._connection() as conn:
                # (executemany is atomic, since asyncpg 0.22: both rows or neither)
                await self._guard(conn.executemany(sql, rows), "saving a snapshot", writes=True)
        except err.StorageError as exc:
            if exc.details.get("reason") == "read_only":  # (42501, 25006: see _storage_error)
                self._snapshot_refused = (now + self.SNAPSHOT_REFUSAL_KEPT, exc)
            raise
        self._snapshot_refused = None
        return True

    async def load_snapshot(self, at_most: int, fmt: int) -> tuple[int, str] | None:
        """The latest snapshot at or before ``at_most`` whose event is still the one it was taken at."""
        async with self._connection() as conn:
            row = await self._guard(
                conn.fetchrow(
                    "SELECT s.position, s.state FROM snapshots s JOIN events e "
                    "ON e.position = s.position AND e.hash = s.event_hash "
                    "WHERE s.position <= $1 AND s.format = $2 ORDER BY s.position DESC LIMIT 1",
                    at_most,
                    fmt,
                ),
                "loading a snapshot",
            )
        return None if row is None else (int(row[0]), str(row[1]))

    async def snapshot_positions(self) -> list[int]:
        """Positions of the snapshots (of any format; see :meth:`snapshot_headers` for those a fold
        can use)."""
        # (not the tombstone segments, kept at minus their position: see load_tombstones)
        sql = "SELECT position FROM snapshots WHERE position > 0 ORDER BY position"
        async with self._connection() as conn:
            rows = await self._guard(conn.fetch(sql), "listing snapshots")
        return [int(r[0]) for r in rows]

    async def load_tombstones(self, at_most: int, fmt: int) -> list[tuple[int, str]]:
        """The tombstone segments (see projections/snapshots.py) of the snapshots at or before
        ``at_most`` whose event is still the one they were taken at, as ``(position, text)``.

        A segment is kept in the snapshots table at minus its snapshot's position: a cache needs
        no table of its own, and so no schema change (an older evstore of this schema version
        ignores them: it reads its own format, at positive positions, and drops them with the rest)."""
        async with self._connection() as conn:
            rows = await self._guard(
                conn.fetch(
                    "SELECT e.position, s.state FROM snapshots s JOIN events e "
                    "ON e.position = -s.position AND e.hash = s.event_hash "
                    "WHERE s.position < 0 AND s.position >= -$1::bigint AND s.format = $2 "
                    "ORDER BY s.position DESC",
                    at_most,
                    fmt,
                ),
                "loading a snapshot's tombstones",
            )
        return [(int(r[0]), str(r[1])) for r in rows]

    async def snapshot_headers(self, at_most: int, fmt: int) -> list[tuple[int, str]]:
        """The first line (the header: see projections/snapshots.py) of each snapshot at or before
        ``at_most`` of format ``fmt`` whose event is still the one it was taken at, as
        ``(position, line)`` in position order: what take_snapshots' check of the chains, and a
        question passing over snapshots whose chain broke, need of them - not the state after it.

        A prefix first: substr() of a compressed text decompresses only as far as it reads, where
        split_part() (a line of any length) decompresses all of it - 2-8 ms against 60-116 ms for
        the 30 snapshots (37 MB) of a 309,699-event log. A header longer than the prefix (many
        custom resource classes) is read again whole, in the same transaction."""
        prefix = 4096  # (characters; a header is ~240)
        where = (
            "FROM snapshots s JOIN events e ON e.position = s.position AND e.hash = s.event_hash "
            "WHERE s.position > 0 AND s.position <= $1::bigint AND s.format = $2"
        )

        async def read(conn: Any) -> list[tuple[int, str]]:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                sql = f"SELECT s.position, substr(s.state, 1, {prefix}) {where} ORDER BY s.position"
                found = {int(r[0]): str(r[1]) for r in await conn.fetch(sql, at_most, fmt)}
                longer = [p for p, text in found.items() if "\n" not in text]
                if longer:
                    line = "split_part(s.state, E'\\n', 1)"
                    sql = f"SELECT s.position, {line} {where} AND s.position = ANY($3)"
                    for r in await conn.fetch(sql, at_most, fmt, longer):
                        found[int(r[0])] = str(r[1])
            return [(p, text.partition("\n")[0]) for p, text in sorted(found.items())]

        async with self._connection() as conn:
            headers: list[tuple[int, str]] = await self._guard(read(conn), "reading snapshot headers")
        return headers

    async def drop_snapshots(self) -> None:
        async with self._connection() as conn:
            await self._guard(_drop_snapshots(conn), "dropping snapshots", writes=True)

    async def import_all(
        self,
        rows: Iterator[RawEvent],
        batch_size: int,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Load a validated export into this empty store: every row verbatim (positions, ids,
        hashes, times), their history index (``imported_keys``) and the projection folded from
        them, in one transaction holding the fence.

        ``rows`` is read on a worker thread (it reads the file). No command is decided against a
        half-imported store, and an import that fails or is killed leaves the store empty.
        """

        def take() -> list[RawEvent]:
            return list(itertools.islice(rows, batch_size))

        def rest() -> None:
            for _ in rows:
                pass

        async with self._connection() as conn:
            try:
                async with conn.transaction():
                    await self._fenced(conn)  # no writer, no sequencer meanwhile
                    if await conn.fetchval("SELECT 1 FROM events LIMIT 1") is not None:
                        raise err.InvalidInput(
                            "import needs an empty store: this one already has events", reason="not_empty"
                        )
                    state = State(usages_deferred=True)
                    expected = 1
                    while batch := await asyncio.to_thread(take):
                        with gc_paused():
                            entities = imported_keys(state, batch, expected)  # (folds the batch)
                        expected += len(batch)
                        columns = [list(c) for c in zip(*(_raw_fields(r) for r in batch), strict=True)]
                        try:
                            inserted = await conn.fetch(IMPORT_SQL, *columns)
                        except asyncpg.exceptions.UniqueViolationError as exc:
                            if (repeated := _repeated_id(batch, exc)) is None:
                                raise
                            # (read on: a file that changed since it was validated is refused as such)
                            await asyncio.to_thread(rest)
                            raise duplicate_id(*repeated) from None
                        seq_of = {r["event_id"]: r["seq"] for r in inserted}
                        entity_rows = [
                            (entity, seq_of[raw.event_id])
                            for raw, names in zip(batch, entities, strict=True)
                            for entity in names
                        ]
                        if entity_rows:
                            await conn.executemany(
                                "INSERT INTO event_entities VALUES ($1, $2) ON CONFLICT DO NOTHING",
                                entity_rows,
                            )
                        if progress is not None:
                            carried(progress)(expected - 1)
                    await _rebuild(conn, state, batch_size, None)
                    return expected - 1
            except CallbackFailed as exc:  # (not the database's: see CallbackFailed)
                raise exc.error from None
            except DB_ERRORS as exc:
                raise _storage_error(exc, "importing events") from None

    async def rebuild(
        self, batch_size: int, progress: Callable[[int, int], None] | None = None, full: bool = False
    ) -> Rebuilt:
        # (this backend always rewrites the whole projection, by COPY; ``full`` also reindexes it
        # and writes the history index again from the log)
        # The long parts, folding the whole log (and staging the history index's rows), run
        # before the fence (paged reads of positioned events): writers are held back only while
        # the events positioned meanwhile are folded and the projection is rewritten.
        head = await self.head()

        async def read(after: int, limit: int) -> list[PayloadRow]:
            return follows_on(after, await self.read_payloads(after, limit))

        state = await replay(
            read,
            batch_size=batch_size,
            progress=None if progress is None else (lambda done: progress(done, max(done, head))),
        )
        try:
            async with self._connection() as conn:
                try:
                    history = _StagedHistory() if full else None
                    if history is not None:
                        await history.stage(conn, batch_size)
                    async with conn.transaction():
                        await self._fenced(conn)
                        await _recreate(conn, await _missing_objects(conn))  # (lost tables, indexes)
                        report = None if progress is None else carried(progress)
                        folded = await _rebuild(conn, state, batch_size, report)
                        if history is not None:  # (storage-level damage: an index that lost entries)
                            await history.swap(conn, batch_size)
                            # (REINDEX locks a table's indexes exclusively, one table after the
                            # other, while a read holds the tables it read so far and waits for the
                            # next: a deadlock. Every table at once first, giving way to the reads
                            # meanwhile; until then they read the projection as it was.)
                            await self._take_in_attempts(
                                conn,
                                f"LOCK TABLE {', '.join(PROJECTION_TABLES)} IN ACCESS EXCLUSIVE MODE",
                                refusal="Reads of the projection went on for longer than {timeout} "
                                "without a pause, so the full rebuild could not reindex it; nothing "
                                "was done: retry",
                            )
                            for table in PROJECTION_TABLES:
                                await conn.execute(f"REINDEX TABLE {table}")
                        # (the time-travel snapshots go with the projection, in its transaction:
                        # see the SQLite backend's _rebuild)
                        return Rebuilt(folded, await _drop_snapshots(conn))
                except CallbackFailed as exc:  # (not the database's: see CallbackFailed)
                    raise exc.error from None
                except DB_ERRORS as exc:
                    raise _storage_error(exc, "rebuilding the projection") from None
        finally:
            # (freed on a thread a piece at a time: dropped on the event loop at the return, the
            # whole state stalled it for as long as freeing it takes - see dismantle)
            await asyncio.to_thread(dismantle, state)

    async def lost_tail(self) -> LostTail | None:
        """A change the projection records by an event the log does not hold (see
        :class:`LostTail`; ``position`` is the lost event's ``-seq`` when it was never positioned),
        else None. One statement, one snapshot: a command's projection rows commit with its event
        rows, and the positive positions only a rebuild or an import writes are of positioned
        events. A ``-seq`` the events' sequence never handed out is no lost event but a damaged
        projection, which a rebuild repairs."""
        async with self._connection() as conn:
            check = _lost_tail(conn)
            lost: LostTail | None = await self._guard(check, "checking the projection against the log")
        return lost

    async def check_history(self, batch_size: int) -> HistoryCheck:
        """The history index against the log (see :class:`HistoryCheck`): the expected rows are
        made as ``rebuild(full=True)`` makes them, into a TEMP table, then compared by the server
        for the events positioned when they were made."""
        async with self._connection() as conn:
            try:
                staged = _StagedHistory()
                await staged.stage(conn, batch_size)
                try:
                    upto = staged.through
                    expected = (
                        "SELECT s.entity, e.position FROM staged_entities s JOIN events e ON e.seq = s.seq "
                        "WHERE e.position <= $1"
                    )
                    stored = (
                        "SELECT x.entity, e.position FROM event_entities x JOIN events e ON e.seq = x.seq "
                        "WHERE e.position <= $1"
                    )
                    counts, examples = [], []
                    for first, second in ((expected, stored), (stored, expected)):
                        difference = f"{first} EXCEPT {second}"
                        counts.append(
                            int(await conn.fetchval(f"SELECT count(*) FROM ({difference}) d", upto))
                        )
                        rows = await conn.fetch(f"{difference} ORDER BY 2, 1 LIMIT {HISTORY_EXAMPLES}", upto)
                        examples.append(tuple((str(r[0]), int(r[1])) for r in rows))
                    return HistoryCheck(upto, counts[0], counts[1], examples[0], examples[1])
                finally:
                    await conn.execute("DROP TABLE IF EXISTS staged_entities")
            except asyncpg.exceptions.ReadOnlySQLTransactionError as exc:
                # (the TEMP table a read-only session cannot create: READ_ONLY_HINT says the audit
                # works here, which this check of it does not)
                raise err.StorageError(
                    f"PostgreSQL error while checking the history index: {str(exc).splitlines()[0]} "
                    "(the check stages the rows it expects in a TEMP table, which a read-only "
                    "session cannot create - the server is a hot standby, or "
                    "default_transaction_read_only is set for the role, the database or in the store "
                    "URL: run the audit with --history on the primary, with a session that may write; "
                    "the audit without it works here)",
                    sqlstate=exc.sqlstate,
                    reason="read_only",
                ) from None
            except DB_ERRORS as exc:
                raise _storage_error(exc, "checking the history index", None) from None

    async def stats(self) -> dict[str, Any]:
        async with self._connection() as conn:
            try:
                counts = {
                    r["type"]: r["count"]
                    for r in await conn.fetch(
                        "SELECT type, count(*) AS count FROM events WHERE position IS NOT NULL "
                        'GROUP BY type ORDER BY type COLLATE "C"'
                    )
                }
                head = await conn.fetchval("SELECT coalesce(max(position), 0) FROM events")
                pending = await conn.fetchval("SELECT count(*) FROM events WHERE position IS NULL")
                size = await conn.fetchval(
                    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    f"WHERE n.nspname = ({SCHEMA_OF}) AND c.relkind = 'r'",
                    "events",
                )
            except DB_ERRORS as exc:
                raise _storage_error(exc, "reading statistics", None) from None
        return {
            "head": int(head),
            "events_by_type": counts,
            "unpositioned": int(pending),
            "db_bytes": int(size),
            "pool_size": self.pool_size,
        }


IMPORT_SQL = (
    f"INSERT INTO events ({EVENT_COLUMNS}) SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], "
    "$4::int[], $5::text[], $6::text[], $7::text[], $8::text[]) RETURNING event_id, seq"
)
#: the key in a unique violation's DETAIL, "Key (event_id)=(<id>) already exists." in English: only
#: the words around it are translated (lc_messages), and an imported id is a canonical uuid
_REPEATED_ID = re.compile(r"\(event_id\)=\(([0-9a-f-]{36})\)")


#: pages of more rows than this are decoded on a thread (_decoded)
DECODED_ON_LOOP = 200


async def _fetch_untracked(conn: Any, *args: Any) -> list[Any]:
    """``conn.fetch(*args)`` of rows of ``EVENT_COLUMNS`` (numbers, text and NULL), their Records
    (tracked, one a row) untracked as soon as the fetch returns: the collector does not scan a
    page again while it is decoded and lives on in the caller.

    The collector is not paused around the fetch (c6b69b1 did, to keep the Records being made
    from setting off collections): the pause is process-wide and the fetch waits on the server,
    so every other task ran without the collector meanwhile, and overlapping reads (subscribers,
    history requests) kept it off nearly all the time - 16 readers and a task making cyclic
    garbage: 243 collections in 25 s and RSS 59 -> 207 MiB, against 13,320 and a flat 57 MiB.
    """
    rows: list[Any] = await conn.fetch(*args)
    untrack_rows(rows)
    return rows


async def _decoded(rows: Sequence[Any]) -> list[RecordedEvent]:
    """Rows of ``EVENT_COLUMNS`` decoded, a page of more than ``DECODED_ON_LOOP`` on a thread (on
    the event loop, each history batch - 1,000 events by default - stalled it as long as its
    decoding took)."""
    if len(rows) <= DECODED_ON_LOOP:
        return decode_rows(rows)
    return await asyncio.to_thread(decode_rows, rows)


def _repeated_id(batch: Sequence[RawEvent], exc: Exception) -> tuple[str, int] | None:
    """The event id whose unique violation stopped the insert of an imported ``batch`` and the
    position repeating it (None: another violation). The import keeps no set of the ids it read
    (~110 bytes an event): the unique index on ``event_id`` finds a repeated one. Rows go in in
    order, so the row that failed is the first in the file to repeat an earlier row's id. The id is
    read from the DETAIL whatever its language (the server's lc_messages translates the words
    around the key only).
    (``ON CONFLICT DO NOTHING`` and a count of the rows written cost ~40% of the insert.)"""
    found = _REPEATED_ID.search(str(getattr(exc, "detail", None) or ""))
    if found is None:
        return None
    event_id = found.group(1)
    holding = [raw.position for raw in batch if raw.event_id == event_id]
    if not holding:
        return None
    return event_id, holding[1] if len(holding) > 1 else holding[0]


def _raw_fields(r: RawEvent) -> tuple[Any, ...]:
    return (r.position, r.event_id, r.type, r.schema_version, r.data, r.metadata, r.recorded_at, r.hash)


# --- lock keys ----------------------------------------------------------------------------------


def _end_when_done(ended: asyncio.Future[None], before: set[asyncio.Future[None]], _: object) -> None:
    _end_after(ended, before)


def _end_after(ended: asyncio.Future[None], before: set[asyncio.Future[None]]) -> None:
    """Resolve ``ended`` once every future of ``before`` is done (now, if they are)."""
    pending = [f for f in before if not f.done()]
    if not pending:
        if not ended.done():
            ended.set_result(None)
        return
    pending[0].add_done_callback(lambda _: _end_after(ended, before))


class _Tickets:
    """``count`` tickets, handed in turn (first come, first served) to the callers waiting for
    one: one for each connection of a pool, taken before its acquire (see PostgresBackend._acquire).
    A caller cancelled or timed out while it waits leaves nothing behind (one handed a ticket as
    it was cancelled passes it on). Closed (the store's close began), every waiter and every later
    taker hears StoreClosed at once, rather than at the next release or at its timeout."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False
        #: the pool these tickets are for (None until the backend's open made it)
        self.pool: Any = None

    async def take(self, within: float) -> None:
        """A ticket; ``TimeoutError`` when none came within ``within`` seconds, StoreClosed once
        :meth:`close` was called."""
        if self.closed:
            raise err.StoreClosed("The store is closed")
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(within):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                if fut.exception() is None:  # (not close()'s StoreClosed)
                    self.give()  # (handed one as it was cancelled or timed out: pass it on)
            else:
                with contextlib.suppress(ValueError):  # (give() may have taken it off already)
                    self._waiters.remove(fut)
            raise

    def give(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # (the ticket passes straight to it)
                return
        self._free += 1

    def close(self) -> None:
        """Tell every waiter, and every later taker, that the store is closed."""
        self.closed = True
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(err.StoreClosed("The store is closed"))


class _OldestFirst:
    """A semaphore whose free slot goes to the waiter started first (the lowest ``order``), not
    to the one that asked first: a job that waited for an earlier job on the same entity does not
    queue again behind every job started since (a chain of commands on a hot provider would
    otherwise wait through the whole queue once per link)."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    async def acquire(self, order: int) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (order, fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # (handed a slot as it was cancelled: pass it on)
            else:
                with contextlib.suppress(ValueError):  # (release() may have popped it already)
                    self._waiters.remove((order, fut))
                    heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        while self._waiters:
            _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # (the slot passes straight to it)
                return
        self._free += 1


def _lock_names(job: Job) -> set[str]:
    """The entities a command names before anything is loaded (its first set of locks)."""
    n = job.needs
    names = {f"consumer:{c}" for c in n.consumers | n.migrations_of}
    names |= {f"provider:{p}" for p in n.providers | n.children_of}
    names |= {f"provider_name:{name}" for name in n.provider_names}
    if isinstance(job.command, CreateResourceClass):
        # Only a creation locks its class (created once, from any number of processes). A class
        # is never deleted, so a command that finds it can rely on it until it commits, and one
        # that does not is refused (nothing written): both are what running alone before or after
        # the creation would decide. Locking it for them too serialised every write naming a
        # custom class (every CUSTOM_GPU allocation in the cloud) though their entities are disjoint.
        names.add(f"class:{job.command.name}")
    if job.idempotency_key is not None:
        names.add(f"idempotency:{job.idempotency_key}")
    return names


def _classes_named(job: Job) -> set[str]:
    """The custom classes a command names, as :func:`_lock_names` names a class's creation."""
    return {f"class:{rc}" for rc in job.needs.resource_classes if rc.startswith("CUSTOM_")}


def _slice_names(state: State) -> Iterable[str]:
    """Every entity in a loaded slice: all of them are read and may be written.

    Names need no lock here: a decision about a name (create, rename) locks that name first.
    """
    yield from (f"consumer:{c}" for c in state.consumers)
    # A migration's instance is written by a revert even when it has no row (absent since the
    # migration started, so nothing was loaded for it): it is locked all the same, or a write
    # giving it destination allocations could commit between this load and the revert's commit.
    yield from (f"consumer:{c.on_behalf_of}" for c in state.consumers.values() if c.on_behalf_of)
    yield from (f"provider:{p}" for p in state.providers)


# --- the write path -----------------------------------------------------------------------------


#: Positions of a command's own events, folded before their seqs exist: event ``i`` is folded at
#: ``OWN_EVENT - i``, which ``evstore_write`` turns into that event's ``-seq`` (a position is
#: never below ``-2**62``, a seq never above ``2**62``).
OWN_EVENT = -(2**62)


async def lock_load(
    conn: Any, n: Needs, fence: int | None, keys: list[int], near: Sequence[int] = ()
) -> tuple[State, set[int]]:
    """Lock ``keys`` (and the fence, shared), then those of ``near`` that are free at once; then
    load exactly what ``decide(command)`` reads (``n = needs(command)``). Returns the slice and
    the keys of ``near`` it locked.

    One round trip (``evstore_lock_load_near``): the consumers named, the migrations of the
    instances named and the instances those act for, with their allocations; the providers
    named, found by name or parent, or holding those allocations; the custom classes named.
    """
    rows = await conn.fetch(
        "SELECT * FROM evstore_lock_load_near($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        fence,
        keys,
        sorted(n.consumers),
        sorted(n.migrations_of),
        sorted(n.provider_names),
        sorted(n.children_of),
        sorted(n.providers),
        sorted(rc for rc in n.resource_classes if rc.startswith("CUSTOM_")),
        list(near),
    )
    state = State()
    taken: set[int] = set()
    consumers = state.consumers
    for kind, t1, t2, t3, t4, t5, t6, b1, b2, b3, b4 in rows:
        if kind == 1:
            consumers[t1] = persisted.consumer_from_row((t1, t2, t3, t4, b1, b2, b3, t5, b4, t6))
        elif kind == 2:
            held = consumers.get(t1)
            if held is None:
                raise persisted.orphan_allocations(t1)
            held.allocations.setdefault(t2, {})[t3] = b1
        elif kind == 3:
            state.providers[t1] = persisted.provider_from_row((t1, t2, t3, t4, b1, t5, t6))
        elif kind == 4:
            state.custom_classes.add(t1)
        else:
            taken.add(b1)
    for c in consumers.values():
        persisted.check_loaded_consumer(c)
    return state, taken


async def write(conn: Any, events: list[EventBase], metadata_json: str, cs: persisted.ChangeSet) -> list[int]:
    """Insert the events (without positions: the sequencer assigns them after commit) and apply
    the projection's changes, in one round trip (``evstore_write``); the events' seqs."""
    ids = [str(_uuid.uuid4()) for _ in events]
    entity_names: list[str] = []
    entity_events: list[int] = []
    for index, event in enumerate(events, start=1):
        for entity in event.entities():
            entity_names.append(entity)
            entity_events.append(index)
    providers = [persisted.provider_row(p) for p in cs.upsert_providers]
    consumers = _columns([persisted.consumer_row(c) for c in cs.upsert_consumers], 10)
    allocations = [r for c in cs.replace_allocations for r in persisted.allocation_rows(c)]
    seqs: list[int] = await conn.fetchval(
        "SELECT evstore_write($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, "
        "$18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32)",
        ids,
        [e.event_type for e in events],
        [e.SCHEMA_VERSION for e in events],
        [e.payload_json() for e in events],
        metadata_json,
        entity_names,
        entity_events,
        cs.delete_providers,
        *_columns(providers, 7),
        cs.delete_consumers,
        cs.delete_consumers + [c.uuid for c in cs.replace_allocations],
        *consumers[:9],
        *_columns(allocations, 4),
        cs.add_classes,
        consumers[9],  # (instance_type: added last, by migration 5)
    )
    return list(seqs)


async def _load_consumers(conn: Any, state: State, uuids: set[str]) -> None:
    if not uuids:
        return
    keys = sorted(uuids)
    for row in await conn.fetch(
        f"SELECT {CONSUMER_COLUMNS} FROM p_consumers_resolved WHERE uuid = ANY($1::text[])", keys
    ):
        c = persisted.consumer_from_row(tuple(row))
        state.consumers[c.uuid] = c
    for consumer, provider, rc, used in await conn.fetch(
        "SELECT consumer, provider, rc, used FROM p_allocations WHERE consumer = ANY($1::text[])", keys
    ):
        held = state.consumers.get(consumer)
        if held is None:
            raise persisted.orphan_allocations(consumer)
        held.allocations.setdefault(provider, {})[rc] = used
    for uuid in uuids & state.consumers.keys():
        persisted.check_loaded_consumer(state.consumers[uuid])


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows as ``width`` column arrays (for ``unnest``)."""
    return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


async def _sequence(conn: Any, lock_key: int, wait: bool, want: list[int]) -> tuple[int, list[int | None]]:
    """Give every committed, unpositioned event its position, time and hash (``evstore_sequence``).

    Returns how many it positioned and the positions of the seqs in ``want``. Outside a
    transaction it is one of its own; inside one, the lock is held to that transaction's end.
    With ``wait=False`` it returns at once (``0``) if another sequencer holds the lock: that one
    will position what is there (its run or the writer's own next run will).
    """
    row = await conn.fetchrow("SELECT * FROM evstore_sequence($1, $2, $3)", lock_key, wait, want)
    return int(row[0]), list(row[1] or [])


# --- whole-store reads --------------------------------------------------------------------------


async def _load_all(conn: Any) -> State:
    state = State()
    state.position = int(await conn.fetchval("SELECT coalesce(max(position), 0) FROM events"))
    for row in await conn.fetch(f"SELECT {PROVIDER_COLUMNS} FROM p_providers"):
        p = persisted.provider_from_row(tuple(row))
        state.providers[p.uuid] = p
    for row in await conn.fetch(f"SELECT {CONSUMER_COLUMNS} FROM p_consumers_resolved"):
        c = persisted.consumer_from_row(tuple(row))
        state.consumers[c.uuid] = c
    for consumer, provider, rc, used in await conn.fetch(
        "SELECT consumer, provider, rc, used FROM p_allocations"
    ):
        holder = state.consumers.get(consumer)
        if holder is None:
            holder = state.consumers[consumer] = ConsumerState(consumer)
        holder.allocations.setdefault(provider, {})[rc] = used
    state.custom_classes = {r[0] for r in await conn.fetch("SELECT name FROM p_classes")}
    return state


async def _rebuild(
    conn: Any, folded: State, batch_size: int, progress: Callable[[int, int], None] | None
) -> int:
    """Inside the fence: fold what was positioned after ``folded`` (the log folded up to its
    position), then rewrite the projection from it."""
    state = folded
    head = int(await conn.fetchval("SELECT coalesce(max(position), 0) FROM events"))
    cursor = await conn.cursor(
        "SELECT position, type, schema_version, data FROM events WHERE position > $1 ORDER BY position",
        state.position,
    )
    with gc_paused():
        while rows := await cursor.fetch(batch_size):
            fold_payloads(state, follows_on(state.position, rows))
    if state.usages_deferred:
        state.recount_usages()
    if progress is not None:
        progress(head, head)
    for table in PROJECTION_TABLES:
        await conn.execute(f"DELETE FROM {table}")
    cs = persisted.changes(State(), state)
    await _copy(conn, "p_providers", [persisted.provider_row(p) for p in cs.upsert_providers])
    await _copy(conn, "p_consumers", [persisted.consumer_row(c) for c in cs.upsert_consumers])
    await _copy(
        conn, "p_allocations", [r for c in cs.replace_allocations for r in persisted.allocation_rows(c)]
    )
    await _copy(conn, "p_classes", [(n,) for n in cs.add_classes])
    return int(await conn.fetchval("SELECT count(*) FROM events WHERE position IS NOT NULL"))


class _StagedHistory:
    """The history index rows of the log (``rebuild(full=True)``, for an index that lost or
    gained entries), as the SQLite backend makes them: each event under the entities its payload
    names and the providers its fold changed holdings on. :meth:`stage` writes them to a TEMP
    table before the fence; :meth:`swap`, inside it, adds the events positioned since and
    replaces the index."""

    def __init__(self) -> None:
        self.state = State(usages_deferred=True)
        self.through = 0

    async def stage(self, conn: Any, batch_size: int) -> None:
        await conn.execute("CREATE TEMP TABLE IF NOT EXISTS staged_entities (entity text, seq bigint)")
        await conn.execute("TRUNCATE staged_entities")  # (one left by a rebuild that failed)
        await self._add(conn, batch_size)

    async def swap(self, conn: Any, batch_size: int) -> None:
        await self._add(conn, batch_size)
        await conn.execute("DELETE FROM event_entities")
        await conn.execute(
            "INSERT INTO event_entities SELECT DISTINCT entity, seq FROM staged_entities ORDER BY 1, 2"
        )
        await conn.execute("DROP TABLE staged_entities")

    async def _add(self, conn: Any, batch_size: int) -> None:
        with gc_paused():
            while rows := await conn.fetch(
                "SELECT seq, position, type, schema_version, data FROM events "
                "WHERE position > $1 ORDER BY position LIMIT $2",
                self.through,
                batch_size,
            ):
                out: list[tuple[str, int]] = []
                for seq, position, etype, version, data in rows:
                    keys = history_keys(self.state, etype, version, data, position)
                    out.extend((key, seq) for key in keys)
                    self.through = position
                if out:
                    await conn.copy_records_to_table("staged_entities", records=out)


async def _copy(conn: Any, table: str, rows: list[tuple[Any, ...]]) -> None:
    if rows:
        # (the table the unqualified statements name: the search_path's first schema may be another)
        schema = await conn.fetchval(SCHEMA_OF, table)
        await conn.copy_records_to_table(table, records=rows, schema_name=schema)


# --- queries on the persisted projection --------------------------------------------------------


async def _q_provider(conn: Any, provider: str) -> Any:
    row = await conn.fetchrow(f"SELECT {PROVIDER_COLUMNS} FROM p_providers WHERE uuid = $1", provider)
    return None if row is None else persisted.provider_from_row(tuple(row))


async def _q_consumer(conn: Any, consumer: str) -> Any:
    state = State()
    await _load_consumers(conn, state, {consumer})
    return state.consumers.get(consumer)


async def _q_provider_allocations(conn: Any, provider: str) -> dict[str, dict[str, int]] | None:
    if await conn.fetchval("SELECT 1 FROM p_providers WHERE uuid = $1", provider) is None:
        return None
    out: dict[str, dict[str, int]] = {}
    for consumer, rc, used in await conn.fetch(
        "SELECT consumer, rc, used FROM p_allocations WHERE provider = $1 ORDER BY consumer", provider
    ):
        out.setdefault(consumer, {})[rc] = used
    return out


async def _q_project_usages(
    conn: Any, project_id: str, user_id: str | None, consumer_type: str | None
) -> list[UsageGroup]:
    rows = await conn.fetch(
        "SELECT c.consumer_type, c.uuid, a.rc, a.used, a.provider FROM p_allocations a "
        "JOIN p_consumers c ON c.uuid = a.consumer WHERE c.project_id = $1 "
        "AND ($2::text IS NULL OR c.user_id = $2) AND ($3::text IS NULL OR c.consumer_type = $3)",
        project_id,
        user_id,
        consumer_type,
    )
    for _, consumer, rc, used, provider in rows:  # (a damaged row is refused, not summed)
        check_held_amount(consumer, provider, rc, used)
    return groups_from_rows((ctype, consumer, rc, used) for ctype, consumer, rc, used, _ in rows)


async def _q_providers(conn: Any) -> list[tuple[str, str]]:
    return [
        tuple(r)
        for r in await conn.fetch(
            'SELECT uuid, name FROM p_providers ORDER BY name COLLATE "C", uuid'  # (code points, as SQLite)
        )
    ]


QUERIES: dict[str, Callable[..., Awaitable[Any]]] = {
    "provider": _q_provider,
    "consumer": _q_consumer,
    "provider_allocations": _q_provider_allocations,
    "project_usages": _q_project_usages,
    "providers": _q_providers,
}
