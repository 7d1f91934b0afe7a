"""Config env overrides and validation; backend registry including the entry-point group."""

import sys
import textwrap

import pytest

import ep_plugin
from ep_plugin import registry
from ep_plugin.config import Config, describe


def test_env_overrides_and_keyword_precedence():
    env = {"EP_PLUGIN_TIMEOUT_S": "5", "EP_PLUGIN_NUM_SMS": "24", "EP_PLUGIN_AVOID_RECORD_STREAM": "yes",
           "EP_PLUGIN_BLOCKING": "0"}
    config = Config.from_env(env)
    assert (config.timeout_s, config.num_sms, config.avoid_record_stream, config.blocking) == (5.0, 24, True, False)
    assert Config.from_env(env, num_sms=8).num_sms == 8
    assert Config.from_env({}).timeout_s == Config().timeout_s


def test_a_variable_that_names_no_knob_is_named_once(caplog, capsys, monkeypatch):
    """A typo (EP_PLUGIN_NUM_SM) used to be ignored without a word: from_env warns once per process with the
    closest knob, and ``info`` lists it. The build's and the test bed's own variables are not knobs."""
    from ep_plugin.__main__ import main
    from ep_plugin.logs import forget_warnings

    forget_warnings()
    env = {"EP_PLUGIN_NUM_SM": "8", "EP_PLUGIN_CUDA_ARCHS": "90", "EP_PLUGIN_TIMEOUT_S": "5"}
    with caplog.at_level("WARNING", logger="ep_plugin.config"):
        assert Config.from_env(env).num_sms == Config().num_sms
        Config.from_env(env)
    warned = [r.getMessage() for r in caplog.records if "not a knob" in r.getMessage()]
    assert warned == ["ep_plugin: EP_PLUGIN_NUM_SM is not a knob and is ignored (did you mean EP_PLUGIN_NUM_SMS?)"]
    monkeypatch.setenv("EP_PLUGIN_NUM_SM", "8")
    assert main(["info"]) == 0
    out = capsys.readouterr().out.splitlines()
    knobs = next(i for i, line in enumerate(out) if line.startswith("knobs"))
    # Right under the knobs' header, before their long list (it printed last, where `info | head` cut it off).
    assert out[knobs + 1] == "  EP_PLUGIN_NUM_SM is set but is not a knob: ignored (did you mean EP_PLUGIN_NUM_SMS?)"


def test_the_hint_for_a_variable_that_names_no_knob_compares_what_follows_the_prefix():
    """Compared whole, every name shares EP_PLUGIN_ with every knob: EP_PLUGIN_FOO was asked "did you mean
    EP_PLUGIN_BLOCKING?", and a misspelt build variable got a knob (EP_PLUGIN_CUDA_ARCH: EP_PLUGIN_BULK_COPY)."""
    from ep_plugin.config import unknown_variables

    env = {"EP_PLUGIN_FOO": "1", "EP_PLUGIN_CUDA_ARCH": "90", "EP_PLUGIN_NOCUDA": "1", "EP_PLUGIN_TIMEOUT": "5",
           "EP_PLUGIN_NUM_SMS": "8", "EP_PLUGIN_REQUIRE_GPU": "1"}
    assert unknown_variables(env) == {"EP_PLUGIN_CUDA_ARCH": " (did you mean EP_PLUGIN_CUDA_ARCHS?)",
                                      "EP_PLUGIN_FOO": "",
                                      "EP_PLUGIN_NOCUDA": " (did you mean EP_PLUGIN_NO_CUDA?)",
                                      "EP_PLUGIN_TIMEOUT": " (did you mean EP_PLUGIN_TIMEOUT_S?)"}


def test_a_variable_set_to_nothing_is_unset():
    """``docker -e EP_PLUGIN_BLOCKING=`` (or an empty export) keeps the default: it used to turn blocking off,
    while an empty int variable raised."""
    env = {"EP_PLUGIN_BLOCKING": "", "EP_PLUGIN_BULK_COPY": " ", "EP_PLUGIN_NUM_SMS": "", "EP_PLUGIN_TIMEOUT_S": ""}
    assert Config.from_env(env) == Config()


@pytest.mark.parametrize("env,text", [
    ({"EP_PLUGIN_TIMEOUT_S": "soon"}, "cannot parse EP_PLUGIN_TIMEOUT_S"),
    ({"EP_PLUGIN_TIMEOUT_S": "-1"}, "timeout_s must be >= 0.001 s"),
    ({"EP_PLUGIN_TIMEOUT_S": "inf"}, r"timeout_s must be .* <= 1e\+06 s"),  # no wait could get a deadline
    # "Timeouts off" by a huge value: gloo's wait hangs (1e11) or fails at once blaming a peer (1e10).
    ({"EP_PLUGIN_TIMEOUT_S": "1e10"}, r"timeout_s must be .* <= 1e\+06 s"),
    # Under a millisecond gloo's wait got 0 ms: no timeout at all (it waited 12 s for a peer asleep 12 s).
    ({"EP_PLUGIN_TIMEOUT_S": "0.0004"}, r"timeout_s must be >= 0.001 s \(engines count whole milliseconds\)"),
    ({"EP_PLUGIN_NUM_SMS": "-1"}, r"num_sms must be in \[0, 1024\]"),
    ({"EP_PLUGIN_BLOCKING": "maybe"}, "cannot parse EP_PLUGIN_BLOCKING"),
    ({"EP_PLUGIN_PAD_MULTIPLE": "0"}, r"pad_multiple must be in \[1, 65536\]"),
    ({"EP_PLUGIN_PAD_MULTIPLE": str(2**31)}, r"pad_multiple must be in \[1, 65536\]"),  # past the kernels' int32
])
def test_bad_config_values_name_the_knob(env, text):
    with pytest.raises(ValueError, match=text):
        Config.from_env(env)


