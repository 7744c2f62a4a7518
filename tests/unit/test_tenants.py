"""API keys and tenants (server/tenants.py), the Host allow-list (server/hosts.py), and the
`specdec serve` flags of the limits, keys and hosts (the server section they configure)."""
import logging
import os

import pytest

from specdec.cli import build_parser
from specdec.config_flags import config_from_args
from specdec.server.config import ServerConfig
from specdec.server.hosts import allowed_hosts_for, host_allowed, host_name
from specdec.server.tenants import (
    DUPLICATE_AUTHORIZATION, INVALID_KEY, APIKeys, authenticate, bearer_token, configured_keys, parse_keys,
    read_keys_file,
)
from specdec.types import SpecdecError

KEY_ENVS = ("SPECDEC_API_KEY", "SPECDEC_API_KEYS", "SPECDEC_API_KEYS_FILE")


@pytest.fixture(autouse=True)
def no_key_environment(monkeypatch):
    for name in KEY_ENVS:
        monkeypatch.delenv(name, raising=False)


def keys_file(tmp_path, text, mode=0o600, name="keys"):
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


# -- the keys' formats -----------------------------------------------------------------------------
def test_line_format_with_comments_blank_lines_and_several_keys_per_tenant():
    text = "# tenant key\nalice sk-alice-1\n\n  alice   sk-alice-2  \n   # indented comment\nbob sk-bob\n"
    assert parse_keys(text, "f") == [("sk-alice-1", "alice"), ("sk-alice-2", "alice"), ("sk-bob", "bob")]


def test_entries_separated_by_commas():
    assert parse_keys("alice sk-a, bob sk-b,carol sk-c,", "env") == [("sk-a", "alice"), ("sk-b", "bob"),
                                                                      ("sk-c", "carol")]


@pytest.mark.parametrize("text, where", [
    ("alice", "f, line 1"),  # one word
    ("alice sk-a\nbob sk b", "f, line 2"),  # three words
    ("{not json", "f: not valid JSON"),
    ('["sk-a"]', "f, line 1"),  # JSON only as an object: this is one word of the line format
    ('{"alice": 5}', "f, entry 1: a key is a string"),
    ('{"alice": "sk-a", "bob": ["sk-b", null]}', "f, entry 2: a key is a string"),
])
def test_malformed_keys_are_one_line_errors_naming_where(text, where):
    with pytest.raises(SpecdecError) as error:
        parse_keys(text, "f")
    assert where in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text", [
    "sk_live/0123456789abcdef+= alice",  # the words swapped (a base64 key): the "tenant name" is the key
    "bad/name sk_live/0123456789abcdef+=",
    '{"bad name": "sk_live/0123456789abcdef+="}',
    '{"sk_live/0123456789abcdef+=": "alice"}',
])
def test_a_bad_tenant_name_is_a_one_line_error_without_the_key(text):
    with pytest.raises(SpecdecError) as error:
        parse_keys(text, "keys.txt")
    message = str(error.value)
    assert "keys.txt" in message and "tenant name" in message
    assert "sk_live" not in message and "0123456789" not in message and "\n" not in message


@pytest.mark.parametrize("text", ["alice sk-caf\u00e9-secret", '{"alice": "sk secret"}', '{"alice": ""}',
                                  '{"alice": "' + "k" * 513 + '"}'])
def test_a_bad_key_is_an_error_without_the_key(text):
    with pytest.raises(SpecdecError) as error:
        parse_keys(text, "f")
    assert "alice" in str(error.value) and "secret" not in str(error.value) and "kkkk" not in str(error.value)


def test_json_format():
    assert parse_keys(' {"alice": ["a1", "a2"], "bob": "b1", "t.e@s-t1": "k"}\n', "f") == [
        ("a1", "alice"), ("a2", "alice"), ("b1", "bob"), ("k", "t.e@s-t1")]
    with pytest.raises(SpecdecError):
        parse_keys('{"-alice": "k"}', "f")  # must start with a letter or digit
    with pytest.raises(SpecdecError):
        parse_keys('{"' + "a" * 65 + '": "k"}', "f")


# -- files and the environment ---------------------------------------------------------------------
def test_keys_file_readable_by_others_is_a_warning(tmp_path, caplog):
    path = keys_file(tmp_path, "alice sk-a\n", mode=0o644)
    with caplog.at_level(logging.WARNING, logger="specdec.server"):
        assert read_keys_file(path) == [("sk-a", "alice")]
    assert any("readable by other users" in r.getMessage() and path in r.getMessage() for r in caplog.records)
    assert all("sk-a" not in r.getMessage() for r in caplog.records)


def test_private_keys_file_is_no_warning(tmp_path, caplog):
    path = keys_file(tmp_path, "alice sk-a\n")
    with caplog.at_level(logging.WARNING, logger="specdec.server"):
        read_keys_file(path)
    assert not caplog.records


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}"])
def test_keys_file_without_keys_is_an_error(tmp_path, text):
    with pytest.raises(SpecdecError, match="holds no keys"):
        read_keys_file(keys_file(tmp_path, text))


