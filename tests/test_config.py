"""Invalid configuration fails at construction with a ValueError naming the setting."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from spanprof import ExactBackend, ProfilingMiddleware, PyroscopeBackend, SloPolicy
from spanprof._profiling._settings import PyroscopeSettings
from spanprof._types import Receive, Scope, Send
from spanprof._web._options import MiddlewareSettings

from .conftest import AGENT_ENV


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    return None


@pytest.mark.parametrize(
    ("environ", "setting"),
    [
        ({"PYROSCOPE_SERVER_ADDRESS": "pyroscope:4040"}, "PYROSCOPE_SERVER_ADDRESS"),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_UPLOAD_INTERVAL": "fast"},
            "PYROSCOPE_UPLOAD_INTERVAL",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_UPLOAD_INTERVAL": "0"},
            "PYROSCOPE_UPLOAD_INTERVAL",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_SAMPLE_RATE": "-5"},
            "PYROSCOPE_SAMPLE_RATE",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": "region"},
            "PYROSCOPE_LABELS",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": "span_id=1"},
            "PYROSCOPE_LABELS",
        ),
        (
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": "a-b=1"},
            "PYROSCOPE_LABELS",
        ),
        ({"SPANPROF_TRACE_ID_LABEL": "maybe"}, "SPANPROF_TRACE_ID_LABEL"),
        ({"SPANPROF_LABEL_ENGINE": "magic"}, "SPANPROF_LABEL_ENGINE"),
    ],
)
def test_bad_environment_names_the_variable(environ: dict[str, str], setting: str) -> None:
    """Each bad environment value raises ValueError with the variable's name."""
    with pytest.raises(ValueError, match=setting):
        ProfilingMiddleware(_app, environ=environ)


@pytest.mark.needs_agent
def test_environment_configures_the_pyroscope_backend() -> None:
    """The Pyroscope agents' variables map onto the backend, OTEL_SERVICE_NAME as fallback."""
    backend = PyroscopeBackend.from_env(AGENT_ENV)
    assert backend is not None
    assert backend.server_address == "http://pyroscope:4040"
    assert backend.application_name == "checkout"
    assert backend.upload_interval == 15
    assert backend.sample_rate == 97
    assert backend.tenant_id == "team-a"
    assert (backend.basic_auth_username, backend.basic_auth_password) == ("u", "p")
    assert backend.tags == {"region": "eu-west-1", "zone": "b"}
    named = PyroscopeBackend.from_env(
        {
            "PYROSCOPE_SERVER_ADDRESS": "http://p:4040",
            "PYROSCOPE_APPLICATION_NAME": "svc",
            "OTEL_SERVICE_NAME": "other",
        }
    )
    assert named is not None
    assert named.application_name == "svc"


def test_no_server_address_means_no_profiler() -> None:
    """Without PYROSCOPE_SERVER_ADDRESS the middleware labels but starts no profiler."""
    assert PyroscopeBackend.from_env({}) is None
    assert ProfilingMiddleware(_app, environ={}).profiler is None


def test_profiler_must_be_a_backend() -> None:
    """A profiler= that is not a ProfilerBackend is refused at construction."""
    with pytest.raises(ValueError, match="profiler"):
        ProfilingMiddleware(_app, profiler="pyroscope")  # type: ignore[arg-type]


