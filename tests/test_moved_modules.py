"""Old import paths of moved modules (fastrl._moved): the same module object, for every form of import."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

from fastrl import _moved


@pytest.fixture()
def moved_package(tmp_path, monkeypatch):
    """A real package ``oldpkg`` whose module ``thing`` moved to ``newpkg.thing``."""
    (tmp_path / "oldpkg").mkdir()
    (tmp_path / "oldpkg" / "__init__.py").write_text("")
    (tmp_path / "newpkg").mkdir()
    (tmp_path / "newpkg" / "__init__.py").write_text("")
    (tmp_path / "newpkg" / "thing.py").write_text("VALUE = 41\ndef value():\n    return VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = {"oldpkg.thing": "newpkg.thing"}
    finder = _moved.install(table)
    yield table
    sys.meta_path.remove(finder)
    for name in ("oldpkg", "oldpkg.thing", "newpkg", "newpkg.thing"):
        sys.modules.pop(name, None)


def test_old_name_is_the_new_module(moved_package):
    import newpkg.thing
    import oldpkg.thing

    assert oldpkg.thing is newpkg.thing
    from oldpkg import thing

    assert thing is newpkg.thing
    assert importlib.import_module("oldpkg.thing") is newpkg.thing
    assert newpkg.thing.__name__ == "newpkg.thing"  # the module keeps its own name


def test_a_patch_through_the_old_name_reaches_the_new_module(moved_package, monkeypatch):
    import newpkg.thing
    import oldpkg.thing

    monkeypatch.setattr(oldpkg.thing, "VALUE", 7)
    assert newpkg.thing.value() == 7


def test_install_is_idempotent():
    before = len(sys.meta_path)
    _moved.install()
    _moved.install()
    assert len(sys.meta_path) == before  # fastrl's own import installed it already


def test_an_unmoved_name_is_not_found():
    finder = _moved.MovedModuleFinder({"a.b": "c.d"})
    assert finder.find_spec("a.c") is None


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED_MODULES.items()))
def test_every_moved_module_imports_under_its_old_name(old, new):
    # a fresh interpreter: the old name first, as a user's script would
    code = textwrap.dedent(f"""
        import importlib
        old = importlib.import_module({old!r})
        new = importlib.import_module({new!r})
        assert old is new, (old, new)
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_new_module_keeps_its_own_spec(moved_package):
    import oldpkg.thing

    assert oldpkg.thing.__spec__.name == "newpkg.thing"  # not the old name's spec: reload and spawn read it
    assert importlib.reload(oldpkg.thing).VALUE == 41


def test_python_dash_m_under_the_old_name_runs_the_new_module():
    # fastrl.commands.compare's __main__ is the child-run entry point: its usage line and exit status
    old = subprocess.run([sys.executable, "-m", "fastrl.train.compare", "--help"], capture_output=True, text=True)
    new = subprocess.run([sys.executable, "-m", "fastrl.commands.compare", "--help"], capture_output=True, text=True)
    assert "fastrl.commands.compare" in new.stdout + new.stderr
    assert (old.returncode, old.stdout, old.stderr) == (new.returncode, new.stdout, new.stderr)
