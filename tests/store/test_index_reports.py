"""A store node's report stream, and a client's index calls: the first over HTTP, later ones on
the index's binary channel, and back to HTTP when that channel is gone."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from store_procs import SECRET, index_server

from mooncake_server.roles.store.reporter import IndexReporter
from mooncake_server.store_client.index_link import IndexLink, IndexRefused
from mooncake_server.wire.index import (
    HAS_LEASE,
    StoreCommitted,
    StoreDrop,
    StoreEntry,
    StoreLocate,
    StorePlace,
    StoreReport,
)
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.routes import INDEX_COMMITTED, INDEX_DROP, INDEX_LOCATE, INDEX_PLACE


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


async def test_a_clients_index_calls_move_to_the_channel_and_survive_its_loss() -> None:
    async with index_server(replicas=1) as index, httpx.AsyncClient(timeout=5.0) as http:
        index.registry.register(InstanceInfo(instance_id="s1", role="store", url="http://s1:1",
                                             transfer_address="s1:2", segment="pool"))
        index.master.report(StoreReport(node_id="s1", epoch="e", seq=0, snapshot=True))
        link = IndexLink(lambda: index.url, http, SECRET)
        try:
            placed = await link.ask(INDEX_PLACE, StorePlace(keys=["a"]))  # HTTP: names it
            assert placed.targets == [["s1"]] and link.calls_on_channel == 0
            await link.ask(INDEX_COMMITTED, StoreCommitted(node_id="s1", keys=["a"], sizes=[7]))
            where = await link.ask(INDEX_LOCATE, StoreLocate(keys=["a"], lease=True))
            assert [[r.node_id for r in reps] for reps in where.replicas] == [["s1"]]
            assert where.sizes == [7] and link.calls_on_channel == 2
            # The lease taken on the channel holds at the master, as over HTTP.
            dropped = await link.ask(INDEX_DROP, StoreDrop(keys=["a"]))
            assert dropped.codes == [HAS_LEASE] and link.calls_on_channel == 3
            with pytest.raises(IndexRefused, match="remove_by_regex"):
                await link.ask(INDEX_DROP, StoreDrop(regex="("))  # the master's own words

            await index.channel.close()  # the master's channel goes away: HTTP carries on,
            # for every call that was in flight on it too (a conductor's death fails them all
            # at once)
            *found, dropped = await asyncio.gather(
                *(link.ask(INDEX_LOCATE, StoreLocate(keys=["a"])) for _ in range(3)),
                link.ask(INDEX_DROP, StoreDrop(keys=["a"], force=True)))
            assert [len(f.replicas) for f in found] == [1, 1, 1]
            assert dropped.codes == [0] and index.master.index.size_of("a") is None
            assert link.calls_on_channel == 3 and link._channel is None
        finally:
            await link.aclose()