def test_spanprof_profiler_selects_the_backend() -> None:
    """auto (default) and exact pick ExactBackend; anything else but pyroscope errs."""
    from spanprof import ExactBackend

    base = {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040"}
    exact = ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": "exact"}).profiler
    assert isinstance(exact, ExactBackend)
    assert not exact.auto
    default = ProfilingMiddleware(_app, environ=base).profiler
    assert isinstance(default, ExactBackend)
    assert default.auto
    auto = ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": " AUTO "}).profiler
    assert auto is default  # one exact backend per configuration and process
    with pytest.raises(ValueError, match="SPANPROF_PROFILER"):
        ProfilingMiddleware(_app, environ={**base, "SPANPROF_PROFILER": "perf"})


@pytest.mark.needs_agent
def test_spanprof_profiler_pyroscope_selects_the_agent() -> None:
    """SPANPROF_PROFILER=pyroscope picks the pyroscope-io backend."""
    base = {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "SPANPROF_PROFILER": "pyroscope"}
    agent = ProfilingMiddleware(_app, environ=base).profiler
    assert isinstance(agent, PyroscopeBackend)


@pytest.mark.needs_agent
def test_startup_says_which_profiler_runs(caplog: pytest.LogCaptureFixture) -> None:
    """The agent, asked for directly, gets one INFO line saying so, and how to get exact."""
    import logging

    from spanprof._profiling._runtime import ProfilerRuntime

    class Agentless(PyroscopeBackend):
        def start(self) -> None:  # the real agent is not needed to see the line
            pass

        def shutdown(self) -> None:
            pass

    runtime = ProfilerRuntime(Agentless(server_address="http://p:4040", application_name="a"))
    with caplog.at_level(logging.INFO, logger="spanprof"):
        runtime.start()
    try:
        lines = [r.getMessage() for r in caplog.records if "profiling with" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "pyroscope-io and the label engine" in lines[0]
        assert "unset SPANPROF_PROFILER" in lines[0]
    finally:
        runtime.stop()


# --- issue #13: values that would fail later, in the upload thread, fail here -----------------


@pytest.mark.parametrize("value", ["team-a\n", "team\r\nX-Evil: 1", "a\x00b", "t\u20ac"])
def test_a_tenant_id_no_header_can_carry_is_refused_at_configuration(value: str) -> None:
    """PYROSCOPE_TENANT_ID / tenant_id that http.client would refuse raise ValueError now."""
    with pytest.raises(ValueError, match="PYROSCOPE_TENANT_ID"):
        ExactBackend.from_env(
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_TENANT_ID": value}
        )
    with pytest.raises(ValueError, match="tenant_id"):
        PyroscopeBackend(server_address="http://p:4040", application_name="a", tenant_id=value)


def test_agent_http_headers_are_checked_like_the_tenant() -> None:
    """pyroscope-io's http_headers (extra_options) with a line break raise ValueError now."""
    with pytest.raises(ValueError, match="X-Token"):
        PyroscopeBackend(
            server_address="http://p:4040",
            application_name="a",
            extra_options={"http_headers": {"X-Token": "abc\n"}},
        )


def test_a_password_with_a_newline_is_refused_without_showing_it() -> None:
    """A secret read with its trailing newline fails at configuration; the message hides it."""
    env = {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_BASIC_AUTH_PASSWORD": "s3cr3t\n"}
    with pytest.raises(ValueError, match="PYROSCOPE_BASIC_AUTH_PASSWORD") as info:
        ExactBackend.from_env(env)
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize("variable", ["PYROSCOPE_BASIC_AUTH_USER", "PYROSCOPE_BASIC_AUTH_PASSWORD"])
def test_a_credential_with_an_undecodable_byte_is_refused_without_showing_it(variable: str) -> None:
    """A byte that is not UTF-8 (a surrogate in os.environ) would fail every Basic token."""
    env = {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", variable: "s3cr\udce9t"}
    with pytest.raises(ValueError, match=f"{variable}.*UTF-8") as info:
        ExactBackend.from_env(env)
    assert "s3cr" not in str(info.value)


@pytest.mark.parametrize("address", ["http://p:99999", "http://p:0", "http://p:x", "http://:4040"])
def test_a_bad_port_or_host_is_refused_at_configuration(address: str) -> None:
    """An address the uploader could not connect to raises ValueError naming the setting."""
    with pytest.raises(ValueError, match="PYROSCOPE_SERVER_ADDRESS"):
        ExactBackend.from_env({"PYROSCOPE_SERVER_ADDRESS": address})
    with pytest.raises(ValueError, match="server_address"):
        ExactBackend(server_address=address, application_name="a")


def test_explicit_basic_auth_wins_over_the_addresss_credentials() -> None:
    """basic_auth_username / _password, when set, replace user:pass@ of the address."""
    settings = PyroscopeSettings.from_env(
        {
            "PYROSCOPE_SERVER_ADDRESS": "https://alice:old@p:4040/",
            "PYROSCOPE_BASIC_AUTH_USER": "bob",
            "PYROSCOPE_BASIC_AUTH_PASSWORD": "new",
        }
    )
    assert settings is not None
    assert settings.server_address == "https://p:4040"
    assert (settings.basic_auth_username, settings.basic_auth_password) == ("bob", "new")


def test_an_address_error_never_shows_the_password() -> None:
    """A bad address with credentials is reported with the password redacted."""
    with pytest.raises(ValueError, match="PYROSCOPE_SERVER_ADDRESS") as info:
        ExactBackend.from_env({"PYROSCOPE_SERVER_ADDRESS": "http://alice:hunter2@p:99999"})
    assert "hunter2" not in str(info.value)
    assert "alice:***@" in str(info.value)


_SECRET_ARGUMENTS: dict[str, Any] = {
    "server_address": "http://p:4040",
    "application_name": "a",
    "basic_auth_username": "u",
    "basic_auth_password": "hunter2",
}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: PyroscopeSettings(**_SECRET_ARGUMENTS), id="settings"),
        pytest.param(lambda: ExactBackend(**_SECRET_ARGUMENTS), id="exact"),
        pytest.param(
            lambda: PyroscopeBackend(
                **_SECRET_ARGUMENTS, extra_options={"http_headers": {"X-Token": "hunter3"}}
            ),
            id="pyroscope",
            marks=pytest.mark.needs_agent,
        ),
    ],
)
def test_reprs_never_show_the_password(make: Callable[[], object]) -> None:
    """repr() of the settings and of both backends shows '***' for the password."""
    text = repr(make())
    assert "hunter" not in text, text
    assert "basic_auth_password='***'" in text, text
    assert "server_address='http://p:4040'" in text, text


_TOKEN_ADDRESS = "https://glc_s3cr3tt0ken@p:4040"


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: PyroscopeSettings(server_address=_TOKEN_ADDRESS, application_name="a"),
            id="settings",
        ),
        pytest.param(
            lambda: PyroscopeSettings.from_env({"PYROSCOPE_SERVER_ADDRESS": _TOKEN_ADDRESS}),
            id="from_env",
        ),
        pytest.param(
            lambda: ExactBackend(server_address=_TOKEN_ADDRESS, application_name="a"), id="exact"
        ),
        pytest.param(
            lambda: PyroscopeBackend(server_address=_TOKEN_ADDRESS, application_name="a"),
            id="pyroscope",
            marks=pytest.mark.needs_agent,
        ),
    ],
)
def test_reprs_never_show_a_token_given_as_the_user_name(make: Callable[[], object]) -> None:
    """https://TOKEN@host: the user name without a password is masked as a password is."""
    made = make()
    text = repr(made)
    assert "s3cr3t" not in text, text
    assert "basic_auth_username='***'" in text, text
    assert "server_address='https://p:4040'" in text, text
    # Masked only when shown: it is still sent.
    assert made.basic_auth_username == "glc_s3cr3tt0ken"  # type: ignore[attr-defined]


