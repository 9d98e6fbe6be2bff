"""Config validation messages and client request validation."""

from __future__ import annotations

import pytest

from router.cli import main
from router.client_request import Endpoint, parse_client_request
from router.config import ConfigError, Mode, load_config, parse_config
from router.errors import InvalidRequest

GOOD = {
    "models": [
        {
            "name": "tiny",
            "mode": "push",
            "prefill": [{"url": "http://127.0.0.1:8100", "engine_id": "p", "kv_port": 5600}],
            "decode": [{"url": "http://127.0.0.1:8200", "slots": 8}],
        }
    ]
}


def problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_good_config_and_defaults() -> None:
    cfg = parse_config(GOOD)
    assert cfg.models[0].mode is Mode.PUSH and cfg.listen.port == 8000
    assert cfg.timeouts.prefill > 0 and cfg.admission.queue_size > 0


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"mode": "fast"}, "models.0.mode: Input should be"),
        ({"prefill": []}, "mode 'push' needs at least one prefill instance"),
        ({"decode": []}, "models.0.decode: List should have at least 1 item"),
        ({"decode": [{"url": "http://h:1", "slots": 0}]}, "models.0.decode.0.slots"),
        ({"decode": [{"url": "ftp://h:1"}]}, "models.0.decode.0.url"),
        ({"decode": [{"url": "http://h:1/v1"}]}, "must be a base URL without a path"),
        ({"decode": [{"url": "http://h:1", "slotz": 3}]}, "models.0.decode.0.slotz: Extra inputs"),
        ({"mode": "pipelined"}, "needs engine_id, kv_host and kv_port"),
    ],
)
def test_mistakes_are_reported_with_their_path(patch: dict[str, object], expected: str) -> None:
    data = {"models": [{**GOOD["models"][0], **patch}]}  # type: ignore[dict-item]
    assert any(expected in p for p in problems(data)), problems(data)


def test_duplicate_names_and_urls() -> None:
    m = GOOD["models"][0]
    assert any("model name listed twice" in p for p in problems({"models": [m, m]}))
    dup = {**m, "decode": [m["decode"][0], m["decode"][0]]}  # type: ignore[index]
    assert any("listed twice" in p for p in problems({"models": [dup]}))


def test_env_secrets_are_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDR_KEYS", "a, b")
    monkeypatch.setenv("PDR_UP", "upkey")
    cfg = parse_config(
        {**GOOD, "auth": {"api_keys_env": "PDR_KEYS", "upstream_api_key_env": "PDR_UP"}}
    )
    assert [k.get_secret_value() for k in cfg.auth.api_keys] == ["a", "b"]
    assert cfg.auth.upstream_api_key is not None
    assert "upkey" not in repr(cfg)
    monkeypatch.delenv("PDR_UP")
    assert any(
        "PDR_UP is not set" in p
        for p in problems({**GOOD, "auth": {"upstream_api_key_env": "PDR_UP"}})
    )


def test_check_config_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    good = tmp_path / "good.yaml"
    good.write_text(
        "models:\n  - name: t\n    mode: aggregated\n    decode: [{url: 'http://h:1'}]\n"
    )
    assert main(["check-config", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: t\n    decode: [{url: 'http://h:1', slots: -1}]\n")
    with pytest.raises(SystemExit) as info:
        main(["check-config", str(bad)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "models.0.decode.0.slots: Input should be greater than or equal to 1" in err
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "syntax.yaml").write_text("models: [\n")
    with pytest.raises(ConfigError, match="YAML syntax"):
        load_config(tmp_path / "syntax.yaml")


def test_shipped_configs_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    monkeypatch.setenv("PD_ROUTER_API_KEYS", "k")
    monkeypatch.setenv("VLLM_API_KEY", "k")
    files = sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
    assert files
    for f in files:
        load_config(f)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"model": "m"}', r"Either prompt or prompt_embeds must be provided"),
        (b'{"model": "m", "prompt": "x", "n": 0}', "n: Input should be greater"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 1.5}', "max_tokens"),
        (b'{"model": "m", "prompt": "x", "stream_options": {}}', "stream_options"),
        (b'{"model": "m", "prompt": []}', "prompt: must not be empty"),
        (b'{"model": 3, "prompt": "x"}', "model"),
    ],
)
def test_invalid_completion_bodies(body: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_client_request(body, Endpoint.COMPLETIONS)


def test_prompt_shapes() -> None:
    one = parse_client_request(b'{"model": "m", "prompt": [1, 2, 3]}', Endpoint.COMPLETIONS)
    assert (one.num_prompts, one.estimated_prompt_tokens()) == (1, 3)
    many = parse_client_request(b'{"model": "m", "prompt": ["a", "b"]}', Endpoint.COMPLETIONS)
    assert many.num_prompts == 2
    chat = parse_client_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "12345678"}], "stream": true}',
        Endpoint.CHAT,
    )
    assert chat.stream and chat.estimated_prompt_tokens() == 2
    with pytest.raises(InvalidRequest, match="messages"):
        parse_client_request(b'{"model": "m", "messages": []}', Endpoint.CHAT)
