"""`--role all` hands every field to each of its children that reads it (config.flags())."""

from __future__ import annotations

import pytest
from flag_samples import NON_DEFAULT

from mooncake_server.cli import parse_config
from mooncake_server.config import ServerConfig, flags
from mooncake_server.roles.all.supervisor import (
    CHILD_PORT_OFFSETS,
    NOT_FORWARDED,
    child_argv,
    child_env,
)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_scheduling_flags_reach_the_conductor_and_admission_the_decode(tmp_path) -> None:
    profile = tmp_path / "p.json"
    config = ServerConfig(role="all", policy="cache-local", ttft_slo_s=4.0, tbt_slo_s=0.25,
                          profile_path=str(profile), kv_write="after")
    conductor = child_argv(config, "conductor", "m")
    assert flag(conductor, "--policy") == "cache-local"
    assert flag(conductor, "--ttft-slo") == "4.0" and flag(conductor, "--tbt-slo") == "0.25"
    assert flag(conductor, "--profile") == str(profile)
    decode = child_argv(config, "decode", "m")
    assert flag(decode, "--tbt-slo") == "0.25" and flag(decode, "--profile") == str(profile)
    assert flag(child_argv(config, "prefill", "m"), "--kv-write") == "after"
    assert flag(child_argv(config, "store", "m"), "--policy") is None


def test_no_slo_means_no_slo_flags() -> None:
    argv = child_argv(ServerConfig(role="all"), "conductor", "m")
    assert "--ttft-slo" not in argv and "--tbt-slo" not in argv and "--profile" not in argv
    assert flag(argv, "--policy") == "cache-global"


def test_engine_speed_flags_reach_both_engines_and_they_share_one_core_board() -> None:
    config = ServerConfig(role="all", dtype="float32", quantization="int8", decode_chunk_tokens=64,
                          cpu_budget=2, cpu_share_path="/dev/shm/mooncake-cores-test")
    for role in ("prefill", "decode"):
        argv = child_argv(config, role, "m")
        assert flag(argv, "--dtype") == "float32" and flag(argv, "--quantization") == "int8"
        assert flag(argv, "--decode-chunk") == "64" and flag(argv, "--cpu-budget") == "2"
        assert flag(argv, "--cpu-share") == "/dev/shm/mooncake-cores-test"
    assert flag(child_argv(config, "conductor", "m"), "--cpu-share") is None


def parsed_child(parent: ServerConfig, role: str) -> ServerConfig:
    """The config the child `role` of `parent` parses from its command line and environment."""
    argv = child_argv(parent, role, "/models/resolved")
    return parse_config(argv[3:], environ=child_env(parent, role, parent.cluster_secret, {}))


@pytest.mark.parametrize("role", list(CHILD_PORT_OFFSETS))
def test_every_field_reaches_every_child_that_reads_it(role: str) -> None:
    parent = ServerConfig(**{**NON_DEFAULT, "role": "all"})
    child = parsed_child(parent, role)
    own = {"role": role, "host": "0.0.0.0" if role == "conductor" else "127.0.0.1",
           "port": 9100 + CHILD_PORT_OFFSETS[role], "conductor_url": "http://127.0.0.1:9100",
           "model": "/models/resolved"}
    defaults = ServerConfig()
    for name, flag in flags():
        if role not in flag.roles:
            continue
        if name in NOT_FORWARDED:
            expected = getattr(defaults, name)
        else:
            expected = own.get(name, getattr(parent, name))
        assert getattr(child, name) == expected, f"{flag.name} of --role all, in {role}"


def test_the_fields_all_once_dropped_reach_their_children() -> None:
    parent = ServerConfig(role="all", failover_wait_s=3.0, drain_timeout_s=4.0,
                          request_timeout_s=5.0, store_control_port=9300, index_control_port=9301)
    conductor = parsed_child(parent, "conductor")
    assert (conductor.failover_wait_s, conductor.request_timeout_s) == (3.0, 5.0)
    assert conductor.index_control_port == 9301
    assert parsed_child(parent, "store").store_control_port == 9300
    for role in ("store", "prefill", "decode"):
        assert parsed_child(parent, role).drain_timeout_s == 4.0
    # Only what several children cannot share stays behind.
    assert set(NOT_FORWARDED) == {"instance_id", "advertise_host", "transfer_port"}