# --- a variable set but blank (compose's `VAR: ""`) is a variable left unset --------------------

_BLANK_IS_UNSET = [
    "PYROSCOPE_APPLICATION_NAME",
    "OTEL_SERVICE_NAME",
    "PYROSCOPE_UPLOAD_INTERVAL",
    "PYROSCOPE_SAMPLE_RATE",
    "PYROSCOPE_TENANT_ID",
    "PYROSCOPE_BASIC_AUTH_USER",
    "PYROSCOPE_BASIC_AUTH_PASSWORD",
    "PYROSCOPE_LABELS",
    "SPANPROF_PROFILER",
    "SPANPROF_PROFILES_EXPORTER",
    "SPANPROF_PROFILE_CLOCK",
    "SPANPROF_MEMORY",
    "SPANPROF_ALLOC_SAMPLE_BYTES",
    "SPANPROF_TRACE_ID_LABEL",
    "SPANPROF_SLO_SECONDS",
    "SPANPROF_ROUTE_SLO",
    "SPANPROF_LABEL_ENGINE",
]


def _resolved(environ: dict[str, str]) -> tuple[object, ...]:
    settings = MiddlewareSettings.build(
        "ProfilingMiddleware", {"environ": environ}, route_resolver=None, resolves="scope"
    )
    runtime = settings.runtime
    return (runtime.backend, runtime.mechanism, settings.with_trace_id, settings.durations.slo)


