"""A fuzzer of the ``kestrel`` command, generated from the option declarations (``kestrel.cli.options``).

For every option of every command it takes each class of wrong value the option's kind declares
(:attr:`Kind.bad`: 0, -1, empty, NaN, inf, huge, a word, a missing file, a folder, a FIFO, a dangling
link, a non-UTF-8 name, a corrupt file of each kind...), puts it into a command line that is otherwise
valid, runs ``main`` in-process and asserts: exit 2, no traceback, and a first line
``kestrel CMD: error: ...`` that names the option or the file. Nothing may reach a model load (patched to
raise :class:`Reached`): a bad value must be refused before any work, and no output is left behind.

``test_every_option_of_every_command`` runs each (command, option, class) once, with a fixed seed, in
the default suite; ``test_random_command_lines`` (marker ``fuzz``: ``pytest -m fuzz``) runs many random
command lines with one to three bad values each, and prints how many it ran.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kestrel.cli.commands import all_commands
from kestrel.cli.main import main
from kestrel.cli.options import Command, Int, IntList, Kind, Option, shown

MODEL = "no-such-org/no-such-model"  # a well-formed hub id: only a load would find out it does not exist


class Reached(BaseException):
    """A command got as far as loading a model or doing its work: the bad value was accepted."""


@dataclass
class Files:
    root: Path
    image: str
    images: str  # a folder of two images
    npy: str
    folder: str  # an empty folder
    regular: str  # a text file
    fifo: str
    dangling: str
    missing: str
    non_utf8: str  # a missing path whose name is Latin-1
    corrupt_image: str
    corrupt_npy: str
    text_npy: str
    object_npy: str
    empty_npy: str
    under_file: str


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    root = tmp_path_factory.mktemp("fuzz")
    rng = np.random.default_rng(0)
    image = root / "photo.png"
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(image)
    images = root / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(images / name)
    np.save(root / "mask.npy", rng.standard_normal((256, 256)).astype(np.float32))
    (root / "empty-folder").mkdir()
    (root / "notes.txt").write_text("not an image\n")
    os.mkfifo(root / "pipe.png")
    (root / "dangling.png").symlink_to(root / "nowhere.png")
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    (root / "corrupt.npy").write_bytes(b"\x93NUMPY\x01\x00" + b"garbage")
    (root / "text.npy").write_text("0 1 2 3\n")
    np.save(root / "object.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    (root / "empty.npy").write_bytes(b"")
    return Files(root, str(image), str(images), str(root / "mask.npy"), str(root / "empty-folder"),
                 str(root / "notes.txt"), str(root / "pipe.png"), str(root / "dangling.png"),
                 str(root / "missing.png"), os.fsdecode(os.fsencode(str(root)) + b"/caf\xe9.png"),
                 str(root / "corrupt.png"), str(root / "corrupt.npy"), str(root / "text.npy"),
                 str(root / "object.npy"), str(root / "empty.npy"), str(root / "notes.txt" / "out"))


def bad_value(kind: Kind, cls: str, f: Files) -> str:
    """The text of one wrong value of class ``cls`` for ``kind``."""
    high = getattr(kind, "high", None)
    table = {
        "zero": "0", "negative": "-1", "empty": "", "spaces": "   ", "nan": "nan", "inf": "inf",
        "huge": str(high + 1) if isinstance(high, int) else "1e309", "word": "abc", "fraction": "1.5",
        "double_comma": "1,,8", "one_number": "5", "bad_label": "5,5:7", "braces": "a {} {x}",
        "missing": f.missing, "folder": f.folder, "file": f.regular, "fifo": f.fifo, "dangling": f.dangling,
        "non_utf8": f.non_utf8, "corrupt_image": f.corrupt_image, "corrupt_npy": f.corrupt_npy,
        "text_npy": f.text_npy, "object_npy": f.object_npy, "empty_npy": f.empty_npy, "under_file": f.under_file,
        "empty_folder": f.folder, "nul": "x\x00y",
    }
    if isinstance(kind, Int) and cls == "negative" and kind.low < 0:
        return str(kind.low - 1)
    if isinstance(kind, IntList) and cls == "huge":
        return f"1,{kind.high + 1}"
    return table[cls]


def good_value(option: Option, f: Files, out: Path) -> str:
    """A value that the option accepts, for the parts of a command line that are not under test."""
    name = type(option.kind).__name__
    if name == "ModelRef":
        return MODEL
    if getattr(option.kind, "need", None) == "dir":
        return f.images
    if name in ("ImagePath", "ExistingPath", "ImageFile"):
        return f.image
    if name == "OutDir":
        return str(out / "new-folder")
    if name == "NewFile":
        return str(out / "new-file.svg")
    if name == "NewFileOrDir":
        return str(out / "features.safetensors")
    if name == "Text":
        return "vit-base-patch16-224" if option.name == "model" else "a"
    if name == "Choice":
        return option.kind.choices[0]  # type: ignore[union-attr]
    if isinstance(option.kind, Int):
        return str(max(option.kind.low, 1))
    return "1"


# the context a command needs to get as far as checking the option under test
CONTEXT = {"segment": ["--point", "1,1"], "zero-shot": ["--labels", "a"], "serve": ["--model", MODEL],
           "track": ["--point", "0:1,1"]}


def base_line(command: Command, f: Files, out: Path, skip: set[str]) -> list[str]:
    """A valid command line: every required option and positional, plus the command's context."""
    line: list[str] = []
    for option in command.options:
        if option.name in skip:
            continue
        needed = option.required or (option.positional and (option.nargs not in ("?", "*")
                                                             or type(option.kind).__name__ == "ImagePath"))
        if needed:
            value = good_value(option, f, out)
            line += [value] if option.positional else [option.flags[0], value]
    context = list(CONTEXT.get(command.name, []))
    for k in range(0, len(context), 2):
        if context[k] not in skip and context[k] not in line:
            line += context[k: k + 2]
    return line


