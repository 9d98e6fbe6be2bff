"""``pd-router --version``, ``${VAR}`` references in the routing file, the shipped example."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import router
from router.cli import main
from router.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "configs" / "example.yaml"

MODEL = {
    "name": "tiny",
    "mode": "push",
    "prefill": [{"url": "http://127.0.0.1:8100"}],
    "decode": [{"url": "http://127.0.0.1:8200", "slots": 8}],
}

VARS = ("PDR_T_KEY", "PDR_T_KEY2", "PDR_T_UP", "PDR_T_KEYS", "PDR_T_HOST", "PDR_T_PORT")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARS:
        monkeypatch.delenv(name, raising=False)


def problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return [p.strip() for p in info.value.problems]


# -- --version -----------------------------------------------------------------


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"pd-router {router.__version__}\n"


def test_version_flag_as_a_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (out.returncode, out.stdout) == (0, f"pd-router {router.__version__}\n"), out.stderr


# -- ${VAR} references ---------------------------------------------------------


def test_every_missing_variable_is_reported_with_its_path() -> None:
    data: dict[str, object] = {
        "listen": {"host": "${PDR_T_HOST}"},
        "models": [MODEL],
        "auth": {
            "api_keys": ["inline", "${PDR_T_KEY}", "x-${PDR_T_KEY2}"],
            "api_keys_env": "PDR_T_KEYS",
            "upstream_api_key_env": "PDR_T_UP",
        },
    }
    assert problems(data) == [
        "listen.host: environment variable PDR_T_HOST is not set",
        "auth.api_keys.1: environment variable PDR_T_KEY is not set",
        "auth.api_keys.2: environment variable PDR_T_KEY2 is not set",
        "auth.api_keys_env: environment variable PDR_T_KEYS is not set",
        "auth.upstream_api_key_env: environment variable PDR_T_UP is not set",
    ]


def test_missing_variables_and_other_mistakes_in_one_error() -> None:
    bad_slots = {**MODEL, "decode": [{"url": "http://127.0.0.1:8200", "slots": 0}]}
    # engine_id left empty by its missing variable would fail the pipelined check on
    # its model: that consequence is not reported, the cause is.
    pipelined = {
        "name": "p",
        "mode": "pipelined",
        "prefill": [{"url": "http://h:1", "engine_id": "${PDR_T_KEY}", "kv_host": "h",
                     "kv_port": 1}],
        "decode": [{"url": "http://h:2", "engine_id": "d", "kv_host": "h", "kv_port": 2}],
    }  # fmt: skip
    assert problems({"models": [bad_slots, pipelined], "listen": {"port": "${PDR_T_PORT}"}}) == [
        "models.1.prefill.0.engine_id: environment variable PDR_T_KEY is not set",
        "listen.port: environment variable PDR_T_PORT is not set",
        "models.0.decode.0.slots: Input should be greater than or equal to 1",
    ]


def test_empty_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDR_T_KEY", "")
    monkeypatch.setenv("PDR_T_UP", "")
    data = {
        "models": [MODEL],
        "auth": {"api_keys": ["${PDR_T_KEY}"], "upstream_api_key_env": "PDR_T_UP"},
    }
    assert problems(data) == [
        "auth.api_keys.0: environment variable PDR_T_KEY is empty",
        "auth.upstream_api_key_env: environment variable PDR_T_UP is empty",
    ]


def test_values_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDR_T_KEY", "s3cret")
    monkeypatch.setenv("PDR_T_HOST", "")  # empty: the default applies, as in the shell
    monkeypatch.setenv("PDR_T_UP", "up")
    cfg = parse_config(
        {
            "listen": {"host": "${PDR_T_HOST:-0.0.0.0}", "port": "${PDR_T_PORT:-9001}"},
            "models": [{**MODEL, "name": "m-${PDR_T_KEY2:-}x"}],
            "auth": {
                "api_keys": ["${PDR_T_KEY}", "${PDR_T_KEY2:-fallback}", "a$${b}"],
                "upstream_api_key": "${PDR_T_UP}",
            },
        }
    )
    assert (cfg.listen.host, cfg.listen.port) == ("0.0.0.0", 9001)
    assert cfg.models[0].name == "m-x"
    assert [k.get_secret_value() for k in cfg.auth.api_keys] == ["s3cret", "fallback", "a${b}"]
    assert cfg.auth.upstream_api_key is not None
    assert cfg.auth.upstream_api_key.get_secret_value() == "up"
    assert "s3cret" not in repr(cfg)
    monkeypatch.setenv("PDR_T_PORT", "9002")  # set: the default does not apply
    cfg = parse_config({"listen": {"port": "${PDR_T_PORT:-9001}"}, "models": [MODEL]})
    assert cfg.listen.port == 9002


def test_malformed_reference_is_reported() -> None:
    data = {"listen": {"host": "${1X}"}, "models": [MODEL], "auth": {"api_keys": ["k${oops"]}}
    assert problems(data) == [
        "listen.host: malformed environment reference '${1X}' "
        "(write ${NAME} or ${NAME:-default}; $${ for a literal ${)",
        "auth.api_keys.0: malformed environment reference "  # a key's text is not echoed
        "(write ${NAME} or ${NAME:-default}; $${ for a literal ${)",
    ]


def test_references_in_a_yaml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDR_T_HOST", "10.1.2.3")
    path = tmp_path / "r.yaml"
    path.write_text(
        'listen: {host: "${PDR_T_HOST}", port: "${PDR_T_PORT:-8123}"}\n'
        "models:\n  - name: t\n    mode: aggregated\n"
        "    decode:\n      - url: http://${PDR_T_HOST}:8200\n"
        'auth:\n  api_keys: ["${PDR_T_KEY}"]\n  upstream_api_key: ${PDR_T_UP}\n'
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        "  auth.api_keys.0: environment variable PDR_T_KEY is not set",
        "  auth.upstream_api_key: environment variable PDR_T_UP is not set",
    ]
    monkeypatch.setenv("PDR_T_KEY", "k")
    monkeypatch.setenv("PDR_T_UP", "u")
    cfg = load_config(path)
    assert (cfg.listen.host, cfg.listen.port) == ("10.1.2.3", 8123)
    assert cfg.models[0].decode[0].base_url == "http://10.1.2.3:8200"


# -- shipped files ---------------------------------------------------------------


def test_shipped_example_validates_in_a_clean_environment() -> None:
    """``pd-router check-config configs/example.yaml`` as a user runs it, with no variables."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    out = subprocess.run(
        [sys.executable, "-m", "router", "check-config", str(EXAMPLE)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{EXAMPLE}: OK\n")
    assert "model 'llama': mode push, 2 prefill, 2 decode (128 slots)" in out.stdout


def test_a_reader_that_leaves_gets_no_traceback() -> None:
    """``pd-router check-config FILE | head -1``: the pipe's reader is gone before the
    command writes (its end closed before the start), so every write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "router", "check-config", str(EXAMPLE)],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert out.returncode == 141, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_without_variables(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PD_ROUTER_API_KEYS", "PD_ROUTER_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(path)
    assert cfg.models and not cfg.auth.api_keys and cfg.auth.upstream_api_key is None
    assert main(["check-config", str(path)]) == 0


def test_example_auth_section_when_uncommented_needs_its_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commented-out auth block is valid YAML and fails loudly without its secrets."""
    for name in ("PD_ROUTER_API_KEYS", "PD_ROUTER_API_KEY", "VLLM_API_KEY", "TEAM_A_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PROM_KEY", raising=False)
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index("# auth:")
    block = ["auth:"]
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            break
        block.append("  " + line.removeprefix("#   "))
    path = tmp_path / "example-auth.yaml"
    path.write_text("\n".join(lines[:start] + block) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        "  auth.keys.0.key: environment variable TEAM_A_KEY is not set",
        "  auth.keys.1.key: environment variable PROM_KEY is not set",
        "  auth.api_keys.0: environment variable PD_ROUTER_API_KEY is not set",
        "  auth.api_keys_env: environment variable PD_ROUTER_API_KEYS is not set",
        "  auth.upstream_api_key_env: environment variable VLLM_API_KEY is not set",
    ]
    monkeypatch.setenv("PD_ROUTER_API_KEYS", "a,b")
    monkeypatch.setenv("PD_ROUTER_API_KEY", "c")
    monkeypatch.setenv("VLLM_API_KEY", "up")
    monkeypatch.setenv("TEAM_A_KEY", "ta")
    monkeypatch.setenv("PROM_KEY", "pk")
    cfg = load_config(path)
    assert sorted(k.get_secret_value() for k in cfg.auth.api_keys) == ["a", "b", "c"]
    names = [k.name for k in cfg.auth.named_keys()]
    assert names == ["team-a", "prometheus", "api_keys.0", "api_keys.1", "api_keys.2"]
    assert cfg.auth.keys[0].limits is not None and cfg.auth.keys[0].limits.max_concurrent == 32