def test_missing_or_binary_keys_file_is_an_error(tmp_path):
    with pytest.raises(SpecdecError, match="cannot read"):
        read_keys_file(str(tmp_path / "absent"))
    path = tmp_path / "binary"
    path.write_bytes(b"alice \xff\xfe\n")
    with pytest.raises(SpecdecError, match="cannot read"):
        read_keys_file(str(path))


def test_configured_keys_from_arguments_and_environment(tmp_path):
    assert configured_keys(environ={}) == (None, ())
    assert configured_keys(environ={"SPECDEC_API_KEY": "k1"}) == ("k1", ())
    assert configured_keys("flag", environ={"SPECDEC_API_KEY": "k1"}) == ("flag", ())  # the flag first
    assert configured_keys(environ={"SPECDEC_API_KEYS": "alice a1, bob b1"}) == (None, (("a1", "alice"),
                                                                                       ("b1", "bob")))
    path = keys_file(tmp_path, '{"carol": "c1"}')
    assert configured_keys(None, path, environ={}) == (None, (("c1", "carol"),))
    both = configured_keys(environ={"SPECDEC_API_KEYS_FILE": path, "SPECDEC_API_KEYS": "dave d1",
                                    "SPECDEC_API_KEY": "k1"})
    assert both == ("k1", (("c1", "carol"), ("d1", "dave")))
    other = keys_file(tmp_path, "erin e1", name="other")  # the argument wins over the variable
    assert configured_keys(None, other, environ={"SPECDEC_API_KEYS_FILE": path}) == (None, (("e1", "erin"),))


@pytest.mark.parametrize("environ", [
    {"SPECDEC_API_KEYS": "alice sk-same, bob sk-same"},
    {"SPECDEC_API_KEYS": "alice sk-same\nalice sk-same"},
    {"SPECDEC_API_KEY": "sk-same", "SPECDEC_API_KEYS": "bob sk-same"},
])
def test_a_key_given_twice_is_an_error_naming_the_tenants_not_the_key(environ):
    with pytest.raises(SpecdecError, match="given twice") as error:
        configured_keys(environ=environ)
    assert "sk-same" not in str(error.value)


def test_a_bad_single_key_is_an_error_without_it():
    with pytest.raises(SpecdecError, match="SPECDEC_API_KEY") as error:
        configured_keys(environ={"SPECDEC_API_KEY": "two words"})
    assert "two words" not in str(error.value)


# -- lookups and the Authorization header ----------------------------------------------------------
def test_tenant_of_a_key():
    keys = APIKeys.of("single", [("sk-a1", "alice"), ("sk-a2", "alice"), ("sk-b", "bob")])
    assert keys and keys.tenants == ["alice", "bob", "default"]
    assert [keys.tenant_of(t) for t in ("sk-a1", "sk-a2", "sk-b", "single")] == ["alice", "alice", "bob", "default"]
    for token in (None, "", "sk-a", "sk-a1 ", "SK-A1", "sk-a1x"):
        assert keys.tenant_of(token) is None
    assert not APIKeys([]) and APIKeys([]).tenant_of("anything") is None
    assert "sk-a1" not in repr(vars(keys))  # only digests are kept


def test_keys_never_in_a_config_repr():
    config = ServerConfig(api_key="sk-single", api_keys=(("sk-a1", "alice"),))
    assert "sk-single" not in repr(config) and "sk-a1" not in repr(config)


@pytest.mark.parametrize("value, token", [
    (b"Bearer abc", "abc"), (b"bearer abc", "abc"), (b"BEARER  abc  ", "abc"), (b" Bearer abc", "abc"),
    (b"Basic abc", None), (b"Bearer", None), (b"Bearer ", None), (b"abc", None), (b"", None),
    (b"Bearerabc", None),
])
def test_bearer_token(value, token):
    assert bearer_token(value) == token


def test_authenticate():
    keys = APIKeys([("sk-a", "alice")])
    assert authenticate([(b"authorization", b"Bearer sk-a")], keys) == ("alice", None)
    assert authenticate([(b"Authorization", b"bearer sk-a")], keys) == ("alice", None)
    assert authenticate([], keys) == (None, INVALID_KEY)
    assert authenticate([(b"authorization", b"Bearer sk-b")], keys) == (None, INVALID_KEY)
    two = [(b"authorization", b"Bearer sk-a"), (b"authorization", b"Bearer sk-b")]
    assert authenticate(two, keys) == (None, DUPLICATE_AUTHORIZATION)
    assert authenticate(two, APIKeys([])) == (None, DUPLICATE_AUTHORIZATION)  # without keys too
    assert authenticate([(b"authorization", b"Bearer anything")], APIKeys([])) == (None, None)