def mutation(option: Option, value: str | None) -> list[str]:
    if option.positional:
        return [value or ""]
    if value is None:  # a switch given a value
        return [f"{option.flags[-1]}=1"]
    return [f"{option.flags[-1]}={value}"]  # '=' so that '-1' or '' is the option's value


def cases() -> Iterator[tuple[str, str, str]]:
    """(command, option, class) for every class of wrong value of every option of every command."""
    for command in all_commands():
        for option in command.options:
            if option.kind is None:
                yield command.name, option.name, "value_for_switch"
                continue
            for cls in option.kind.bad:
                yield command.name, option.name, cls


CASES = list(cases())


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Patch every path to real work so that reaching it raises :class:`Reached`."""
    import kestrel
    import kestrel.inspect.diagram as diagram
    import kestrel.runtime.load as load_module
    import kestrel.scale as scale
    import kestrel.site.build as site_build
    from kestrel.cli import doctor

    def reached(*args, **kwargs):
        raise Reached(f"accepted: reached the work with {args!r:.200}")

    monkeypatch.setattr(load_module, "load", reached)
    monkeypatch.setattr(kestrel, "load", reached)
    monkeypatch.setattr(diagram, "write_diagram", reached)
    monkeypatch.setattr(scale, "run_job", reached)
    monkeypatch.setattr(site_build, "build_site", reached)
    monkeypatch.setattr(doctor, "gemm_rates", reached)
    monkeypatch.setattr(doctor, "physical_cores", reached)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.delenv("KESTREL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)  # default outputs (segment-out, site) land in the test's folder


def printable(text: str) -> str:
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def run_line(capsys, command: str, line: list[str]) -> tuple[int | str, str]:
    """(exit status or 'reached', stderr) of ``kestrel COMMAND LINE``."""
    try:
        code: int | str = main([command, *line])
    except SystemExit as e:
        code = int(e.code or 0)
    except Reached as e:
        code = f"reached ({e})"
    return code, capsys.readouterr().err


def check_refusal(command: str, line: list[str], code: int | str, err: str, names: list[str]) -> str | None:
    """What is wrong with the outcome, or None: exit 2, no traceback, one line naming one of ``names``."""
    first = (err.splitlines() or [""])[0]
    where = f"kestrel {command} {' '.join(printable(a) for a in line)}"
    if code != 2:
        return f"{where}: exit {code}, expected 2; stderr: {first}"
    if "Traceback" in err:
        return f"{where}: a traceback"
    if not first.startswith(f"kestrel {command}: error: "):
        return f"{where}: first line {first!r}"
    named = [n for n in names if n and (n in first or printable(n) in first or shown(n, 10**6)[1:-1] in first
                                        or os.path.basename(n) in first)]
    if not named:
        return f"{where}: the error does not name {names}: {first}"
    return None


def names_of(command: Command, option_name: str, value: str | None) -> list[str]:
    option = next(o for o in command.options if o.name == option_name)
    names = [*option.flags, option.label, f"argument {option.label}"]
    if value and option.kind is not None and type(option.kind).__name__ not in ("Int", "Float", "Choice"):
        names.append(value)
    return names


def test_every_option_of_every_command(capsys, files, no_work, tmp_path):
    """Each class of bad value of each option of each command, once: exit 2 naming it, nothing left behind."""
    commands = {c.name: c for c in all_commands()}
    assert set(commands) >= {"check", "inspect", "diagram", "export", "classify", "embed", "zero-shot",
                             "similarity", "site", "segment", "serve", "doctor", "bench"}
    failures = []
    for name, option_name, cls in CASES:
        command = commands[name]
        option = next(o for o in command.options if o.name == option_name)
        out = tmp_path / "outputs"
        out.mkdir(exist_ok=True)
        value = None if option.kind is None else bad_value(option.kind, cls, files)
        line = base_line(command, files, out, skip={option.name})
        line = mutation(option, value) + line if option.positional else line + mutation(option, value)
        code, err = run_line(capsys, name, line)
        problem = check_refusal(name, line, code, err, names_of(command, option_name, value))
        if problem:
            failures.append(f"[{cls}] {problem}")
        if any(out.iterdir()):
            failures.append(f"[{cls}] kestrel {name} {' '.join(map(printable, line))}: left {sorted(out.iterdir())}")
            for p in out.iterdir():
                p.unlink() if p.is_file() else None
    assert len(CASES) > 300, len(CASES)
    assert not failures, f"{len(failures)} of {len(CASES)} invocations:\n" + "\n".join(failures[:40])


JUNK = ["", " ", "0", "-1", "-0", "nan", "-inf", "inf", "1e309", "9" * 40, "0x10", "1_000", "１２", "½", "\u202e1",
        "a" * 5000, "--", "-", "=", ",", ":", "1,", ",1", "1,2,3,4,5", "{}", "%s", "\\", "x\x00y"]


@pytest.mark.fuzz
def test_random_command_lines(capsys, files, no_work, tmp_path):
    """Random command lines, one to three wrong values each (declared classes and junk text), fixed seed."""
    rng = random.Random(int(os.environ.get("KESTREL_FUZZ_SEED", "20261203")))
    commands = all_commands()
    runs, failures = 0, []
    budget = int(os.environ.get("KESTREL_FUZZ_RUNS", "4000"))
    out = tmp_path / "outputs"
    out.mkdir()
    while runs < budget:
        command = rng.choice(commands)
        valued = [o for o in command.options if o.kind is not None or not o.positional]
        picked = rng.sample(valued, k=min(len(valued), rng.randint(1, 3)))
        line = base_line(command, files, out, skip={o.name for o in picked})
        names: list[str] = []
        wrong = False
        for option in picked:
            if option.kind is None:
                value = None
                wrong = True
            elif option.kind.bad and rng.random() < 0.7:
                value = bad_value(option.kind, rng.choice(option.kind.bad), files)
                wrong = True
            else:
                value = rng.choice(JUNK)
            names += names_of(command, option.name, value)
            line += mutation(option, value)
        if rng.random() < 0.3:
            rng.shuffle(line)  # options in any order (positionals may then swap: still one clear line)
        code, err = run_line(capsys, command.name, line)
        runs += 1
        if isinstance(code, str) and not wrong:
            continue  # junk that happens to be acceptable text (a label '%s') may reach the work
        if code == 0 and not wrong:
            continue
        first = (err.splitlines() or [""])[0]
        if code == 3 or "Traceback" in err or isinstance(code, str) or code != 2 or \
                not first.startswith(f"kestrel {command.name}: error: "):
            failures.append(f"kestrel {command.name} {' '.join(map(printable, line))}: exit {code}: {first}")
        for p in out.iterdir():
            failures.append(f"kestrel {command.name} {' '.join(map(printable, line))}: left {p}")
            if p.is_file():
                p.unlink()
    print(f"\nCLI fuzzer: {runs} invocations, {len(failures)} failures")
    assert not failures, f"{len(failures)} of {runs} invocations:\n" + "\n".join(failures[:40])


def test_help_and_the_site_read_the_same_declarations(capsys):
    """Every declared option appears in its command's --help; the site's description lists the same."""
    from kestrel.cli.commands import command_names, describe
    from kestrel.site.build import served_tasks  # noqa: F401 (reads command_names, not argparse internals)

    described = {c["name"]: c for c in describe()}
    assert set(described) == command_names()
    for command in all_commands():
        with pytest.raises(SystemExit):
            main([command.name, "--help"])
        text = capsys.readouterr().out
        for option in command.options:
            assert option.label in text, (command.name, option.name)
        assert [o["name"] for o in described[command.name]["options"]] == [o.name for o in command.options]


def test_the_valid_lines_are_accepted(capsys, files, no_work, tmp_path):
    """The control: each command's base line (no wrong value) passes every check and reaches the work."""
    out = tmp_path / "outputs"
    out.mkdir()
    not_reached = []
    for command in all_commands():
        if command.name in ("check", "inspect"):
            continue  # their base line (no argument) is the whole registry's check: real work, not patched
        line = base_line(command, files, out, skip=set())
        code, err = run_line(capsys, command.name, line)
        if not (isinstance(code, str) and code.startswith("reached")):
            not_reached.append(f"kestrel {command.name} {' '.join(line)}: {code}: {err.splitlines()[:1]}")
    assert not not_reached, "\n".join(not_reached)
