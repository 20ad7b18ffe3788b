"""One user-error base class (issue 41 item 3): every error class of ``pairmine.pipeline`` and ``pairmine.operators``
derives from :class:`pairmine.operators.errors.PairmineError` (keeping its builtin base), unless it is an internal
error on :data:`INTERNAL`, with its reason; the CLI shows each as one ``pairmine: error:`` line, also through Ray."""

from __future__ import annotations

import importlib
import pkgutil

from pairmine.operators.errors import PairmineError

# Error classes that are not user errors (a traceback is right when one reaches the CLI): qualified name -> why.
INTERNAL = {
    "pairmine.operators.related.EmptySampleError": "a signal every caller (mine, calibrate) catches to fall back to "
                                                   "a TF-IDF without IDF; one that reached the CLI is a pairmine bug",
}

# The builtin base each user error kept, so `except ValueError` / `except OSError` callers still catch it.
BUILTIN_BASES = {
    "pairmine.pipeline.config.ConfigError": ValueError,
    "pairmine.pipeline.mine.LineageError": ValueError,
    "pairmine.pipeline.run_folder.RunExistsError": RuntimeError,
    "pairmine.pipeline.model_description.ModelDescriptionError": ValueError,
    "pairmine.pipeline.evaluate.EvalInputError": ValueError,
    "pairmine.pipeline.ray_adapter.PlanError": ValueError,
    "pairmine.pipeline.ray_adapter.PrivateRayRefused": ValueError,
    "pairmine.pipeline.ray_adapter.StallError": RuntimeError,
    "pairmine.pipeline.revela_model.UnsupportedDecoderError": ValueError,
    "pairmine.pipeline.xprt_model.UnsupportedModelError": ValueError,
    "pairmine.operators.storage.StorageError": OSError,
    "pairmine.operators.read.InputError": ValueError,
    "pairmine.operators.read.MissingColumnError": ValueError,
    "pairmine.operators.read.ColumnTypeError": ValueError,
}


def error_classes() -> dict[str, type]:
    """Every class defined in a module of pairmine.pipeline or pairmine.operators whose name ends in "Error" or that
    is an exception, by qualified name (all modules imported)."""
    found = {}
    for package in ("pairmine.pipeline", "pairmine.operators"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (isinstance(obj, type) and obj.__module__ == module.__name__
                        and (obj.__name__.endswith("Error") or issubclass(obj, BaseException))):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_error_class_is_a_pairmine_error_or_an_allowed_internal_one():
    classes = error_classes()
    assert set(BUILTIN_BASES) <= set(classes)  # the walk finds them (a sanity check of the walk itself)
    missing = sorted(name for name, cls in classes.items()
                     if cls is not PairmineError and not issubclass(cls, PairmineError) and name not in INTERNAL)
    assert not missing, (f"{missing}: derive from pairmine.operators.errors.PairmineError (keeping the builtin base) "
                         "or, for an internal error, add it to INTERNAL with the reason")
    for name, why in INTERNAL.items():  # every entry names a class that exists and is not a PairmineError
        assert name in classes and not issubclass(classes[name], PairmineError) and why
    for name, base in BUILTIN_BASES.items():
        assert issubclass(classes[name], PairmineError) and issubclass(classes[name], base), name
    assert not issubclass(PairmineError, (ValueError, RuntimeError, OSError))


def test_operators_errors_imports_nothing_of_pipeline():
    import ast
    from pathlib import Path

    import pairmine.operators.errors as errors

    tree = ast.parse(Path(errors.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                and "pipeline" in (getattr(n, "module", None) or "") + "".join(a.name for a in n.names)]


def test_the_cli_shows_each_user_error_as_its_message_also_from_a_ray_task():
    """Raised on the driver, or inside a Ray task (a RayTaskError that is also an instance of the error's class,
    with the remote traceback as its text), the CLI's message is the error's own message."""
    from ray.exceptions import RayTaskError

    from pairmine.pipeline.cli import user_error

    user_errors = {name: cls for name, cls in error_classes().items() if issubclass(cls, PairmineError)}
    assert set(BUILTIN_BASES) <= set(user_errors)
    for name, cls in user_errors.items():
        error = cls("what is wrong and what to change")
        assert user_error(error) == "what is wrong and what to change", name
        traceback = f"Traceback (most recent call last):\n  ...\n{name}: what is wrong and what to change"
        wrapped = RayTaskError("fn", traceback, error).as_instanceof_cause()
        assert isinstance(wrapped, cls) and isinstance(wrapped, RayTaskError), name
        assert user_error(wrapped) == "what is wrong and what to change", name


def test_the_cli_recognises_a_user_error_by_its_name_in_a_ray_traceback_only():
    """Ray Data's UserCodeException keeps only the remote traceback's text: a PairmineError named there (module and
    class) gives its message; an internal error, a builtin ValueError or a name that is not pairmine's does not."""
    from ray.exceptions import UserCodeException

    from pairmine.pipeline.cli import user_error

    def remote(line: str) -> UserCodeException:
        return UserCodeException(f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{line}\n")

    assert user_error(remote("pairmine.pipeline.revela_model.UnsupportedDecoderError: GPT2LMHeadModel: no lm_head")) \
        == "GPT2LMHeadModel: no lm_head"
    assert user_error(remote("pairmine.operators.read.ColumnTypeError: d.jsonl: column 'text' holds a JSON number")) \
        == "d.jsonl: column 'text' holds a JSON number"
    assert user_error(remote("pairmine.operators.related.EmptySampleError: cannot fit TF-IDF")) is None
    assert user_error(remote("ValueError: pairmine.x.y")) is None
    assert user_error(remote("pairmine.operators.read.open_input: not a class")) is None
    assert user_error(remote("pairmine.no_such_module.ConfigError: no")) is None
    # The same text outside a Ray error is a bug's message, not a user error.
    assert user_error(RuntimeError("pairmine.pipeline.config.ConfigError: x")) is None


def test_a_bug_keeps_its_traceback_and_user_builtins_stay_user_errors():
    from pairmine.operators.related import EmptySampleError
    from pairmine.pipeline.cli import user_error

    assert user_error(ValueError("a bug")) is None
    assert user_error(EmptySampleError("no word")) is None
    assert user_error(FileNotFoundError("no such file: x")) == "no such file: x"
    assert user_error(PermissionError("denied: x")) == "denied: x"
    # The innermost user error of a chain wins.
    from pairmine.pipeline.config import ConfigError

    try:
        try:
            raise ConfigError("inner")
        except ConfigError as e:
            raise RuntimeError("outer") from e
    except RuntimeError as outer:
        assert user_error(outer) == "inner"