@pytest.mark.parametrize("value", ["", " ", "\t\n"])
@pytest.mark.parametrize("variable", _BLANK_IS_UNSET)
def test_a_blank_variable_means_its_default(variable: str, value: str) -> None:
    """Empty or whitespace-only is the same as unset, for every variable spanprof reads."""
    base = {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040"}
    default = _resolved(base)
    assert _resolved({**base, variable: value}) == default
    assert PyroscopeSettings.from_env({"PYROSCOPE_SERVER_ADDRESS": value}) is None


# --- the server address: cut passwords, bracketed hosts, its credentials ------------------------


@pytest.mark.parametrize(
    "address",
    [
        "https://123456:glc_abc/def+ghi=@profiles-prod.grafana.net",
        "https://user:Xq7#Wv9k@pyroscope.example.com",
        "https://123456:8080/Zx9@pyroscope.example.com",
        "https://user:Mn4?Lp2z@pyroscope.example.com:4040",
    ],
)
def test_a_password_cut_by_an_unencoded_character_is_refused_without_showing_it(
    address: str,
) -> None:
    """urlsplit ends the host part at the first '/', '?' or '#', so such a password would be
    read as a host, a port or a path: the address is refused, the secret is not shown, and the
    message says to percent-encode it."""
    secret = address.partition("://")[2].rpartition("@")[0].partition(":")[2]
    makes: list[Callable[[], object]] = [
        lambda: PyroscopeSettings.from_env({"PYROSCOPE_SERVER_ADDRESS": address}),
        lambda: PyroscopeSettings(server_address=address, application_name="a"),
    ]
    for make in makes:
        with pytest.raises(ValueError, match="percent-encode") as info:
            make()
        message = str(info.value)
        assert "SERVER_ADDRESS" in message.upper(), message
        assert secret not in message, message
        for piece in secret.replace("#", "/").replace("?", "/").split("/"):
            assert piece not in message, message
        assert "pyroscope.example.com" in message or "grafana.net" in message, message


def test_redact_url_hides_everything_before_the_last_at_sign() -> None:
    """The user info as the address shows it, not as urlsplit cuts it; a lone user info (often a
    token) is hidden whole."""
    from spanprof._config import redact_url

    assert redact_url("https://u:glc_a/b@h/x") == "https://u:***@h/x"
    assert redact_url("https://u:p#q@h") == "https://u:***@h"
    assert redact_url("https://u:p@q@h:1") == "https://u:***@h:1"
    assert redact_url("https://tok/en@h") == "https://***@h"
    assert redact_url("https://token@h") == "https://***@h"
    assert redact_url("https://h:4040/p") == "https://h:4040/p"


def test_redact_url_hides_the_values_of_a_query() -> None:
    """An OTLP profiles endpoint may keep a query, and keys travel there (``?api_key=``): its
    names stay readable, its values are hidden, in every message and repr that shows the URL."""
    from spanprof._config import redact_url

    assert (
        redact_url("https://h/v1?api_key=s3cret&tenant=a") == "https://h/v1?api_key=***&tenant=***"
    )
    assert redact_url("https://u:p@h/v1?k=v#f") == "https://u:***@h/v1?k=***#f"
    assert redact_url("https://h/v1?flag") == "https://h/v1?flag"


@pytest.mark.parametrize(
    "address",
    [
        "http://[::1:4040",
        "http://[pyroscope]:4040",
        "http://[::1]]:80",
        "http://p[::1]:80",
        "http://u:hunter2@[::1:4040",
    ],
)
def test_a_malformed_bracketed_host_is_refused_naming_the_setting(address: str) -> None:
    """urlsplit's own errors ("Invalid IPv6 URL") name neither the variable nor the value."""
    with pytest.raises(ValueError, match="PYROSCOPE_SERVER_ADDRESS") as info:
        PyroscopeSettings.from_env({"PYROSCOPE_SERVER_ADDRESS": address})
    assert "IPv6" in str(info.value)
    assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError, match="server_address"):
        ExactBackend(server_address=address, application_name="a")


@pytest.mark.parametrize(
    ("address", "what"),
    [
        ("http://ho%73t:4040", "percent-encoded"),
        ("http://u:p@ho%2Est", "percent-encoded"),
        ("http://pyroscope:4040#frag", "#fragment"),
        ("http://pyroscope:4040/#", "#fragment"),
        ("http://pyroscope:4040?tenant=a", "?query"),
    ],
)
def test_an_address_the_uploaders_cannot_extend_is_refused(address: str, what: str) -> None:
    """A percent-encoded host never resolves; a fragment or query would swallow the paths the
    uploaders append (every upload would go to the server's base URL, or nowhere)."""
    with pytest.raises(ValueError, match="PYROSCOPE_SERVER_ADDRESS") as info:
        PyroscopeSettings.from_env({"PYROSCOPE_SERVER_ADDRESS": address})
    assert what in str(info.value)