# -- hosts -----------------------------------------------------------------------------------------
def test_allowed_hosts_for_a_bind_address():
    assert allowed_hosts_for("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_for("localhost") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_for("127.0.0.2") == ("localhost", "127.0.0.1", "::1", "127.0.0.2")
    assert allowed_hosts_for("[::1]") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_for("127.0.0.1", [" API.example.com ", "", "*.internal"]) == (
        "localhost", "127.0.0.1", "::1", "api.example.com", "*.internal")
    assert allowed_hosts_for("127.0.0.1", ["*"]) is None  # the check off
    assert allowed_hosts_for("0.0.0.0") is None  # not loopback: any Host, unless given a list
    assert allowed_hosts_for("192.168.1.5", ["api.example.com"]) == ("api.example.com",)
    assert allowed_hosts_for("0.0.0.0", ["a.example", "*"]) is None


@pytest.mark.parametrize("value, name", [
    ("localhost", "localhost"), ("LocalHost:8000", "localhost"), ("127.0.0.1:8000", "127.0.0.1"),
    ("[::1]:8000", "::1"), ("[::1]", "::1"), ("Example.COM.:80", "example.com"), ("example.com.", "example.com"),
    (" a.example ", "a.example"), ("a.example:", "a.example:"),
])
def test_host_name(value, name):
    assert host_name(value) == name


def test_host_allowed():
    allowed = ("localhost", "127.0.0.1", "*.example.com")
    assert host_allowed("localhost", allowed) and host_allowed("127.0.0.1", allowed)
    assert host_allowed("api.example.com", allowed) and host_allowed("a.b.example.com", allowed)
    for name in ("example.com", "evilexample.com", "example.com.evil", "127.0.0.2", "localhost.evil", ""):
        assert not host_allowed(name, allowed), name


# -- flags -----------------------------------------------------------------------------------------
def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def server_config(*argv):
    """The server section `specdec serve ARGV` runs with (its name "x" unless ARGV names one)."""
    return config_from_args(parse("--served-model-name", "x", *argv), keys=True).server


def test_limit_flags_and_their_defaults():
    config = server_config()
    assert config == ServerConfig(served_model_name="x", spec=config.spec,
                                  allowed_hosts=("localhost", "127.0.0.1", "::1"))
    config = server_config("--max-body-bytes", "1000", "--max-prompt-bytes", "500", "--body-timeout", "2",
                                "--header-timeout", "3", "--keep-alive-timeout", "4", "--limit-concurrency", "5",
                                "--max-header-bytes", "2048", "--write-timeout", "6", "--sse-keepalive", "7",
                                "--coalesce-stream-chunks", "--shared-history", "--public-metrics")
    assert (config.max_body_bytes, config.max_prompt_bytes, config.body_timeout, config.header_timeout,
            config.keep_alive_timeout, config.limit_concurrency, config.max_header_bytes, config.write_timeout,
            config.sse_keepalive) == (1000, 500, 2.0, 3.0, 4.0, 5, 2048, 6.0, 7.0)
    assert not config.stream_one_token_per_chunk and config.shared_history and config.public_metrics
    assert server_config("--limit-concurrency", "0").limit_concurrency is None


@pytest.mark.parametrize("argv", [
    ["--max-body-bytes", "0"], ["--max-prompt-bytes", "0"], ["--max-prompt-bytes", "-5"],
    ["--limit-concurrency", "-1"], ["--max-header-bytes", "100"], ["--body-timeout", "0"],
    ["--header-timeout", "-1"], ["--keep-alive-timeout", "0"], ["--write-timeout", "0"], ["--sse-keepalive", "0"],
])
def test_bad_limit_flags_are_one_line_errors(argv):
    with pytest.raises(SpecdecError, match=argv[0]):
        server_config(*argv)


def test_host_flags():
    assert server_config("--host", "0.0.0.0").allowed_hosts is None
    assert server_config("--host", "0.0.0.0", "--allowed-hosts", "api.example.com").allowed_hosts == (
        "api.example.com",)
    assert server_config("--allowed-hosts", "*").allowed_hosts is None
    assert server_config("--allowed-hosts", "a.example,*.b.example").allowed_hosts == (
        "localhost", "127.0.0.1", "::1", "a.example", "*.b.example")


def test_key_flags_and_environment(tmp_path, monkeypatch, caplog):
    path = keys_file(tmp_path, "alice sk-a\nbob sk-b\n")
    config = server_config("--api-keys-file", path)
    assert config.api_key is None and config.api_keys == (("sk-a", "alice"), ("sk-b", "bob"))
    monkeypatch.setenv("SPECDEC_API_KEYS", "carol sk-c")
    assert server_config().api_keys == (("sk-c", "carol"),)
    with caplog.at_level(logging.WARNING, logger="specdec.server"):
        assert server_config("--api-key", "sk-flag").api_key == "sk-flag"
    assert any("process list" in r.getMessage() for r in caplog.records)  # a flag is visible in `ps`
    assert all("sk-flag" not in r.getMessage() for r in caplog.records)
    with pytest.raises(SpecdecError, match="given twice"):
        server_config("--api-key", "sk-c")
