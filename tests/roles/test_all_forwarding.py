"""`--role all` hands the scheduling flags to its conductor and the TBT SLO to its decode."""

from __future__ import annotations

from mooncake_server.config import ServerConfig
from mooncake_server.roles.all.supervisor import child_argv


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