@pytest.mark.parametrize("host", ["b\u00fccher..example", "\u00fc" + "a" * 70 + ".example"])
def test_a_host_name_idna_cannot_encode_is_refused_naming_the_setting(host: str) -> None:
    """http.client encodes a non-ASCII host with the idna codec at every upload; a name it
    refuses failed every one of them as an unexpected error."""
    address = f"http://{host}:4040"
    with pytest.raises(ValueError, match="PYROSCOPE_SERVER_ADDRESS") as info:
        PyroscopeSettings.from_env({"PYROSCOPE_SERVER_ADDRESS": address})
    assert "internationalized domain name" in str(info.value)
    with pytest.raises(ValueError, match="server_address"):
        ExactBackend(server_address=address, application_name="a")
    accepted = PyroscopeSettings(
        server_address="http://b\u00fccher.example:4040", application_name="a"
    )
    assert accepted.server_address == "http://b\u00fccher.example:4040"


def test_bracketed_ipv6_hosts_are_accepted() -> None:
    """An IPv6 literal, with or without a zone, is a host like any other."""
    for address in ("http://[::1]:4040", "http://[fe80::1%25eth0]:4040", "https://u:p@[::1]"):
        settings = PyroscopeSettings(server_address=address, application_name="a")
        assert "[" in settings.server_address


@pytest.mark.parametrize(
    ("address", "what"),
    [
        ("http://us%3Aer:pw@p:4040", "user name"),
        ("http://user:pw%0A@p:4040", "password"),
        ("http://user%00:pw@p:4040", "user name"),
    ],
)
def test_bad_credentials_in_the_address_name_the_address(address: str, what: str) -> None:
    """Credentials taken from the address are reported as the address's, not as
    basic_auth_username / basic_auth_password (which were never set)."""
    with pytest.raises(ValueError, match="PYROSCOPE_SERVER_ADDRESS") as info:
        PyroscopeSettings.from_env({"PYROSCOPE_SERVER_ADDRESS": address})
    assert what in str(info.value)
    assert "basic_auth" not in str(info.value)
    assert "pw" not in str(info.value).replace("password", "")
    with pytest.raises(ValueError, match="server_address"):
        PyroscopeSettings(server_address=address, application_name="a")


# --- duplicate keys and the wrong separator, which used to be taken silently -------------------


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ("env=prod,env=dev", r"PYROSCOPE_LABELS=.*: the label 'env' is given twice"),
        (" env = prod , region=eu,env=x", r"PYROSCOPE_LABELS=.*: the label 'env' is given twice"),
        ("env=prod;region=eu", r"PYROSCOPE_LABELS: the value of 'env' contains '='.*','"),
        ("env=a=b", r"PYROSCOPE_LABELS: the value of 'env' contains '='"),
    ],
)
def test_a_duplicate_label_or_a_wrong_separator_is_refused(labels: str, message: str) -> None:
    """PYROSCOPE_LABELS (and a string tags=) refuses what it used to merge or glue together."""
    with pytest.raises(ValueError, match=message):
        PyroscopeSettings.from_env(
            {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": labels}
        )
    with pytest.raises(ValueError, match=message.replace("PYROSCOPE_LABELS", "tags")):
        PyroscopeSettings(server_address="http://p:4040", application_name="a", tags=labels)  # type: ignore[arg-type]
    settings = PyroscopeSettings.from_env(
        {"PYROSCOPE_SERVER_ADDRESS": "http://p:4040", "PYROSCOPE_LABELS": "env=prod;eu, region=eu"}
    )
    assert settings is not None
    assert settings.tags == {"env": "prod;eu", "region": "eu"}


def test_a_tag_value_that_cannot_be_text_is_refused_at_construction() -> None:
    """tags= is configuration: a value whose str() raises is an error naming it, not the
    placeholder a request's profile_labels gets."""

    class Lazy:
        def __str__(self) -> str:
            raise ConnectionError("database gone")

    with pytest.raises(ValueError, match=r"tags: the value of 'team'.*ConnectionError"):
        PyroscopeSettings(
            server_address="http://p:4040",
            application_name="a",
            tags={"team": Lazy()},  # type: ignore[dict-item]
        )


# --- extra_options: what pyroscope.configure would refuse at start, refused at construction -----


@pytest.mark.needs_agent
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"uploadinterval": 5}, r"extra_options: 'uploadinterval' is not an option of pyroscope"),
        ({"tags": {"env": "prod"}}, r"extra_options: 'tags' is set by spanprof.*tags="),
        ({"app_name": "x"}, r"extra_options: 'app_name' is set by spanprof.*application_name="),
        ({"server_address": "http://q"}, r"extra_options: 'server_address' is set by spanprof"),
        ({"http_headers": {"X Bad\u00e9": "v"}}, r"extra_options\['http_headers'\]: 'X Bad"),
        ({"http_headers": {"X-Token:": "v"}}, r"extra_options\['http_headers'\]: 'X-Token:'"),
        ({"http_headers": {"": "v"}}, r"extra_options\['http_headers'\]: ''"),
        ({"http_headers": ["X-Token"]}, r"extra_options\['http_headers'\]: expected a mapping"),
        ({5: True}, r"extra_options: expected option names as strings"),
    ],
)
def test_extra_options_the_agent_would_refuse_fail_at_construction(
    extra: dict[Any, Any], message: str
) -> None:
    """A typo, a key spanprof sets itself, or a bad header name is refused before start()."""
    with pytest.raises((TypeError, ValueError), match=message):
        PyroscopeBackend(server_address="http://p:4040", application_name="a", extra_options=extra)


