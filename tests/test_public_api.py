"""The public surface is exactly spanprof.__all__, sorted, each name documented."""

from __future__ import annotations

import inspect

import pytest

import spanprof


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted and lists every public attribute of the package (and only those)."""
    public = {
        name
        for name, value in vars(spanprof).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert spanprof.__all__ == sorted(spanprof.__all__)
    assert set(spanprof.__all__) == public


def test_public_objects_have_docstrings() -> None:
    """Every public class and function says what it is for."""
    for name in spanprof.__all__:
        value = getattr(spanprof, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), name


def test_importing_patches_nothing() -> None:
    """Importing spanprof installs no patch: the engine is off until installed explicitly."""
    import subprocess
    import sys

    code = (
        "import asyncio, concurrent.futures; h = asyncio.Handle._run; "
        "s = concurrent.futures.ThreadPoolExecutor.submit; import spanprof; "
        "assert asyncio.Handle._run is h and concurrent.futures.ThreadPoolExecutor.submit is s; "
        "assert spanprof.engine.installed_backend() is None"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_public_classes_report_the_public_module() -> None:
    """Reprs and tracebacks name spanprof.X, not the private module that defines X."""
    assert spanprof.ProfilingMiddleware.__module__ == "spanprof"
    assert spanprof.WSGIProfilingMiddleware.__module__ == "spanprof"
    assert spanprof.profile_labels.__module__ == "spanprof"
    assert repr(spanprof.FROM_ENV) == "spanprof.FROM_ENV"


def test_version_is_defined_once() -> None:
    """The package, the installed distribution and the exporters' scope share one version."""
    from importlib import metadata

    from spanprof._profiling._encoders._window import series_labels

    assert spanprof.__version__ == metadata.version("spanprof")
    assert ("otel.scope.version", spanprof.__version__) in series_labels("app", {})


def test_engine_switch_moved_to_spanprof_engine() -> None:
    """The engine's old top-level names still work, with a DeprecationWarning naming the move."""
    import warnings

    assert "install_label_engine" not in spanprof.__all__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = spanprof.install_label_engine  # type: ignore[attr-defined]
    assert old is spanprof.engine.install_label_engine
    assert "spanprof.engine.install_label_engine" in str(caught[0].message)
    assert caught[0].category is DeprecationWarning
    with pytest.raises(AttributeError):
        spanprof.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_record_labels_yields_what_code_ran_with() -> None:
    """spanprof.testing.record_labels() shows the label sets code ran under, then uninstalls."""
    from concurrent.futures import ThreadPoolExecutor

    import spanprof.testing

    assert spanprof.engine.installed_backend() is None
    with spanprof.testing.record_labels() as recorder:
        with spanprof.profile_labels(job="a"), ThreadPoolExecutor(1) as pool:
            assert pool.submit(spanprof.current_labels).result() == {"job": "a"}
        with spanprof.profile_labels(job="b"):
            assert recorder.thread_labels() == {"job": "b"}
        assert recorder.labelled_threads() == {}
    assert [dict(labels) for labels in recorder.labels_seen] == [{"job": "a"}, {"job": "b"}]
    assert spanprof.engine.installed_backend() is None


def test_record_labels_restores_the_previous_backend() -> None:
    """A backend installed before the block is installed again after it."""
    import spanprof.testing

    outer = spanprof.RecorderBackend()
    spanprof.engine.install_label_engine(outer)
    try:
        with spanprof.testing.record_labels() as recorder:
            assert spanprof.engine.installed_backend() is recorder
        assert spanprof.engine.installed_backend() is outer
    finally:
        spanprof.engine.uninstall_label_engine()


def test_both_middlewares_share_one_options_type() -> None:
    """One ProfilingOptions type: same options, same checks, unknown names refused."""
    from starlette.applications import Starlette

    def wsgi_app(environ: object, start_response: object) -> list[bytes]:
        return []

    for make in (
        lambda **kw: spanprof.ProfilingMiddleware(Starlette(), **kw),
        lambda **kw: spanprof.WSGIProfilingMiddleware(wsgi_app, **kw),
    ):
        with pytest.raises(TypeError, match="unexpected keyword argument 'slo_second'"):
            make(profiler=None, slo_second=1)
        with pytest.raises(ValueError, match="not both"):
            make(profiler=None, slo=spanprof.SloPolicy(), slo_seconds=1.0)
        with pytest.raises(ValueError, match="slo: expected a SloPolicy"):
            make(profiler=None, slo=0.5)
        with pytest.raises(ValueError, match="profiler: expected a ProfilerBackend"):
            make(profiler="pyroscope")
        with pytest.raises(ValueError, match="route_resolver: expected a callable"):
            make(profiler=None, route_resolver="/items")


def test_slo_policy_is_accepted_and_validated() -> None:
    """slo=SloPolicy(...) drives the breach verdicts; a bad policy fails when it is built."""
    from starlette.applications import Starlette

    policy = spanprof.SloPolicy(default=0.2, routes={"/checkout": 0.05})
    middleware = spanprof.ProfilingMiddleware(Starlette(), profiler=None, slo=policy)
    assert middleware._durations.slo is policy
    with pytest.raises(ValueError, match=r"SloPolicy\.default"):
        spanprof.SloPolicy(default=-1)
    with pytest.raises(ValueError, match="route template"):
        spanprof.SloPolicy(routes={"checkout": 1.0})
