"""The browsers' session key (issue 22, item 2): kept across restarts in the cache folder, or given by the env."""

import logging
import stat

from neuron_ui.config.session_secret import SECRET_FILE, load_session_secret
from neuron_ui.config.settings import settings_from_args


def test_the_key_is_made_once_with_mode_0600_and_read_back(tmp_path):
    first = load_session_secret(tmp_path)
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert load_session_secret(tmp_path) == first  # a restart on the same cache folder: the same key
    assert not [p for p in tmp_path.iterdir() if p.name != SECRET_FILE]  # no temp file left behind
    assert load_session_secret(tmp_path / "other") != first  # another folder: its own key


def test_a_given_key_wins_and_a_malformed_file_is_replaced_with_one_log_line(tmp_path, caplog):
    assert load_session_secret(tmp_path, "from-the-env") == "from-the-env"
    assert not (tmp_path / SECRET_FILE).exists()  # nothing written when the env gives the key
    (tmp_path / SECRET_FILE).write_text("short\n")
    with caplog.at_level(logging.WARNING):
        key = load_session_secret(tmp_path)
    assert key != "short" and len(key) >= 32 and load_session_secret(tmp_path) == key
    assert len([r for r in caplog.records if "malformed" in r.message]) == 1
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600


def test_an_unwritable_cache_folder_still_serves_with_a_key_for_this_process(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert len(load_session_secret(blocker / "cache")) >= 32


def test_the_env_var_sets_the_key_and_stays_out_of_the_settings_repr():
    import argparse

    settings = settings_from_args(argparse.Namespace(), {"NEURON_UI_SESSION_SECRET": "k" * 40})
    assert settings.session_secret == "k" * 40 and "k" * 40 not in repr(settings)