@pytest.mark.needs_agent
def test_extra_options_the_agent_takes_are_kept() -> None:
    """Real pyroscope.configure options and good header names pass through unchanged."""
    extra = {"report_pid": True, "http_headers": {"X-Scope-OrgID": "t", "x_token!": "v"}}
    backend = PyroscopeBackend(
        server_address="http://p:4040", application_name="a", extra_options=extra
    )
    assert backend.extra_options == extra


# --- arguments of the wrong type: an error naming the argument, at construction ---------------

_ADDRESS = "http://p:4040"


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ({"server_address": None}, "server_address"),
        ({"application_name": 123}, "application_name"),
        ({"application_name": None}, "application_name"),
        ({"application_name": "  "}, "application_name"),
        ({"application_name": "sh\nop"}, "application_name"),
        ({"upload_interval": "10s"}, "upload_interval"),
        ({"upload_interval": True}, "upload_interval"),
        ({"sample_rate": 99.5}, "sample_rate"),
        ({"tenant_id": None}, "tenant_id"),
        ({"tenant_id": 5}, "tenant_id"),
        ({"basic_auth_username": None}, "basic_auth_username"),
        ({"basic_auth_password": None}, "basic_auth_password"),
        ({"tags": [("a", "b")]}, "tags"),
        ({"memory": "false"}, "memory"),
        ({"auto": 1}, "auto"),
        ({"alloc_sample_bytes": "1024"}, "alloc_sample_bytes"),
        ({"alloc_sample_bytes": 1.5}, "alloc_sample_bytes"),
        ({"alloc_sample_bytes": True}, "alloc_sample_bytes"),
        ({"clock": None}, "clock"),
        ({"exporters": None}, "exporters"),
        ({"exporters": [1]}, "exporters"),
    ],
)
def test_a_backend_argument_of_the_wrong_type_is_named(
    arguments: dict[str, Any], name: str
) -> None:
    """ExactBackend (and the settings PyroscopeBackend shares) refuse wrong types by name."""
    with pytest.raises((TypeError, ValueError), match=rf"^{name}\b"):
        ExactBackend(**{"server_address": _ADDRESS, **arguments})


