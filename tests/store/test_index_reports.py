"""A store node's report stream: the first report over HTTP, later ones on the index's binary
channel, and back to HTTP when that channel is gone."""

from __future__ import annotations

import httpx
from store_procs import SECRET, index_server

from mooncake_server.roles.store.reporter import IndexReporter
from mooncake_server.wire.index import StoreEntry
from mooncake_server.wire.instances import InstanceInfo


async def test_reports_move_to_the_channel_and_fall_back_to_http_when_it_dies() -> None:
    async with index_server(replicas=1) as index, httpx.AsyncClient(timeout=5.0) as http:
        index.registry.register(InstanceInfo(instance_id="s1", role="store", url="http://s1:1",
                                             transfer_address="s1:2", segment="pool"))
        held = [StoreEntry(key="a", size=10, tier="dram")]
        reporter = IndexReporter(index.url, "s1", SECRET, lambda: list(held), http=http)
        await reporter.start()
        try:
            await reporter.flush()  # the start-up snapshot, over HTTP: its answer names the channel
            assert reporter.reports_on_channel == 0
            assert index.master.index.replicas("a", {"s1"}) == [("s1", "dram")]

            reporter.changed(StoreEntry(key="b", size=10, tier="dram"))
            await reporter.flush()
            assert reporter.reports_on_channel == 1
            assert index.master.index.replicas("b", {"s1"}) == [("s1", "dram")]

            await index.channel.close()  # the conductor's channel goes away: HTTP still works
            for key in ("b", "a"):  # and keeps carrying reports: no new dial on every report
                reporter.changed(StoreEntry(key=key, size=10, tier=None))
                await reporter.flush()
                assert index.master.index.replicas(key, {"s1"}) == []
            assert reporter.reports_on_channel == 1
            assert reporter._channel is None
        finally:
            await reporter.stop()
