"""`MooncakeDistributedStore`: Mooncake's Python store client, on this project's store.

Blocking methods with Mooncake's names, signatures and return conventions (0 or a negative
`ErrorCode`; bytes read for reads; `b""` for a missing `get`; 1/0 for `is_exist`), each run on
one event loop thread this client owns (ApiCore, core.py). Pointers are raw integers: calls that
take them accept only memory inside a region given to `register_buffer`, so a wrong pointer is
refused with INVALID_PARAMS and never written. `put(bytes)` sends straight from the caller's
object; `get` lands in a buffer of the object's size. CRC32Cs of written values are computed in
the caller's thread (the engine checks them on every read).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from mooncake_server.mooncake_api.core import ApiCore, MasterRefused
from mooncake_server.mooncake_api.plumbing import (
    LoopThread,
    Pieces,
    address_of,
    checksum,
    count_or_error,
    first_error,
)
from mooncake_server.mooncake_api.settings import (
    IGNORED,
    POSITIONAL,
    ClientSettings,
    from_setup_args,
)
from mooncake_server.mooncake_api.surface import BufferHandle, ErrorCode, ReplicateConfig
from mooncake_server.store_client.client import StoreError
from mooncake_server.transfer import TransferError
from mooncake_server.wire.index import StoreDrop

log = logging.getLogger(__name__)



class MooncakeDistributedStore:
    """Mooncake's store client: put / get / exists / remove of keyed byte objects."""

    def __init__(self) -> None:
        """Not connected until `setup`."""
        self._core: ApiCore | None = None
        self._loop: LoopThread | None = None
        self._lock = threading.Lock()

    # ---- life ---------------------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Connect to the master (and mount `global_segment_size` bytes of this process when
        > 0): `setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr[, engine])`, the same as keywords, or one
        dict. 0 on success."""
        unknown = set(kwargs) - set(POSITIONAL) - IGNORED
        if unknown:  # as the real binding: a wrong keyword is a TypeError, not a code
            raise TypeError(f"setup(): incompatible function arguments: {sorted(unknown)}")
        try:
            settings, engine = from_setup_args(args, kwargs)
        except (ValueError, TypeError) as exc:
            log.error("setup: %s", exc)
            return ErrorCode.INVALID_PARAMS
        if engine is not None:
            log.warning("setup: a Mooncake TransferEngine was passed; this client runs its own")
        return self._start(settings)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int,
                    server_address: str) -> int:
        """Mooncake's dummy client (memory served by another process): here a client that
        mounts nothing and talks to the master at `server_address`."""
        del mem_pool_size
        try:
            settings = ClientSettings(global_segment_size=0, local_buffer_size=local_buffer_size,
                                      master_server_addr=server_address,
                                      secret=from_setup_args((), {})[0].secret)
        except ValueError as exc:
            log.error("setup_dummy: %s", exc)
            return ErrorCode.INVALID_PARAMS
        return self._start(settings)

    def _start(self, settings: ClientSettings) -> int:
        self.close()  # a second setup starts over with the new settings, as the real one
        with self._lock:
            loop = LoopThread()
            core = ApiCore(settings)
            try:
                loop.run(core.start())
            except (MasterRefused, StoreError, TransferError, OSError) as exc:
                # NOTE: the real setup answers every failure (master unreachable, bad
                # protocol, ...) with INVALID_PARAMS.
                log.error("setup: %s", exc)
            else:
                self._core, self._loop = core, loop
                return ErrorCode.OK
            loop.run(core.close())
            loop.stop()
            return ErrorCode.INVALID_PARAMS

    def close(self) -> int:
        """Unmount this client's segment (its data leaves the store) and disconnect."""
        with self._lock:
            core, loop = self._core, self._loop
            self._core = self._loop = None
        if core is None or loop is None:
            return ErrorCode.OK
        loop.run(core.close())
        loop.stop()
        return ErrorCode.OK

    def get_hostname(self) -> str:
        """This client's "host:port" (its segment's name when it mounts one)."""
        return self._core.hostname if self._core is not None else ""

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 the master does not answer (as Mooncake)."""
        if self._core is None or self._loop is None:
            return 1
        return 0 if self._loop.run(self._core.healthy()) else 2

    # ---- memory -------------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register [buffer_ptr, buffer_ptr + size) with the transfer engine: the zero-copy
        calls read and write only inside such buffers."""
        if self._core is None or self._core.regions is None:
            return ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
        if buffer_ptr <= 0 or size <= 0:
            return ErrorCode.INVALID_PARAMS
        try:
            added = self._core.regions.add(buffer_ptr, size)
        except (TransferError, ValueError) as exc:
            log.error("register_buffer: %s", exc)
            return ErrorCode.INVALID_PARAMS
        return ErrorCode.OK if added else ErrorCode.INVALID_PARAMS

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Unregister a buffer given to register_buffer (after transfers on it end)."""
        if self._core is None or self._core.regions is None:
            return ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
        return ErrorCode.OK if self._core.regions.remove(buffer_ptr) else ErrorCode.INVALID_PARAMS

    @property
    def staged_bytes(self) -> int:
        """Bytes this client copied through its own buffers (the zero-copy calls add none)."""
        staging = self._core.staging if self._core is not None else None
        return staging.staged_bytes if staging is not None else 0

    def _inside(self, ptr: int, size: int) -> bool:
        regions = self._core.regions if self._core is not None else None
        return regions is not None and regions.inside(ptr, size)

    # ---- writes -------------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store `value` (any bytes-like object) under `key`; a key held already is kept."""
        return self._put_values([key], [[value]], config, replace=False)[0]

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of `parts` under `key` (no parts: 0, nothing stored)."""
        if not any(len(memoryview(p)) for p in parts):
            return ErrorCode.OK if key else ErrorCode.INVALID_PARAMS
        return self._put_values([key], [list(parts)], config, replace=False)[0]

    def put_batch(self, keys: list[str], values: list[Any],
                  config: ReplicateConfig | None = None) -> int:
        """Store several values; 0, or the first failure's code."""
        return first_error(self._put_values(keys, [[v] for v in values], config, False))

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store `value` under `key`, replacing what it held."""
        return self._put_values([key], [[value]], config, replace=True)[0]

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """upsert of the concatenation of `parts`."""
        return self._put_values([key], [list(parts)], config, replace=True)[0]

    def upsert_batch(self, keys: list[str], values: list[Any],
                     config: ReplicateConfig | None = None) -> int:
        """upsert of several values; 0, or the first failure's code."""
        return first_error(self._put_values(keys, [[v] for v in values], config, True))

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Store `size` bytes at `buffer_ptr` (inside a registered buffer) under `key`."""
        return self._put_pieces([key], [[(buffer_ptr, size)]], config, replace=False)[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        """put_from, replacing what `key` held."""
        return self._put_pieces([key], [[(buffer_ptr, size)]], config, replace=True)[0]

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """put_from of each key; per key 0 or a negative code."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._put_pieces(keys, [[(p, n)] for p, n in zip(buffer_ptrs, sizes)], config,
                                replace=False)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        """batch_put_from, replacing what the keys held."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._put_pieces(keys, [[(p, n)] for p, n in zip(buffer_ptrs, sizes)], config,
                                replace=True)

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Each key's object gathered from several registered buffers, in order."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) or any(
                len(p) != len(n) for p, n in zip(all_buffer_ptrs, all_sizes)):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._put_pieces(keys, [list(zip(p, n)) for p, n in zip(all_buffer_ptrs,
                                                                       all_sizes)],
                                config, replace=False)

    def _put_values(self, keys: list[str], values: list[list[Any]],
                    config: ReplicateConfig | None, replace: bool) -> list[int]:
        """Copy the values into registered staging memory (once), then write from there."""
        if len(keys) != len(values):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        if self._core is None or self._core.staging is None:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        try:
            held = [[address_of(v) for v in vs] for vs in values]
        except TypeError:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        staging = self._core.staging
        sizes = [sum(n for _, n, _ in h) for h in held]
        with staging.extent(sum(sizes)) as base:
            if base is None:  # larger than the local buffer (local_buffer_size) has free
                return [ErrorCode.INVALID_PARAMS] * len(keys)
            pieces, at = [], base
            for h, size in zip(held, sizes):
                pieces.append([(at, size)] if size else [])
                for addr, n, _ in h:
                    ctypes.memmove(at, addr, n)
                    at += n
            staging.count(sum(sizes))
            return self._write(keys, pieces, config, replace)

    def _put_pieces(self, keys: list[str], pieces: list[Pieces],
                    config: ReplicateConfig | None, replace: bool) -> list[int]:
        """Write from registered memory; an object of 0 bytes is answered 0, not stored (as
        Mooncake's put_from answers it)."""
        codes = [ErrorCode.OK if all(self._inside(p, n) for p, n in ps) else
                 ErrorCode.INVALID_PARAMS for ps in pieces]
        ok = [i for i, c in enumerate(codes) if c == ErrorCode.OK
              and sum(n for _, n in pieces[i]) > 0]
        written = self._write([keys[i] for i in ok], [[(p, n) for p, n in pieces[i] if n]
                                                      for i in ok], config, replace)
        for i, code in zip(ok, written):
            codes[i] = code
        return [int(c) for c in codes]

    def _write(self, keys: list[str], pieces: list[Pieces], config: ReplicateConfig | None,
               replace: bool) -> list[int]:
        if self._core is None or self._loop is None:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        config = config or ReplicateConfig()
        if config.replica_num < 1:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        codes: list[int] = [ErrorCode.INVALID_PARAMS if not k or not p else ErrorCode.OK
                            for k, p in zip(keys, pieces)]
        todo = [i for i, c in enumerate(codes) if c == ErrorCode.OK]
        if todo:
            sums = [checksum(pieces[i]) for i in todo]
            got = self._loop.run(self._core.put([keys[i] for i in todo],
                                                [pieces[i] for i in todo], sums,
                                                config, replace))
            for i, code in zip(todo, got):
                codes[i] = code
        return [int(c) for c in codes]

    # ---- reads --------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The object under `key`, or b"" if there is none."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """get of several keys."""
        out = [h.tobytes() if h is not None else b"" for h in self.batch_get_buffer(keys)]
        if self._core is not None and self._core.staging is not None:
            self._core.staging.count(sum(len(b) for b in out))
        return out

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object read into memory this client owns, or None if there is none."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        """get_buffer of several keys."""
        if self._core is None or self._loop is None:
            return [None] * len(keys)
        got = self._loop.run(self._core.get_owned(keys))
        return [buf for buf, _ in got]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read `key` into a registered buffer; bytes read or a negative code."""
        return self._read([key], [[(buffer_ptr, size)]])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int],
                       sizes: list[int]) -> list[int]:
        """get_into of each key, straight into the caller's memory; per key bytes read."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._read(keys, [[(p, n)] for p, n in zip(buffer_ptrs, sizes)])

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Each key's object scattered over several registered buffers, in order."""
        del prefer_alloc_in_same_node
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) or any(
                len(p) != len(n) for p, n in zip(all_buffer_ptrs, all_sizes)):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._read(keys, [list(zip(p, n)) for p, n in zip(all_buffer_ptrs, all_sizes)])

    def _read(self, keys: list[str], room: list[Pieces]) -> list[int]:
        if self._core is None or self._loop is None:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        codes: list[int] = [ErrorCode.OK if p and all(self._inside(a, n) for a, n in p) else
                            ErrorCode.INVALID_PARAMS for p in room]
        todo = [i for i, c in enumerate(codes) if c == ErrorCode.OK]
        if todo:
            got = self._loop.run(self._core.get([keys[i] for i in todo],
                                                [room[i] for i in todo]))
            for i, code in zip(todo, got):
                codes[i] = code
        return [int(c) for c in codes]

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]],
                        all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """Ranges of objects into registered buffers: per buffer, per key, per range the
        bytes copied or a negative code (each object is read whole, then its ranges copied)."""
        out: list[list[list[int]]] = []
        for b, ptr in enumerate(buffer_ptrs):
            per_key: list[list[int]] = []
            for k, key in enumerate(all_keys[b]):
                dst, src, lens = all_dst_offsets[b][k], all_src_offsets[b][k], all_sizes[b][k]
                handle = self.get_buffer(key)
                row = []
                for d, s, n in zip(dst, src, lens):
                    if handle is None:
                        row.append(int(ErrorCode.OBJECT_NOT_FOUND))
                    elif s < 0 or n < 0 or s + n > handle.size() or not self._inside(ptr + d, n):
                        row.append(int(ErrorCode.INVALID_PARAMS))
                    else:
                        ctypes.memmove(ptr + d, handle.ptr() + s, n)
                        row.append(n)
                per_key.append(row)
            out.append(per_key)
        return out

    def is_exist(self, key: str) -> int:
        """1 if `key` is held, 0 if not, negative on failure."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """is_exist of each key."""
        if self._core is None or self._loop is None:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        return [int(c) for c in self._loop.run(self._core.exist(keys))]

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or a negative code (OBJECT_NOT_FOUND)."""
        if self._core is None or self._loop is None:
            return ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
        try:
            where = self._loop.run(self._core.locate([key]))
        except StoreError:
            return ErrorCode.RPC_FAIL
        size = where.sizes[0] if where.replicas[0] else None
        return int(ErrorCode.OBJECT_NOT_FOUND) if size is None else size

    # ---- removes ------------------------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        """Remove `key`: 0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while a read's lease lasts
        (unless `force`)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        """remove of each key."""
        if self._core is None or self._loop is None:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        return self._drop(StoreDrop(keys=keys, force=force)) if keys else []

    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones stay unless `force`); how many were removed."""
        codes = self._drop(StoreDrop(all=True, force=force))
        return count_or_error(codes)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove the keys `regex_pattern` matches (re.search); how many were removed."""
        try:
            codes = self._drop(StoreDrop(regex=regex_pattern, force=force))
        except ValueError:
            return ErrorCode.INVALID_PARAMS
        return count_or_error(codes)

    def _drop(self, body: StoreDrop) -> list[int]:
        if self._core is None or self._loop is None:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS]
        return [int(c) for c in self._loop.run(self._core.drop(body))]

