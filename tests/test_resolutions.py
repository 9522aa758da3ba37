import pytest

from neuron_ui.config.resolutions import DEFAULT_RESOLUTIONS, Resolution, parse_resolution, parse_resolutions


def test_default_presets_are_valid_and_include_the_preview():
    assert DEFAULT_RESOLUTIONS[0] == Resolution(512, 512)
    assert Resolution(1024, 1024) in DEFAULT_RESOLUTIONS
    assert all(r.width % 16 == 0 and r.height % 16 == 0 for r in DEFAULT_RESOLUTIONS)


def test_parse_and_label():
    r = parse_resolution(" 1344x768 ")
    assert (r.width, r.height) == (1344, 768)
    assert str(r) == "1344x768"
    assert f"{r} ({r.aspect})" == "1344x768 (7:4)"  # the label the page shows (ui/words.py)
    assert r.tokens == 84 * 48


def test_klein_native_sizes_share_a_token_count():
    tokens = {parse_resolution(s).tokens for s in ("1152x896", "896x1152", "1344x768", "768x1344")}
    assert tokens == {4032}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("1024x1023", "not a multiple of 16"),
        ("0x0", "outside 256..2048"),
        ("-512x512", "not of the form"),
        ("1e9x1e9", "not of the form"),
        ("4096x1024", "outside 256..2048"),
        ("banana", "not of the form"),
    ],
)
def test_bad_resolution_names_the_problem(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_resolution(text)


def test_bad_list_names_the_bad_entry():
    with pytest.raises(ValueError, match="1000x1000"):
        parse_resolutions("1024x1024,1000x1000")
    with pytest.raises(ValueError, match="listed twice"):
        parse_resolutions("512x512,512x512")
    with pytest.raises(ValueError, match="empty"):
        parse_resolutions(" , ")
    assert [str(r) for r in parse_resolutions("1024x1024,768x1344")] == ["1024x1024", "768x1344"]
