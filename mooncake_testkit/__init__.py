"""Test and benchmark tooling: start mooncake-server roles (not part of the runtime package).

One way per kind of server, each stoppable, and the OS processes killable and restartable:
- `in_process`: apps in this process: `serve_app` (the caller's event loop), `ServerThread`
  (a background loop, for blocking clients), `AppCluster` (real role apps on one such thread).
- `role_procs`: `RoleProc` (one `python -m mooncake_server --role ROLE` process) and
  `RoleCluster` (a conductor, or one already running, and any number of instances).
- `launcher`: `start_cluster`, a `--role all` (or other single-process) tree as one `RoleProc`.
- `ports`: free ports for all of them.
- `quality`: scores a linear kernel against float32 on the shipped text (data/), for
  scripts/bench_quality.py and tests/engine/test_quality.py.
"""
