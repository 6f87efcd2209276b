"""The flag table: every ServerConfig field has one flag, and each flag (or YAML key) sets it."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from flag_samples import NON_DEFAULT

from mooncake_server import profiling
from mooncake_server.cli import build_parser, parse_config
from mooncake_server.config import EVERY_ROLE, Flag, ServerConfig, flags


def test_every_config_field_has_one_flag_read_by_some_role() -> None:
    # No field is internal: each is settable from the command line (and so from `--role all`).
    fields = [f.name for f in dataclasses.fields(ServerConfig)]
    assert [name for name, _ in flags()] == fields
    names = [flag.name for _, flag in flags()]
    assert len(set(names)) == len(names)
    for name, flag in flags():
        assert flag.name.startswith("--") and flag.help, name
        assert flag.roles and flag.roles <= set(EVERY_ROLE), name
    assert set(NON_DEFAULT) == set(fields)
    defaults = ServerConfig()
    assert [n for n in fields if getattr(defaults, n) == NON_DEFAULT[n]] == []
    # A switch (store_true) can only turn a field on, so its default must be off.
    switches = [n for n in fields if isinstance(NON_DEFAULT[n], bool)]
    assert switches and all(getattr(defaults, n) is False for n in switches)


def test_every_flag_sets_its_field() -> None:
    argv = [word for name, flag in flags() for word in flag.argv(NON_DEFAULT[name])]
    assert parse_config(argv, environ={}) == ServerConfig(**NON_DEFAULT)


def test_every_flag_name_is_a_yaml_key(tmp_path: Path) -> None:
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump({flag.name[2:]: NON_DEFAULT[name] for name, flag in flags()}))
    assert parse_config(["--config", str(path)], environ={}) == ServerConfig(**NON_DEFAULT)


SIZES = [(name, flag) for name, flag in flags() if flag.size]


@pytest.mark.parametrize(("name", "flag"), SIZES, ids=[flag.name for _, flag in SIZES])
def test_size_flags_take_units(name: str, flag: Flag) -> None:
    assert getattr(parse_config([flag.name, "3MiB"], environ={}), name) == 3 << 20
    with pytest.raises(ValueError, match=flag.name):
        parse_config([flag.name, "lots"], environ={})


def test_request_timeout_has_a_flag() -> None:
    assert parse_config(["--request-timeout", "45"], environ={}).request_timeout_s == 45.0
    assert "--request-timeout" in build_parser().format_help()


def test_profiling_does_not_import_the_cli() -> None:
    # The cli runs `profile`; profiling importing the cli back (for parse_config) was a cycle.
    assert "mooncake_server.cli" not in inspect.getsource(profiling)
