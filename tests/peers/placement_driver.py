"""Drive the real OpenStack Placement 16.0.0 WSGI app in-process, one JSON line at a time.

Runs INSIDE the Placement venv (see :mod:`tests.peers.venv`), never in evstore's: it imports only
Placement, its dependencies and the standard library. Protocol, one JSON object per line:

- request ``{"method": "PUT", "path": "/allocations/<uuid>", "body": {...}, "version": "1.39"}``
  -> ``{"status": 204, "body": null}`` (``body`` is the decoded JSON response, or null if empty);
- ``{"op": "reset", "db": "/path/to/fresh.sqlite"}`` switches to a fresh, empty SQLite database
  file (schema created, standard resource classes and traits synced) -> ``{"status": "ok"}``;
- ``{"op": "purge_orphans"}`` deletes consumer records that hold no allocation (Placement's
  "orphan consumers", which evstore deliberately never creates) -> ``{"status": "ok", "purged": [...]}``;
- a driver failure -> ``{"status": "error", "error": "..."}``; the driver keeps serving.

The app is built the way Placement's own functional fixtures build it (``deploy.loadapp`` with
``auth_strategy=noauth2`` and the ``admin`` token), on a SQLite file instead of ``sqlite://`` so
that each sequence of a differential test can start from an empty database.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
import warnings
from typing import Any

DEFAULT_VERSION = "1.39"


def _configure(first_db: str) -> tuple[Any, Any]:
    from oslo_config import cfg
    from oslo_policy import opts as policy_opts
    from placement import conf as placement_conf
    from placement import db_api, deploy
    from placement.db.sqlalchemy import migration

    config = cfg.ConfigOpts()
    placement_conf.register_opts(config)
    config.set_override("auth_strategy", "noauth2", group="api")
    config.set_override("connection", f"sqlite:///{first_db}", group="placement_database")
    config.set_override("sync_on_startup", False, group="placement_database")
    policy_opts.set_defaults(config, enforce_new_defaults=False)
    config([], default_config_files=[])  # never read /etc/placement/placement.conf
    db_api.configure(config)
    migration.create_schema(db_api.get_placement_engine())
    app = deploy.loadapp(config)  # also syncs standard resource classes and traits
    return config, app


class Driver:
    def __init__(self) -> None:
        self._config: Any = None
        self._app: Any = None
        self._unpatch: Any = None

    def reset(self, db: str) -> None:
        if self._app is None:
            self._config, self._app = _configure(db)
            return
        from oslo_db.sqlalchemy import engines
        from placement import db_api, deploy
        from placement.db.sqlalchemy import migration
        from placement.objects import resource_class, trait

        engine = engines.create_engine(f"sqlite:///{db}")
        migration.create_schema(engine)
        if self._unpatch is not None:
            self._unpatch()
        self._unpatch = db_api.placement_context_manager.patch_engine(engine)
        # The once-per-process syncs must run again on the new, empty database.
        trait._TRAITS_SYNCED = False
        resource_class._RESOURCE_CLASSES_SYNCED = False
        deploy.update_database(self._config)

    def purge_orphans(self) -> list[str]:
        """Delete consumers without allocations; return their uuids (sorted)."""
        import sqlalchemy as sa
        from placement import db_api

        engine = db_api.get_placement_engine()
        orphans = "SELECT uuid FROM consumers WHERE uuid NOT IN (SELECT consumer_id FROM allocations)"
        with engine.begin() as conn:
            purged = sorted(row[0] for row in conn.execute(sa.text(orphans)))
            if purged:
                conn.execute(
                    sa.text("DELETE FROM consumers WHERE uuid NOT IN (SELECT consumer_id FROM allocations)")
                )
        return purged

    def request(self, method: str, path: str, body: Any, version: str) -> dict[str, Any]:
        import webob

        if self._app is None:
            raise RuntimeError("send {'op': 'reset', 'db': ...} first")
        headers = {
            "x-auth-token": "admin",
            "openstack-api-version": f"placement {version}",
            "accept": "application/json",
        }
        req = webob.Request.blank(path, method=method, headers=headers)
        if body is not None:
            req.content_type = "application/json"
            req.body = json.dumps(body).encode()
        resp = req.get_response(self._app)
        payload = json.loads(resp.body) if resp.body else None
        return {"status": resp.status_int, "body": payload}


def main() -> int:
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)  # Placement logs over-capacity warnings etc. to stderr
    driver = Driver()
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            if msg.get("op") == "reset":
                driver.reset(msg["db"])
                answer: dict[str, Any] = {"status": "ok"}
            elif msg.get("op") == "purge_orphans":
                answer = {"status": "ok", "purged": driver.purge_orphans()}
            else:
                answer = driver.request(
                    msg["method"], msg["path"], msg.get("body"), msg.get("version", DEFAULT_VERSION)
                )
        except Exception as exc:
            answer = {"status": "error", "error": f"{exc!r}", "traceback": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
