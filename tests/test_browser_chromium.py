"""Without chromium the browser tests skip and say why, except under CI=true, where they fail (browser_fixtures)."""

import pytest
from browser_fixtures import chromium

pytest_plugins = ["pytester"]  # runs the fixture in a pytest of its own, in this process


def test_a_missing_chromium_skips_with_its_reason(tmp_path):
    fake = tmp_path / "no-chromium-here"
    with pytest.raises(pytest.skip.Exception, match=f"^no chromium at {fake}: `apt-get install chromium`"):
        chromium({"NEURON_UI_CHROMIUM": str(fake)})
    with pytest.raises(pytest.skip.Exception):
        chromium({"NEURON_UI_CHROMIUM": str(fake), "CI": "false"})


def test_a_missing_chromium_fails_under_ci(tmp_path):
    fake = tmp_path / "no-chromium-here"
    with pytest.raises(pytest.fail.Exception, match="CI=true, where the browser tests must run"):
        chromium({"NEURON_UI_CHROMIUM": str(fake), "CI": "true"})


def test_a_chromium_found_is_the_one_driven(tmp_path):
    binary = tmp_path / "chromium"
    binary.write_bytes(b"")
    assert chromium({"NEURON_UI_CHROMIUM": str(binary), "CI": "true"}) == str(binary)


def test_the_browser_fixture_skips_a_whole_module_without_chromium(pytester, monkeypatch, tmp_path):
    """The fixture itself, in a pytest run in this process: one skip, its reason in the summary; under CI, an error."""
    pytester.makepyfile("def test_needs_a_browser(browser):\n    raise AssertionError('never reached')\n")
    monkeypatch.setenv("NEURON_UI_CHROMIUM", str(tmp_path / "none"))
    monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest_inprocess("-p", "browser_fixtures", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED*no chromium at {tmp_path / 'none'}*"])
    monkeypatch.setenv("CI", "true")
    pytester.runpytest_inprocess("-p", "browser_fixtures").assert_outcomes(errors=1)