def test_a_bad_value_names_its_variable_only_when_it_came_from_one():
    """A keyword (a bench's --sms) out of bounds used to be blamed on EP_PLUGIN_NUM_SMS, set or not."""
    with pytest.raises(ValueError, match=r"got 2000 \(from EP_PLUGIN_NUM_SMS\)"):
        Config.from_env({"EP_PLUGIN_NUM_SMS": "2000"})
    with pytest.raises(ValueError, match=r"got 2000$"):
        Config.from_env({}, num_sms=2000)


@pytest.mark.parametrize("knob", ["blocking", "bulk_copy", "avoid_record_stream", "gloo_host_words"])
def test_a_flag_that_is_not_a_bool_is_refused(knob):
    """Before: Config(blocking="no") was accepted and read as True (a non-empty string)."""
    with pytest.raises(ValueError, match=f"{knob} must be True or False, got 'no'"):
        Config.from_env({}, **{knob: "no"})
    assert getattr(Config.from_env({}, **{knob: False}), knob) is False


@pytest.mark.parametrize("knob,value", [
    ("pad_multiple", 2.0), ("num_sms", 16.7), ("num_sms", True), ("max_tokens_per_rank", 8192.5),
    ("scaleup_size", 1.5), ("combine_input_rows", "10"), ("timeout_s", True), ("peer_watch_s", "1"),
])
def test_a_count_or_number_of_the_wrong_type_is_refused(knob, value):
    """Before: Config(pad_multiple=2.0) was built, then every dispatch raised; num_sms=16.7 or
    scaleup_size=1.5 passed the range checks on their way to a kernel grid or a group split."""
    with pytest.raises(ValueError, match=f"{knob} must be an? (int|number), got {value!r}"):
        Config.from_env({}, **{knob: value})


def test_an_int_past_floats_range_is_refused_as_out_of_bounds():
    """Config(timeout_s=10**400) raised a bare OverflowError from float(), not the knob's error."""
    from ep_plugin.config import ConfigValueError

    with pytest.raises(ConfigValueError, match="timeout_s must be"):
        Config.from_env({}, timeout_s=10**400)


def test_numbers_of_a_wider_type_are_stored_as_the_knobs_type():
    import numpy as np

    config = Config.from_env({}, timeout_s=5, num_sms=np.int64(8), peer_watch_s=np.float32(0.25))
    assert type(config.timeout_s) is float and config.timeout_s == 5.0
    assert type(config.num_sms) is int and config.num_sms == 8
    assert type(config.peer_watch_s) is float and config.peer_watch_s == 0.25


def test_unknown_config_field():
    with pytest.raises(TypeError, match="no field"):
        Config.from_env({}, num_smz=3)


def test_every_knob_is_described():
    rows = describe()
    names = [name for name, _, _ in rows]
    assert "EP_PLUGIN_TIMEOUT_S" in names and len(set(names)) == len(names) == len(Config.__dataclass_fields__)
    assert [name for name, _, help_text in rows if not help_text.strip()] == []  # `info` shows every knob's help


def test_builtin_backends_listed_and_unknown_name_lists_them():
    assert {"reference", "hybrid"} <= set(ep_plugin.list_backends())
    assert ep_plugin.get_backend("reference").name == "reference"
    with pytest.raises(ValueError, match="known backends: .*reference"):
        ep_plugin.get_backend("nccl_magic")


def test_register_backend_and_refuse_silent_overwrite():
    class MyBackend:
        name = "mine"

    ep_plugin.register_backend("test_mine", MyBackend)
    try:
        assert ep_plugin.get_backend("test_mine") is MyBackend
        with pytest.raises(ValueError, match="already registered"):
            ep_plugin.register_backend("test_mine", object)
    finally:
        registry._registry.pop("test_mine")


def test_entry_point_group_is_loaded(tmp_path, monkeypatch):
    # A real installed-distribution layout on sys.path: importlib.metadata finds it.
    (tmp_path / "thirdparty_ep.py").write_text("class Backend:\n    name = 'third'\n")
    dist_info = tmp_path / "thirdparty_ep-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-ep\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(textwrap.dedent("""\
        [ep_plugin.backends]
        third = thirdparty_ep:Backend
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "_registry", dict(registry._BUILTIN))
    assert "third" in ep_plugin.list_backends()
    assert ep_plugin.get_backend("third").name == "third"
    sys.modules.pop("thirdparty_ep", None)


def test_readme_documents_every_knob():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [name for name, _, _ in describe() if f"`{name}`" not in readme]
    assert not missing, f"README knob table lacks {missing}"