def test_the_application_name_is_trimmed_and_sanitized_like_a_label_value() -> None:
    """service_name is a label: surrounding spaces go, what Pyroscope cannot carry becomes _."""
    backend = ExactBackend(server_address=_ADDRESS, application_name=" shop{env=prod},b ")
    assert backend.application_name == "shop_env_prod__b"
    assert ExactBackend(server_address=_ADDRESS, application_name="shop\n").application_name == (
        "shop"
    )
    assert ExactBackend(
        server_address=_ADDRESS, application_name="shop.api-v2"
    ).application_name == ("shop.api-v2")


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"trace_id_label": "false"}, "trace_id_label"),
        ({"trace_id_label": 0}, "trace_id_label"),
        ({"slo_seconds": "0.3"}, "slo_seconds"),
        ({"slo_seconds": True}, "slo_seconds"),
        ({"route_slos": [("/a", 1)]}, "route_slos"),
        ({"route_slos": {"/a": True}}, "route_slos"),
        ({"excluded_urls": ["/health"]}, "excluded_urls"),
        ({"environ": "x"}, "environ"),
        ({"prometheus": object()}, "prometheus"),
        ({"meter_provider": "x"}, "meter_provider"),
        ({"tracer_provider": "x"}, "tracer_provider"),
    ],
)
def test_a_middleware_option_of_the_wrong_type_is_named(options: dict[str, Any], name: str) -> None:
    """Both middlewares refuse wrong types by the option's name, before the first request."""
    from spanprof import WSGIProfilingMiddleware

    arguments = {"profiler": None, "environ": {}, **options}
    with pytest.raises((TypeError, ValueError), match=rf"^{name}\b"):
        ProfilingMiddleware(_app, **arguments)
    with pytest.raises((TypeError, ValueError), match=rf"^{name}\b"):
        WSGIProfilingMiddleware(lambda environ, start_response: [], **arguments)


@pytest.mark.parametrize(
    "environ",
    [
        {"SPANPROF_SLO_SECONDS": 0.3},
        {"SPANPROF_TRACE_ID_LABEL": False},
        {**AGENT_ENV, "SPANPROF_PROFILER": "exact", "PYROSCOPE_SAMPLE_RATE": 100},
        {**AGENT_ENV, "SPANPROF_PROFILER": "exact", "PYROSCOPE_SERVER_ADDRESS": b"http://p"},
        {"SPANPROF_PROFILES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": 5000},
        {"SPANPROF_PROFILES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": 4318},
    ],
)
def test_an_environ_value_that_is_not_a_str_is_named(environ: dict[str, Any]) -> None:
    """environ={"SPANPROF_SLO_SECONDS": 0.3}: a TypeError naming the variable, not an
    AttributeError ('float' object has no attribute 'strip') from deep inside a parser."""
    (name,) = (key for key, value in environ.items() if not isinstance(value, str))
    with pytest.raises(TypeError, match=rf"^environ\[{name!r}\]: expected a str"):
        ProfilingMiddleware(_app, environ=environ)


def test_slo_policy_takes_numbers_not_booleans_or_strings() -> None:
    """SloPolicy(default=True) was a 1-second SLO; a string threshold was parsed."""
    with pytest.raises(ValueError, match=r"SloPolicy\.default"):
        SloPolicy(default=True)
    with pytest.raises(ValueError, match=r"SloPolicy\.routes"):
        SloPolicy(routes={"/a": "0.2"})  # type: ignore[dict-item]
    assert SloPolicy(default=1, routes={"/a": 0.2}).threshold("/a") == 0.2


@pytest.mark.parametrize(
    ("build", "setting"),
    [
        (lambda: SloPolicy(default=10**400), "SloPolicy.default"),
        (lambda: SloPolicy(default=10**5000), "SloPolicy.default"),
        (lambda: SloPolicy(routes={"/checkout": 10**400}), "SloPolicy.routes"),
        (
            lambda: ProfilingMiddleware(_app, profiler=None, slo_seconds=10**400, environ={}),
            "slo_seconds",
        ),
        (
            lambda: ProfilingMiddleware(
                _app, profiler=None, route_slos={"/checkout": 10**400}, environ={}
            ),
            "route_slos",
        ),
        (
            lambda: ProfilingMiddleware(
                _app,
                environ={
                    "PYROSCOPE_SERVER_ADDRESS": "http://p:4040",
                    "PYROSCOPE_UPLOAD_INTERVAL": "9" * 5000,
                },
            ),
            "PYROSCOPE_UPLOAD_INTERVAL",
        ),
        (
            lambda: ExactBackend(server_address="http://p:4040", upload_interval=10**5000),
            "upload_interval",
        ),
        (lambda: ExactBackend(server_address="http://p:4040", sample_rate=10**5000), "sample_rate"),
    ],
)
def test_a_huge_number_is_refused_naming_the_setting(
    build: Callable[[], object], setting: str
) -> None:
    """An int past float's range, or past int()'s 4300 digits, is out of range like any other:
    a ValueError naming the setting, not an OverflowError or Python's own digit-limit error."""
    with pytest.raises(ValueError, match=re.escape(setting)):
        build()
