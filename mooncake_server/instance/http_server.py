"""The uvicorn settings every server of the project shares (the CLI's roles and test servers).

Keep-alive: httpx pools an idle connection for 5 s (`httpx.Limits().keepalive_expiry`), and
uvicorn closes one after 5 s by default. With equal timers a client can send its next request
on a connection in the very moment the server closes it, and that request fails with a
ReadError though both sides are healthy (one run in a few hundred near the boundary). Servers
here keep idle connections well past any client pool of ours, so the client always lets go
first.
"""

from __future__ import annotations

from typing import Any

import uvicorn

KEEP_ALIVE_S = 30.0


def server_config(app: Any, **settings: Any) -> uvicorn.Config:
    """uvicorn.Config for `app` with the project's keep-alive; `settings` as uvicorn names them."""
    settings.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
    return uvicorn.Config(app, **settings)
