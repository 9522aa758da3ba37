from pathlib import Path

import pytest

from neuron_ui.config.settings import Settings, build_parser, default_cache_dir, settings_from_args


def parse(argv, environ=None):
    return settings_from_args(build_parser().parse_args(argv), environ or {})


def test_defaults():
    s = parse([], {"HOME": "/home/someone"})
    assert (s.model, s.device, s.dtype, s.compile, s.compile_backend) == ("auto", "auto", "auto", "regional", None)
    assert s.host == "127.0.0.1" and s.port == 7860 and s.auth is None
    assert str(s.resolutions[0]) == "512x512"


def test_flags_win_over_env_and_env_over_defaults():
    env = {"NEURON_UI_MODEL": "tiny", "NEURON_UI_COMPILE": "full", "GRADIO_SERVER_PORT": "9000",
           "GRADIO_SERVER_NAME": "0.0.0.0", "NEURON_UI_RESOLUTIONS": "512x512,1024x1024",
           "NEURON_UI_CACHE_DIR": "/tmp/x", "NEURON_UI_AUTH": "ann:secret"}
    s = parse(["--compile", "eager", "--port", "8000"], env)
    assert s.model == "tiny" and s.compile == "eager" and s.port == 8000 and s.host == "0.0.0.0"
    assert [str(r) for r in s.resolutions] == ["512x512", "1024x1024"]
    assert s.cache_dir == Path("/tmp/x") and s.auth == ("ann", "secret")


def test_bad_values_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="1000x1000"):
        parse(["--resolutions", "512x512,1000x1000"])
    with pytest.raises(ValueError, match="NEURON_UI_AUTH"):
        parse([], {"NEURON_UI_AUTH": "nopassword"})
    with pytest.raises(ValueError, match="GRADIO_SERVER_PORT"):
        parse([], {"GRADIO_SERVER_PORT": "http"})
    with pytest.raises(ValueError, match="--compile"):
        Settings(compile="fast")
    with pytest.raises(ValueError, match="--max-queue must be at least 1, got 0"):
        parse(["--max-queue", "0"], {"NEURON_UI_MAX_QUEUE": "4"})  # 0 is a value, not "unset"
    with pytest.raises(ValueError, match="--max-downloads must be at least 1, got 0"):
        parse(["--max-downloads", "0"])
    assert (Settings().max_downloads, parse([], {"NEURON_UI_MAX_DOWNLOADS": "8"}).max_downloads) == (64, 8)


def test_default_cache_dir_prefers_persistent_storage(tmp_path):
    data = tmp_path / "data"
    home = {"HOME": str(tmp_path / "home")}
    assert default_cache_dir(home, data=data) == tmp_path / "home" / ".cache" / "neuron-ui"
    data.mkdir()
    assert default_cache_dir(home, data=data) == data / "neuron-ui"


def test_warmup_list_or_all():
    assert [str(r) for r in parse(["--warmup", "1024x1024,512x512"]).warmup] == ["1024x1024", "512x512"]
    s = parse(["--resolutions", "512x512,768x1344", "--warmup", "all"])
    assert s.warmup == s.resolutions
    with pytest.raises(ValueError, match="--warmup 1024x1024: not among the presets"):
        parse(["--resolutions", "512x512", "--warmup", "1024x1024"])
    assert parse([], {"NEURON_UI_CACHE_BUNDLE": "/b.tar.gz"}).cache_bundle == ("/b.tar.gz",)


def test_turns_and_mcp_settings_from_flags_and_env():
    assert (Settings().max_queue_per_user, Settings().mcp) == (4, False)
    assert parse(["--max-queue-per-user", "2", "--mcp"]).max_queue_per_user == 2
    env = parse([], {"NEURON_UI_MAX_QUEUE_PER_USER": "3", "NEURON_UI_MCP": "yes"})
    assert (env.max_queue_per_user, env.mcp) == (3, True)
    assert not parse([], {"NEURON_UI_MCP": "0"}).mcp
    with pytest.raises(ValueError, match="--max-queue-per-user must be at least 1, got 0"):
        parse(["--max-queue-per-user", "0"])
    with pytest.raises(ValueError, match="NEURON_UI_MCP must be 1/true/yes/on or 0/false/no/off, got 'maybe'"):
        parse([], {"NEURON_UI_MCP": "maybe"})
